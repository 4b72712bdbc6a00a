"""A/B of a template change: the same configurations rendered from the templates of a git
revision (before) and of the working tree (after), gated and timed in one process.

    python benchmarks/template_ab.py --before HEAD~1 \
        --config PATH=mma,BLOCK_M=128,BLOCK_N=64,WARPS=4,VEC=8,STAGES=1,SMEM_LAYOUT=swizzle,Q_IN_REGS=0,P_IN_REGS=1,SPLITS=1 \
        --shape 4,16,2048,128

Every configuration is checked against fp32 SDPA on the edge shapes and the timed shapes
(NaN-poisoned output, the space's tolerances), then timed with the project's harness
(CUDA-graph replay, inputs rotated so the L2 holds none of them). Parameters the before
templates do not read are ignored by them. Prints, per shape, before µs -> after µs
(before / after: above 1, the change helped).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evoengineer.gpu import AttentionKernel
from evoengineer.gpu.evaluate import EDGE_SEQS, gate_launcher, time_launcher
from evoengineer.kernels import arch_for_device, compile_many, render
from evoengineer.resources import templates_dir
from evoengineer.space import Case, Config, load_space, parse_shape


def checkout_templates(revision: str, into: Path) -> Path:
    """The files of ``templates/`` at a git revision, written under ``into``."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip())
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:templates"], capture_output=True, text=True,
                           check=True, cwd=root).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{revision}:templates/{name}"], capture_output=True, check=True, cwd=root).stdout
        (into / name).write_bytes(blob)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD",
                        help="git revision whose templates/ render the 'before' kernels, or a directory of templates (default HEAD)")
    parser.add_argument("--config", action="append", required=True, help="a configuration NAME=VALUE,... (repeatable)")
    parser.add_argument("--space", default="h100", help="space whose shapes and tolerances to use (default h100)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S,D",
                        help="time this shape, full and causal, instead of the space's shapes (repeatable); "
                             "B,H,S/S_KV,D for a K/V length other than S, e.g. 8,32,1/4096,128")
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    args = parser.parse_args(argv)

    import torch

    space = load_space(args.space)
    cases = [Case(b, h, seq, d, causal, dtype=dtype, seq_kv=seq_kv) for b, h, seq, d, seq_kv in map(parse_shape, args.shape)
             for dtype in space.dtypes for causal in (False, True)] or list(space.cases)
    configs = [Config.parse(c) for c in args.config]
    arch = arch_for_device("sm_%d%d" % torch.cuda.get_device_capability(), space.target.arch)
    timing = {"flush_l2": True, "repetitions": space.timing.repetitions, "warmup": space.timing.warmup}  # every repetition
    console = Console(highlight=False, width=200)

    with tempfile.TemporaryDirectory() as tmp:
        before = Path(args.before) if Path(args.before).is_dir() else checkout_templates(args.before, Path(tmp))
        dirs = {"before": before, "after": templates_dir()}
        jobs = [(side, i, v) for side in dirs for i in range(len(configs)) for v in dict.fromkeys(c.variant for c in cases)]
        rendered = {(side, i, v): render("flash_attention", configs[i], v, dirs[side]) for side, i, v in jobs}
        builds = dict(zip(jobs, compile_many([rendered[j].source for j in jobs], arch)))
    failed = [f"{side} #{i + 1} {v.label()}: {b.error.splitlines()[0] if b.error else 'failed'}" for (side, i, v), b in builds.items() if not b.ok]
    for line in failed:
        console.print(f"[red]compile failed[/] {line}")
    kernels = {j: AttentionKernel(rendered[j], builds[j].cubin_path) for j in jobs if builds[j].ok}

    # Each kernel is gated once, on the edge shapes and every timed shape of its variant.
    verdicts = {}
    for (side, i, v), kern in kernels.items():
        gate = [Case(b, h, s, v.head_dim, v.causal, dtype=v.dtype) for b, h, s in EDGE_SEQS] + [c for c in cases if c.variant == v]
        verdicts[(side, i, v)] = next((r for r in (gate_launcher(kern, g, space.scale, *space.tolerance(v.dtype), seed=0, trials=1)
                                                  for g in gate) if r.status != "ok"), None)
    figures: dict[str, dict] = {}
    for case in cases:
        for (side, i, v), kern in kernels.items():
            if v != case.variant:
                continue
            bad = verdicts[(side, i, v)]
            entry = figures.setdefault(case.label(), {}).setdefault(f"#{i + 1}", {})
            if bad is not None:
                entry[side] = {"status": "incorrect", "reason": bad.reason}
                continue
            raw = lambda q, k, v_, o, s, kern=kern: kern(q, k, v_, o, s, checked=False)  # noqa: E731
            entry[side] = {"status": "ok", "us": time_launcher(raw, case, space.scale, timing, seed=0)["time"]["median_us"]}

    table = Table(title=f"templates at {args.before} (before) and in the working tree (after) on {torch.cuda.get_device_name()}: "
                        "device µs, before -> after (before / after)")
    table.add_column("shape")
    for i in range(len(configs)):
        table.add_column(f"#{i + 1}", justify="right")
    for label, row in figures.items():
        cells = []
        for i in range(len(configs)):
            e = row.get(f"#{i + 1}", {})
            b, a = e.get("before", {}), e.get("after", {})
            if b.get("status") == a.get("status") == "ok":
                cells.append(f"{b['us']:.1f} -> {a['us']:.1f} ({b['us'] / a['us']:.2f})")
            else:
                cells.append(" / ".join(f"{side}: {x.get('status', 'not built')}" for side, x in (("before", b), ("after", a))))
        table.add_row(label, *cells)
    console.print(table)
    for i, c in enumerate(configs):
        console.print(f"#{i + 1} {c.label()}")
    for (label, row) in figures.items():
        for name, e in row.items():
            for side, x in e.items():
                if x["status"] != "ok":
                    console.print(f"[red]{side} {name} {label}:[/] {x['reason']}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "before": args.before,
                                         "configs": [c.to_dict() for c in configs], "figures": figures}, indent=1))
    ok = not failed and all(x["status"] == "ok" for row in figures.values() for e in row.values() for x in e.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
