"""A/B of one wgmma-path parameter: each configuration with two values of it (by default
LOAD=cpasync against LOAD=tma), evaluated as a search evaluates it, on large shapes, full and causal.

    python benchmarks/wgmma_ab.py                    # the TMA seed and three neighbours, both loads
    python benchmarks/wgmma_ab.py --rounds 3 --json ab.json
    python benchmarks/wgmma_ab.py --config BLOCK_N=192           # more pairs over the TMA seed
    python benchmarks/wgmma_ab.py --param PERSISTENT=0,1 --config BLOCK_N=176   # another parameter
    python benchmarks/wgmma_ab.py --compile-only     # no GPU: render and compile every kernel for sm_90a

Each configuration goes through ``evoengineer.gpu.Evaluator``, the search's harness: compiled for
sm_90a, gated against fp32 SDPA on the cases plus the edge shapes (1, 5, 77, 257 tokens) in a
crash-isolating worker process, then timed by CUDA-graph replay with inputs rotated so the L2
holds none of them (device time, median of the replays). A kernel that faults or hangs becomes a
status (launch_failed, crashed, timeout), its worker is replaced and the A/B goes on. With
``--rounds N`` the two values alternate N times and each case keeps the median. Prints per case
the TF/s of both, B / A (the second value's speed over the first's: above 1, B is faster) and
the largest absolute error against SDPA of each. The TMA seed's neighbours are pairs of the
default parameter (LOAD) only; for another, the seed and each ``--config``.
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

from evoengineer.kernels import RenderError, build_config, render
from evoengineer.space import Case, Config, Variant, load_space, parse_shape
from evoengineer.space.model import Param

SHAPES = ((4, 16, 2048, 64), (4, 16, 2048, 128), (8, 16, 4096, 128))
SPACE = load_space("h100")
SEED = next(c for c in SPACE.search.seeds if c["PATH"] == "wgmma" and c["LOAD"] == "tma")
NEIGHBOURS = (
    SEED.replace(BLOCK_N=192),                                                    # the fastest cp.async seed's tile
    SEED.replace(PINGPONG=0),                                                     # no ping-pong
    SEED.replace(PRODUCER=0, REG_PRODUCER=0, REG_CONSUMER=0, PINGPONG=0, STAGES=3),  # no producer: thread 0 issues
)


def ab_space(shapes: list[tuple[int, int, int, int]], timeout_s: float, repetitions: int | None,
             found: list[dict[str, Config]] = ()):
    """The h100 space with these shapes (full and causal) as its cases, and with the template-only
    parameters the pairs set as parameters of their own (the values they take), so that the
    evaluator takes the pairs."""
    cases = tuple(Case(b, h, s, d, causal) for b, h, s, d in shapes for causal in (False, True))
    timing = replace(SPACE.timing, timeout_s=timeout_s, flush_l2=True,
                     repetitions=repetitions or SPACE.timing.repetitions)
    extra: dict[str, list] = {}
    for pair in found:
        for config in pair.values():
            for name in TEMPLATE_ONLY:
                if name in config and name not in SPACE.param_names:
                    extra.setdefault(name, []).append(config[name])
    params = JUDGE.params + tuple(Param(name, tuple(dict.fromkeys(values))) for name, values in extra.items())
    return replace(SPACE, cases=cases, timing=timing, params=params)


def parse_param(text: str) -> tuple[str, tuple]:
    """``NAME=A,B`` -> (NAME, (A, B)) with values typed as ``--config`` types them."""
    name, _, values = text.partition("=")
    typed = tuple(Config.parse(f"{name}={v}")[name] for v in values.split(","))
    if not name or len(typed) != 2:
        raise SystemExit(f"--param: expected NAME=A,B, got {text!r}")
    return name, typed


# wgmma template parameters outside the space, and their template defaults (none today: those
# measured as losing left the template; docs/performance.md keeps their measurements)
TEMPLATE_ONLY: dict[str, int] = {}
# values of space parameters the template takes and the space does not (yet), measured here
TEMPLATE_VALUES = {"SOFTMAX_PIN": (1,)}
# the h100 space with those values: what judges a pair (its constraints hold for them too)
JUDGE = replace(SPACE, params=tuple(Param(p.name, p.values + tuple(v for v in TEMPLATE_VALUES.get(p.name, ())
                                                                   if v not in p.values)) for p in SPACE.params))


def _in_space(config: Config) -> Config:
    """The configuration the space judges: without the template-only parameters."""
    return Config({k: v for k, v in config.items() if k not in TEMPLATE_ONLY or k in SPACE.param_names})


def _refusal(config: Config) -> str:
    """Why the space or the template refuses ``config`` ('' when both take it)."""
    judged = _in_space(config)
    if not JUDGE.contains(judged):
        return f"not in the h100 space: {config.label()} ({'; '.join(JUDGE.violations(judged)) or 'unknown parameter'})"
    try:
        render("flash_attention", config, Variant(64, False))
    except RenderError as exc:
        return f"the template refuses {config.label()}: {exc}"
    return ""


def pairs(extra: list[str], param: tuple[str, tuple] = ("LOAD", ("cpasync", "tma"))) -> list[dict[str, Config]]:
    """(A, B) of the seed, its neighbours (LOAD only) and each ``--config``; SystemExit for one the
    space or the template refuses (the seed's own pair is left out where the parameter needs other
    values, e.g. O_TMA needs PERSISTENT, and ``--config`` pairs are given)."""
    name, values = param
    found = []
    base = [SEED, *NEIGHBOURS] if name == "LOAD" else [SEED]
    extras = [Config({**dict(SEED), **dict(Config.parse(text))}) for text in extra]
    for config in [*base, *extras]:
        pair = {str(v): config.replace(**{name: v}) for v in values}
        refused = [why for why in map(_refusal, pair.values()) if why]
        if refused and config is SEED and extras:
            continue
        if refused:
            raise SystemExit(refused[0])
        if pair not in found:
            found.append(pair)
    # a template-only parameter set in one pair is set in all, at its default where not given
    used = {name for pair in found for c in pair.values() for name in c if name in TEMPLATE_ONLY}
    return [{value: c.replace(**{name: c[name] if name in c else TEMPLATE_ONLY[name] for name in used})
             for value, c in pair.items()} for pair in found]


def compile_only(space, found: list[dict[str, Config]], console: Console) -> dict:
    a, b = found[0]
    table = Table(title="sm_90a builds (every variant): registers at launch, spills")
    for column in ("configuration", a, b):
        table.add_column(column)
    rows, ok = [], True
    for pair in found:
        cells = {}
        for value, config in pair.items():
            report = build_config(space.template, config, space.variants, "sm_90a", space.target.smem_per_block)
            ok &= report.status == "compiled"
            cells[value] = {"status": report.status, "registers": report.registers, "spill_bytes": report.spill_bytes,
                            "smem": report.smem, "error": report.error}
        rows.append({"config": pair[b].short_label(), **cells})
        table.add_row(pair[a].short_label(), *(
            f"{c['registers']} regs, {c['spill_bytes']} B spilled" if c["status"] == "compiled" else c["error"][:60]
            for c in (cells[a], cells[b])))
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
                for value, config in pair.items():
                    result = evaluator.evaluate(config)
                    entry = figures.setdefault((i, value), {"status": "ok", "reason": "", "cases": {}, "resources": {}})
                    entry["resources"] = result.resources
                    if result.status != "ok":
                        entry.update(status=result.status, reason=result.reason)
                        console.print(f"[red]round {r + 1} #{i + 1} {value}: {result.status}[/] {result.reason[:300]}")
                        continue
                    for case in result.cases:
                        if case.get("time"):
                            per = entry["cases"].setdefault(case["label"], {"us": [], "tflops": [], "max_abs_err": 0.0})
                            per["us"].append(case["time"]["median_us"])
                            per["tflops"].append(case["tflops"])
                            per["max_abs_err"] = max(per["max_abs_err"], case.get("max_abs_err") or 0.0)
                    console.print(f"round {r + 1} #{i + 1} {value}: ok, geomean {result.objective_us:.1f} µs")
    return {"gpu": info, "figures": figures}


def report(space, found: list[dict[str, Config]], figures: dict, console: Console, name: str = "LOAD") -> list[dict]:
    a, b = found[0]
    table = Table(title=f"{name}={a} against {name}={b}: TF/s (median of rounds), {b} / {a}, max |error| against fp32 SDPA")
    for column, justify in (("#", "right"), ("case", "left"), (f"{a} TF/s", "right"), (f"{b} TF/s", "right"),
                            (f"{b}/{a}", "right"), (f"err {a}", "right"), (f"err {b}", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    rows = []
    for i, pair in enumerate(found):
        fa, fb = figures.get((i, a), {}), figures.get((i, b), {})
        for case in space.cases:
            label = case.label()
            ca, cb = fa.get("cases", {}).get(label), fb.get("cases", {}).get(label)
            row = {"pair": i + 1, "config": pair[b].short_label(), "case": label, a: _summary(ca, fa), b: _summary(cb, fb)}
            if ca and cb:
                row["b_over_a"] = statistics.median(ca["us"]) / statistics.median(cb["us"])
            rows.append(row)
            table.add_row(str(i + 1), label, _cell(row[a]), _cell(row[b]),
                          f"{row['b_over_a']:.3f}" if "b_over_a" in row else "-", _err(row[a]), _err(row[b]))
    console.print(table)
    for i, pair in enumerate(found):
        console.print(f"#{i + 1} {pair[a].short_label()}  (--config {pair[b].label()})")
    ratios = [r["b_over_a"] for r in rows if "b_over_a" in r]
    if ratios:
        console.print(f"{b} / {a} over {len(ratios)} cases: geomean {statistics.geometric_mean(ratios):.3f}, "
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
    parser.add_argument("--param", default="LOAD=cpasync,tma", metavar="NAME=A,B",
                        help="the parameter and its two values (default LOAD=cpasync,tma)")
    parser.add_argument("--config", action="append", default=[], help="another pair: NAME=VALUE,... over the TMA seed (repeatable)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S,D",
                        help="time this shape, full and causal, instead of B4 H16 S2048 D64/D128 and B8 H16 S4096 D128")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two values this many times (default 1)")
    parser.add_argument("--repetitions", type=int, help="graph replays per timing (default: the h100 space's)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per gate or timing job before a hang is declared")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile every kernel for sm_90a and report")
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    args = parser.parse_args(argv)

    console = Console(highlight=False, width=160)
    shapes = [parse_shape(s) for s in args.shape] or list(SHAPES)
    param = parse_param(args.param)
    found = pairs(args.config, param)
    space = ab_space(shapes, args.timeout, args.repetitions, found)
    if args.compile_only:
        out = compile_only(space, found, console)
        ok = out["ok"]
    else:
        done = evaluate_all(space, found, args.rounds, args.device, console)
        rows = report(space, found, done["figures"], console, param[0])
        out = {"gpu": done["gpu"], "param": param[0], "values": list(param[1]), "rounds": args.rounds, "shapes": shapes, "rows": rows,
               "configs": [{value: c.to_dict() for value, c in pair.items()} for pair in found],
               "statuses": {f"#{i + 1} {value}": {k: v for k, v in e.items() if k != "cases"}
                            for (i, value), e in done["figures"].items()}}
        ok = all(e["status"] == "ok" for e in done["figures"].values())
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
