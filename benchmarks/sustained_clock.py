"""Kernels called back to back for seconds, as under a long run: time per call, the SM clock and
the board power (nvidia-smi every 50 ms), so that a difference in the table can be told apart
from a difference in the clock the power limit leaves each kernel.

    python benchmarks/sustained_clock.py --shape 4,16,2048,128 --sdpa cudnn \\
        --config PERSISTENT=2,O_TMA=1,REG_PRODUCER=32,REG_CONSUMER=232 \\
        --config PERSISTENT=1,O_TMA=1,REG_PRODUCER=32,REG_CONSUMER=232 --seconds 4 --rounds 2

Each kernel is checked against fp32 SDPA first. Calls rotate over input sets that together
outgrow the L2 and are replayed from one CUDA graph, so the GPU never waits for Python. Rounds
interleave the kernels (A B C, then C B A). Per kernel and round: µs per call, and the medians of
the SM clock and the power over the last three quarters of the samples; mJ per call is their
product (``evoengineer.bench.clock``). ``--config`` overrides the h100 space's TMA seed;
``--sdpa`` adds SDPA backends.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,16,2048,128", metavar="B,H,S,D", help="B,H,S,D (default 4,16,2048,128)")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--config", action="append", default=[], help="NAME=VALUE,... over the TMA seed (repeatable)")
    parser.add_argument("--sdpa", action="append", default=[], choices=("cudnn", "flash", "efficient"),
                        help="an SDPA backend (repeatable)")
    parser.add_argument("--fa4", action="store_true", help="add flash-attn-4's forward (flash_attn.cute), if importable")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of calls per kernel and round (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all kernels (default 2)")
    parser.add_argument("--gpu", type=int, default=0, help="nvidia-smi's index of the GPU (default 0)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not args.config and not args.sdpa and not args.fa4:
        parser.error("give at least one --config, --sdpa or --fa4")

    import torch

    from evoengineer.bench.clock import sustained_lines, sustained_rounds
    from evoengineer.bench.rotation import attention_set_bytes, cold_set_count
    from evoengineer.bench.subjects import MAX_ERROR, compiled_kernel, reference_op, seed_config
    from evoengineer.space import parse_shape

    batch, heads, seq, head_dim, seq_kv = parse_shape(args.shape)
    torch.manual_seed(0)
    inputs = []
    for _ in range(cold_set_count(attention_set_bytes(batch, heads, heads, seq, seq_kv, head_dim), at_least=2)):
        q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, heads, seq_kv, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
        inputs.append((q, k, v, torch.empty_like(q)))
    q0, k0, v0, _ = inputs[0]
    reference = torch.nn.functional.scaled_dot_product_attention(q0.float(), k0.float(), v0.float(), is_causal=args.causal)
    flops = 4 * batch * heads * seq * seq_kv * head_dim / (2 if args.causal else 1)

    kernels: dict[str, list] = {}
    for backend in args.sdpa:
        kernels[f"SDPA {backend}"] = [reference_op(backend, q, k, v, args.causal) for q, k, v, _ in inputs]
    if args.fa4:
        kernels["flash-attn-4"] = [reference_op("fa4", q, k, v, args.causal) for q, k, v, _ in inputs]
    for overrides in args.config:
        config = seed_config(overrides)
        kernel = compiled_kernel(config, head_dim, args.causal)
        kernels[config.short_label()] = [lambda q=q, k=k, v=v, o=o, kernel=kernel: kernel(q, k, v, o, checked=False)
                                         for q, k, v, o in inputs]
    for label, ops in list(kernels.items()):
        error = (ops[0]().float() - reference).abs().max().item()
        if not error < MAX_ERROR:
            print(f"{label}: max |error| {error:.2e} against fp32 SDPA, left out", file=sys.stderr)
            del kernels[label]
    if not kernels:
        return 1

    figures = sustained_rounds(kernels, args.seconds, args.rounds, args.gpu, flops)
    base = next(iter(figures))
    print(f"{torch.cuda.get_device_name()}: B{batch} H{heads} S{seq} D{head_dim}{' causal' if args.causal else ''}, "
          f"{args.seconds:g} s of calls a round")
    print(f"÷{base.split()[-1]}: µs over the median of {base}'s rounds; MHz, W: medians of nvidia-smi's samples over "
          "the last three quarters of the round; mJ: a call's energy")
    print("\n".join(sustained_lines(figures)))
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": args.shape, "causal": args.causal,
                                         "seconds": args.seconds, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
