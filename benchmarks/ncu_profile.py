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
import collections
import csv
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"
MAX_ERROR = 2e-2   # largest |error| against fp32 SDPA of a kernel worth timing (fp16 outputs of about unit size)


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of a profiled kernel with its warp-stall samples."""

    sass: str
    samples: int
    not_issued: int
    executed: int

    @property
    def opcode(self) -> str:
        """``HGMMA.64x128x16``, ``WARPGROUP.DEPBAR``, ``MUFU``: the mnemonic without its predicate,
        with the first modifier kept for the warpgroup, barrier and HGMMA instructions."""
        words = [w for w in self.sass.split() if not w.startswith("@")]
        parts = words[0].rstrip(",;").split(".") if words else ["?"]
        return ".".join(parts[:2]) if parts[0] in ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "DEPBAR") else parts[0]


def read_source_csv(text: str) -> dict[str, list[Instruction]]:
    """The kernels of ``ncu --page source --csv --print-source sass`` output, by name, in order."""
    kernels: dict[str, list[Instruction]] = {}
    for block in re.split(r'(?m)^"Kernel Name",', text)[1:]:
        head, _, rest = block.partition("\n")
        name = next(csv.reader([head]))[0]
        rows = csv.DictReader(io.StringIO(rest))
        kernels[name] = [Instruction(r["Source"].strip(), int(r[SAMPLES] or 0), int(r[NOT_ISSUED] or 0), int(r[EXECUTED] or 0))
                         for r in rows]
    return kernels


def by_execution_count(instructions: list[Instruction]) -> list[tuple[int, int, int]]:
    """(times executed, instructions, samples) per execution count, most samples first."""
    count: collections.Counter[int] = collections.Counter()
    samples: collections.Counter[int] = collections.Counter()
    for ins in instructions:
        count[ins.executed] += 1
        samples[ins.executed] += ins.samples
    return sorted(((e, count[e], samples[e]) for e in count), key=lambda x: (-x[2], -x[0]))


def by_opcode(instructions: list[Instruction]) -> list[tuple[str, int, int, int]]:
    """(opcode, samples, not-issued samples, times executed) per opcode, most samples first."""
    acc: dict[str, list[int]] = {}
    for ins in instructions:
        a = acc.setdefault(ins.opcode, [0, 0, 0])
        a[0] += ins.samples
        a[1] += ins.not_issued
        a[2] += ins.executed
    return sorted(((op, *a) for op, a in acc.items()), key=lambda x: -x[1])


def summarize(path: Path, kernel: str, rows: int) -> list[str]:
    """Lines of the summary of one CSV file's kernels whose name matches ``kernel``."""
    lines = []
    for name, instructions in read_source_csv(path.read_text()).items():
        if not re.search(kernel, name):
            continue
        total = sum(i.samples for i in instructions) or 1
        lines.append(f"{path.name}: {name[:60]}")
        lines.append(f"  {total} samples, {sum(i.not_issued for i in instructions)} not issued, "
                     f"{sum(i.executed for i in instructions)} warp instructions executed")
        lines.append(f"  {'executed':>10} {'instrs':>7} {'samples':>8} {'share':>6}")
        for executed, n, s in by_execution_count(instructions)[:rows]:
            lines.append(f"  {executed:>10} {n:>7} {s:>8} {100 * s / total:>5.1f}%")
        lines.append(f"  {'opcode':<20} {'samples':>8} {'share':>6} {'not iss.':>8} {'executed':>10}")
        for op, s, ni, executed in by_opcode(instructions)[:rows]:
            lines.append(f"  {op:<20} {s:>8} {100 * s / total:>5.1f}% {ni:>8} {executed:>10}")
    return lines


def sdpa_call(backend: str, q, k, v, causal: bool):
    """A call of SDPA with one backend ('cudnn', 'flash', 'efficient') on q, k, v."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def run():
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def fa4_call(q, k, v, causal: bool):
    """flash-attn-4's forward (flash_attn.cute) on (B, S, H, D) copies of q, k, v, made once;
    returns the output laid out (B, H, S, D)."""
    from flash_attn.cute import flash_attn_func

    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def run():
        out = flash_attn_func(q, k, v, causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return run


def seed_kernel(overrides: str | None, head_dim: int, causal: bool):
    """(short label, AttentionKernel) of the h100 space's TMA seed with ``overrides``
    (NAME=VALUE,...), compiled for the GPU present; SystemExit where it does not compile."""
    import torch

    from evoengineer.gpu import AttentionKernel
    from evoengineer.kernels import arch_for_device, compile_many, render
    from evoengineer.space import Config, Variant, load_space

    space = load_space("h100")
    seed = next(c for c in space.search.seeds if c["PATH"] == "wgmma" and c["LOAD"] == "tma")
    config = Config({**dict(seed), **dict(Config.parse(overrides))}) if overrides else seed
    rendered = render("flash_attention", config, Variant(head_dim, causal))
    arch = arch_for_device("sm_%d%d" % torch.cuda.get_device_capability(), space.target.arch)
    (build,) = compile_many([rendered.source], arch)
    if not build.ok:
        raise SystemExit(f"compile failed: {build.error.splitlines()[0] if build.error else config.label()}")
    return config.short_label(), AttentionKernel(rendered, build.cubin_path)


def launch(args: argparse.Namespace) -> int:
    """Check the kernel against fp32 SDPA, then run it once between cudaProfilerStart/Stop."""
    import torch

    from evoengineer.space import parse_shape

    batch, heads, seq, head_dim, seq_kv = parse_shape(args.shape)
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(batch, heads, seq_kv, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    if args.sdpa:
        run, label = sdpa_call(args.sdpa, q, k, v, args.causal), f"SDPA {args.sdpa}"
    elif args.fa4:
        run, label = fa4_call(q, k, v, args.causal), "flash-attn-4"
    else:
        label, kernel = seed_kernel(args.config, head_dim, args.causal)

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
