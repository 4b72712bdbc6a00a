"""A/B of the wgmma path's loads: each configuration with LOAD=cpasync and with LOAD=tma,
evaluated as a search evaluates it, on large shapes, full and causal.

    python benchmarks/tma_ab.py                      # the TMA seed and three neighbours, both loads
    python benchmarks/tma_ab.py --rounds 3 --json tma_ab.json
    python benchmarks/tma_ab.py --config PATH=wgmma,...,LOAD=tma   # more pairs (either LOAD names the pair)
    python benchmarks/tma_ab.py --compile-only       # no GPU: render and compile every kernel for sm_90a

Each configuration goes through ``evoengineer.gpu.Evaluator``, the search's harness: compiled for
sm_90a, gated against fp32 SDPA on the cases plus the edge shapes (1, 5, 77, 257 tokens) in a
crash-isolating worker process, then timed by CUDA-graph replay with inputs rotated so the L2
holds none of them (device time, median of the replays). A kernel that faults or hangs becomes a
status (launch_failed, crashed, timeout), its worker is replaced and the A/B goes on. With
``--rounds N`` the loads alternate N times and each case keeps the median. Prints per case the
TF/s of both loads, tma / cpasync (above 1: TMA is faster) and the largest absolute error
against SDPA of each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evoengineer.kernels import build_config
from evoengineer.space import Case, Config, load_space, parse_shape

SHAPES = ((4, 16, 2048, 64), (4, 16, 2048, 128), (8, 16, 4096, 128))
SPACE = load_space("h100")
SEED = next(c for c in SPACE.search.seeds if c["PATH"] == "wgmma" and c["LOAD"] == "tma")
NEIGHBOURS = (
    SEED.replace(BLOCK_N=192),                                                    # the fastest cp.async seed's tile
    SEED.replace(PINGPONG=0),                                                     # no ping-pong
    SEED.replace(PRODUCER=0, REG_PRODUCER=0, REG_CONSUMER=0, PINGPONG=0, STAGES=3),  # no producer: thread 0 issues
)


def ab_space(shapes: list[tuple[int, int, int, int]], timeout_s: float, repetitions: int | None):
    """The h100 space with these shapes (full and causal) as its cases."""
    cases = tuple(Case(b, h, s, d, causal) for b, h, s, d in shapes for causal in (False, True))
    timing = replace(SPACE.timing, timeout_s=timeout_s, flush_l2=True,
                     repetitions=repetitions or SPACE.timing.repetitions)
    return replace(SPACE, cases=cases, timing=timing)


def pairs(extra: list[str]) -> list[dict[str, Config]]:
    """(cpasync, tma) of the seed, its neighbours and each ``--config``; SystemExit for one outside the space."""
    found = []
    for config in [SEED, *NEIGHBOURS, *(Config({**dict(SEED), **dict(Config.parse(text))}) for text in extra)]:
        pair = {load: config.replace(LOAD=load) for load in ("cpasync", "tma")}
        for c in pair.values():
            if not SPACE.contains(c):
                raise SystemExit(f"not in the h100 space: {c.label()} ({'; '.join(SPACE.violations(c)) or 'unknown parameter'})")
        if pair not in found:
            found.append(pair)
    return found


def compile_only(space, found: list[dict[str, Config]], console: Console) -> dict:
    table = Table(title="sm_90a builds (every variant): registers at launch, spills")
    for column in ("configuration", "cpasync", "tma"):
        table.add_column(column)
    rows, ok = [], True
    for pair in found:
        cells = {}
        for load, config in pair.items():
            report = build_config(space.template, config, space.variants, "sm_90a", space.target.smem_per_block)
            ok &= report.status == "compiled"
            cells[load] = {"status": report.status, "registers": report.registers, "spill_bytes": report.spill_bytes,
                           "smem": report.smem, "error": report.error}
        rows.append({"config": pair["tma"].short_label(), **cells})
        table.add_row(pair["cpasync"].short_label(), *(
            f"{c['registers']} regs, {c['spill_bytes']} B spilled" if c["status"] == "compiled" else c["error"][:60]
            for c in (cells["cpasync"], cells["tma"])))
    console.print(table)
    return {"compile_only": True, "ok": ok, "rows": rows}


def evaluate_all(space, found: list[dict[str, Config]], rounds: int, device: int, console: Console) -> dict:
    from evoengineer.gpu import Evaluator

    figures: dict[tuple[int, str], dict] = {}
    with Evaluator(space, device=device, gate_trials=1) as evaluator:
        info = evaluator.info()
        console.print(f"{info.get('gpu')} ({info.get('arch')}), driver {info.get('driver', '?')}, torch {info.get('torch')}, "
                      f"cupy {info.get('cupy')}")
        for r in range(rounds):
            for i, pair in enumerate(found):
                for load, config in pair.items():
                    result = evaluator.evaluate(config)
                    entry = figures.setdefault((i, load), {"status": "ok", "reason": "", "cases": {}, "resources": {}})
                    entry["resources"] = result.resources
                    if result.status != "ok":
                        entry.update(status=result.status, reason=result.reason)
                        console.print(f"[red]round {r + 1} #{i + 1} {load}: {result.status}[/] {result.reason[:300]}")
                        continue
                    for case in result.cases:
                        if case.get("time"):
                            per = entry["cases"].setdefault(case["label"], {"us": [], "tflops": [], "max_abs_err": 0.0})
                            per["us"].append(case["time"]["median_us"])
                            per["tflops"].append(case["tflops"])
                            per["max_abs_err"] = max(per["max_abs_err"], case.get("max_abs_err") or 0.0)
                    console.print(f"round {r + 1} #{i + 1} {load}: ok, geomean {result.objective_us:.1f} µs")
    return {"gpu": info, "figures": figures}


def report(space, found: list[dict[str, Config]], figures: dict, console: Console) -> list[dict]:
    table = Table(title="LOAD=cpasync against LOAD=tma: TF/s (median of rounds), tma / cpasync, max |error| against fp32 SDPA")
    for column, justify in (("#", "right"), ("case", "left"), ("cpasync TF/s", "right"), ("tma TF/s", "right"),
                            ("tma/cpasync", "right"), ("err cpasync", "right"), ("err tma", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    rows = []
    for i, pair in enumerate(found):
        a, b = figures.get((i, "cpasync"), {}), figures.get((i, "tma"), {})
        for case in space.cases:
            label = case.label()
            ca, cb = a.get("cases", {}).get(label), b.get("cases", {}).get(label)
            row = {"pair": i + 1, "config": pair["tma"].short_label(), "case": label,
                   "cpasync": _summary(ca, a), "tma": _summary(cb, b)}
            if ca and cb:
                row["tma_over_cpasync"] = statistics.median(ca["us"]) / statistics.median(cb["us"])
            rows.append(row)
            table.add_row(str(i + 1), label, _cell(row["cpasync"]), _cell(row["tma"]),
                          f"{row['tma_over_cpasync']:.3f}" if "tma_over_cpasync" in row else "-",
                          _err(row["cpasync"]), _err(row["tma"]))
    console.print(table)
    for i, pair in enumerate(found):
        console.print(f"#{i + 1} {pair['cpasync'].short_label()}  (--config {pair['tma'].label()})")
    ratios = [r["tma_over_cpasync"] for r in rows if "tma_over_cpasync" in r]
    if ratios:
        console.print(f"tma / cpasync over {len(ratios)} cases: geomean {statistics.geometric_mean(ratios):.3f}, "
                      f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    return rows


def _summary(case: dict | None, entry: dict) -> dict:
    if not case:
        return {"status": entry.get("status", "not run"), "reason": entry.get("reason", "")}
    return {"status": "ok", "median_us": statistics.median(case["us"]), "tflops": statistics.median(case["tflops"]),
            "max_abs_err": case["max_abs_err"], "rounds": len(case["us"])}


def _cell(s: dict) -> str:
    return f"{s['tflops']:.0f}" if s["status"] == "ok" else f"[red]{s['status']}[/]"


def _err(s: dict) -> str:
    return f"{s['max_abs_err']:.1e}" if s["status"] == "ok" else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], help="another pair: NAME=VALUE,... over the TMA seed (repeatable)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S,D",
                        help="time this shape, full and causal, instead of B4 H16 S2048 D64/D128 and B8 H16 S4096 D128")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the loads this many times (default 1)")
    parser.add_argument("--repetitions", type=int, help="graph replays per timing (default: the h100 space's)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per gate or timing job before a hang is declared")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile every kernel for sm_90a and report")
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    args = parser.parse_args(argv)

    console = Console(highlight=False, width=160)
    shapes = [parse_shape(s) for s in args.shape] or list(SHAPES)
    space = ab_space(shapes, args.timeout, args.repetitions)
    found = pairs(args.config)
    if args.compile_only:
        out = compile_only(space, found, console)
        ok = out["ok"]
    else:
        done = evaluate_all(space, found, args.rounds, args.device, console)
        rows = report(space, found, done["figures"], console)
        out = {"gpu": done["gpu"], "rounds": args.rounds, "shapes": shapes, "rows": rows,
               "configs": [{load: c.to_dict() for load, c in pair.items()} for pair in found],
               "statuses": {f"#{i + 1} {load}": {k: v for k, v in e.items() if k != "cases"}
                            for (i, load), e in done["figures"].items()}}
        ok = all(e["status"] == "ok" for e in done["figures"].values())
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
