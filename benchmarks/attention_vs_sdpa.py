"""The best configuration of each path (scalar, wmma, mma) against every SDPA backend.

Every figure comes from one run on one GPU: each configuration is gated and timed by
the same harness (CUDA-graph replay, device time, cold L2) that times SDPA's backends.

    python benchmarks/attention_vs_sdpa.py --space h100                      # hand-picked configs
    python benchmarks/attention_vs_sdpa.py --space h100 --leaderboard runs/<run>
    python benchmarks/attention_vs_sdpa.py --space h100 --config PATH=wmma,BLOCK_M=64,...

Ratios are time / SDPA backend's time (below 1: faster than SDPA); TF/s counts the
matmul FLOPs (halved for causal).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evoengineer.candidate import Config
from evoengineer.evaluate import SDPA_BACKENDS, Evaluator, fastest_sdpa
from evoengineer.space import Case, load_space

HAND_PICKED = {  # the best of each path in an h100 search (runs/h100, NVIDIA H100)
    "scalar": "PATH=scalar,BLOCK_M=16,BLOCK_N=64,WARPS=4,VEC=8",
    "wmma": "PATH=wmma,BLOCK_M=64,BLOCK_N=32,WARPS=2,VEC=8",
    "mma": "PATH=mma,BLOCK_M=64,BLOCK_N=128,WARPS=4,VEC=8,STAGES=1,SMEM_LAYOUT=swizzle,Q_IN_REGS=0,P_IN_REGS=1,SPLITS=1",
}


def configs_from_leaderboard(run: Path) -> list[Config]:
    """The fastest ok configuration of each path among a run's results."""
    best: dict[str, dict] = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        path = r["config"]["PATH"]
        if r["status"] == "ok" and (path not in best or r["objective_us"] < best[path]["objective_us"]):
            best[path] = r
    return [Config(r["config"]) for r in sorted(best.values(), key=lambda r: r["objective_us"])]


def column_name(config: dict) -> str:
    """``mma 64x128 w4 s2``: the path and its tile, enough to tell configurations apart."""
    name = f"{config['PATH']} {config['BLOCK_M']}x{config['BLOCK_N']} w{config['WARPS']}"
    return name + (f" split{config['SPLITS']}" if config.get("SPLITS", 1) > 1 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", default="h100")
    parser.add_argument("--leaderboard", type=Path, help="a run directory: its best configuration per path")
    parser.add_argument("--config", action="append", default=[], help="a configuration NAME=VALUE,... (repeatable)")
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    parser.add_argument("--trials", type=int, default=2, help="gate draws per shape")
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S,D",
                        help="also measure this shape, full and causal (repeatable), e.g. 8,16,4096,128")
    args = parser.parse_args(argv)

    space = load_space(args.space)
    extra = []
    for text in args.shape:
        b, h, seq, d = (int(x) for x in text.split(","))
        extra += [Case(b, h, seq, d, False), Case(b, h, seq, d, True)]
    if extra:
        space = dataclasses.replace(space, cases=tuple(dict.fromkeys(space.cases + tuple(extra))))
    if args.config:
        configs = [Config.parse(c) for c in args.config]
    elif args.leaderboard:
        configs = configs_from_leaderboard(args.leaderboard)
    else:
        paths = space.param("PATH").values
        configs = [Config.parse(HAND_PICKED[p]) for p in paths if p in HAND_PICKED]
    configs = [Config({p.name: c.get(p.name, p.values[0]) for p in space.params}) for c in configs]

    console = Console(highlight=False, width=200)
    results = []
    with Evaluator(space, gate_trials=args.trials) as ev:
        info = ev.info()
        ev.arch = info["arch"]
        baseline = ev.baseline()
        for config in configs:
            console.print(f"evaluating {config.label()}", style="dim")
            results.append(ev.evaluate(config))
    best = fastest_sdpa(baseline)

    table = Table(title=f"{space.name} on {info['gpu']}: device time µs, ratio = time / SDPA time (< 1 is faster)")
    table.add_column("shape")
    for b in SDPA_BACKENDS:
        table.add_column(f"SDPA {b}", justify="right")
    for r in results:
        name = column_name(r.config)
        table.add_column(f"{name}\nµs | TF/s", justify="right")
        table.add_column(f"{name}\n/fastest /flash /cudnn", justify="right")
    rows = []
    for case in space.cases:
        label = case.label()
        sd = baseline.get(label, {})
        cells = [f"{sd[b]['time']['median_us']:.1f}" if sd.get(b, {}).get("status") == "ok" else "-" for b in SDPA_BACKENDS]
        row = {"shape": label, "sdpa": {b: sd[b]["time"]["median_us"] for b in SDPA_BACKENDS if sd.get(b, {}).get("status") == "ok"}}
        for r in results:
            case_result = next((c for c in r.cases if c["label"] == label and c.get("time")), None)
            if case_result is None:
                cells += [r.status, r.reason[:40]]
                continue
            us = case_result["time"]["median_us"]
            ratios = [us / best[label][1]] + [us / row["sdpa"][b] if b in row["sdpa"] else float("nan") for b in ("flash", "cudnn")]
            cells += [f"{us:.1f} | {case_result['tflops']:.0f}", " ".join(f"{x:.2f}" for x in ratios)]
            row[column_name(r.config)] = {"config": r.config, "us": us,
                                     "tflops": case_result["tflops"], "ratio_fastest": ratios[0], "ratio_flash": ratios[1],
                                     "ratio_cudnn": ratios[2], "max_abs_err": case_result.get("max_abs_err")}
        table.add_row(label, *cells)
        rows.append(row)
    console.print(table)
    for r in results:
        status = f"{r.status} {r.reason}".strip()
        console.print(f"{r.config['PATH']}: {Config(r.config).label()}  {status}  "
                      f"resources {r.resources}  gate max abs err "
                      f"{max((c.get('max_abs_err') or 0) for c in r.cases) if r.cases else '-'}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": info, "space": space.name, "baseline": baseline, "rows": rows,
                                         "results": [r.to_json() for r in results]}, indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
