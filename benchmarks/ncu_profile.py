"""One launch of a configuration (or of an SDPA backend) for Nsight Compute, and a summary of
Nsight Compute's per-instruction warp-stall samples.

On the GPU box, one launch of ours and one of cuDNN, each checked against fp32 SDPA first:

    ncu --profile-from-start off --section WarpStateStats --section SourceCounters \\
        --section SpeedOfLight -o ours -f python benchmarks/ncu_profile.py launch \\
        --config PERSISTENT=2,O_TMA=1,REG_PRODUCER=32,REG_CONSUMER=232 --shape 4,16,2048,128
    ncu ... -o cudnn -f python benchmarks/ncu_profile.py launch --sdpa cudnn --shape 4,16,2048,128
    ncu ... -o fa4 -f python benchmarks/ncu_profile.py launch --fa4 --shape 4,16,2048,128   # if installed
    ncu -i ours.ncu-rep --page source --csv --print-source sass > ours.csv      # and cudnn.csv

Anywhere (no GPU), the two side by side:

    python benchmarks/ncu_profile.py summary ours.csv cudnn.csv

The summary groups a kernel's instructions by how often each was executed. Instructions run
equally often belong to one level of the kernel's loops: the most executed group is the K/V
loop's body, the next ones run once per work tile or once per CTA. Their shares of the stall
samples show where the time goes (a sample is one warp, at one moment, at that instruction).
The opcodes with the most samples follow. ``--config`` overrides the h100 space's TMA seed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evoengineer.bench.ncu import summarize


def launch(args: argparse.Namespace) -> int:
    """Check the kernel against fp32 SDPA, then run it once between cudaProfilerStart/Stop."""
    import torch

    from evoengineer.bench.subjects import MAX_ERROR, compiled_kernel, reference_op, seed_config
    from evoengineer.space import parse_shape

    batch, heads, seq, head_dim, seq_kv = parse_shape(args.shape)
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(batch, heads, seq_kv, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    if args.sdpa:
        run, label = reference_op(args.sdpa, q, k, v, args.causal), f"SDPA {args.sdpa}"
    elif args.fa4:
        run, label = reference_op("fa4", q, k, v, args.causal), "flash-attn-4"
    else:
        config = seed_config(args.config)
        label, kernel = config.short_label(), compiled_kernel(config, head_dim, args.causal)

        def run():
            return kernel(q, k, v, out, checked=False)
    for _ in range(5):
        run()
    reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=args.causal)
    error = (run().float() - reference).abs().max().item()
    print(f"{label} {args.shape}{' causal' if args.causal else ''}: max |error| against fp32 SDPA {error:.2e}")
    if not error < MAX_ERROR:
        print("wrong result: not profiled", file=sys.stderr)
        return 1
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("launch", help="one checked launch between cudaProfilerStart/Stop (GPU)")
    one.add_argument("--shape", default="4,16,2048,128", metavar="B,H,S,D", help="B,H,S,D or B,H,S/S_KV,D (default 4,16,2048,128)")
    one.add_argument("--causal", action="store_true", help="causal attention")
    who = one.add_mutually_exclusive_group()
    who.add_argument("--config", help="NAME=VALUE,... over the h100 space's TMA seed (default: the seed)")
    who.add_argument("--sdpa", choices=("cudnn", "flash", "efficient"), help="an SDPA backend instead of ours")
    who.add_argument("--fa4", action="store_true", help="flash-attn-4's forward (flash_attn.cute) instead of ours")
    summary = sub.add_parser("summary", help="warp-stall samples of ncu's source page (no GPU)")
    summary.add_argument("csv", nargs="+", type=Path, help="ncu -i REPORT --page source --csv --print-source sass > FILE")
    summary.add_argument("--kernel", default=".", help="regular expression of the kernel names to show (default: all)")
    summary.add_argument("--rows", type=int, default=10, help="rows per table (default 10)")
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch(args)
    for path in args.csv:
        if not path.is_file():
            print(f"{path}: no such file", file=sys.stderr)
            return 2
        lines = summarize(path, args.kernel, args.rows)
        print("\n".join(lines) if lines else f"{path}: no kernel matches {args.kernel!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
