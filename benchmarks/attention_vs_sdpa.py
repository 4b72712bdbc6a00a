"""The best configuration of each path (scalar, wmma, mma) for every shape, against every SDPA backend.

Every figure comes from one run on one GPU: each candidate configuration is gated and
timed by the same harness (CUDA-graph replay, device time, cold L2) that times SDPA's
backends, on every shape; then, for each shape and path, the fastest candidate of that
path in this run is reported with its ratios.

    python benchmarks/attention_vs_sdpa.py --space h100                      # hand-picked configs
    python benchmarks/attention_vs_sdpa.py --space h100 --leaderboard runs/<run> [--leaderboard runs/<run2>]
    python benchmarks/attention_vs_sdpa.py --space h100 --config PATH=wmma,BLOCK_M=64,...
    python benchmarks/attention_vs_sdpa.py --space h100 --shape 8,16,4096,128 --only-shapes --config ...

With --leaderboard, the candidates are, for each shape a run searched and each path, the
--top (default 2) configurations with the shortest recorded times on that shape (searches
restricted with ``search --shape`` contribute their own shapes). Ratios are time / SDPA backend's time
(below 1: faster than SDPA); TF/s counts the matmul FLOPs (halved for causal).

Beside SDPA's four backends forced one at a time, the same harness times SDPA as a user
calls it (``default``: torch's own backend choice; cuDNN on Hopper) and, when it is
installed, flash-attn-4 (``fa4``). ``/bar`` is the ratio to the faster of cuDNN and fa4.

Then, with --rounds N (default 3), each shape's --retime-top (default 2) fastest candidates of
each of the --retime-paths (default mma and wgmma) are timed again, N rounds interleaved with
SDPA's backends and the peers (the order reversed every other round), so that a drift of the
GPU's clock over the run reaches every side alike. That second table gives per shape and path
the candidate with the lowest median of the rounds, its median, and ÷cuDNN and ÷bar as the
medians of the rounds' paired ratios: the figures to quote.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from evoengineer.bench import interleaved_times, paired_ratio
from evoengineer.bench.versus import HAND_PICKED, candidate_name, case_time, configs_from_leaderboards, fastest, rounds_winner
from evoengineer.gpu import REFERENCE_CALLS, SDPA_BACKENDS, Evaluator, fastest_sdpa
from evoengineer.kernels import StaticReport, arch_for_device
from evoengineer.space import Case, Config, load_space, parse_shape

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", default="h100")
    parser.add_argument("--leaderboard", type=Path, action="append", default=[],
                        help="a run directory (repeatable): its best configurations per path for each shape it searched")
    parser.add_argument("--top", type=int, default=2,
                        help="with --leaderboard: the best N configurations per path and shape of each run (default 2)")
    parser.add_argument("--config", action="append", default=[], help="a configuration NAME=VALUE,... (repeatable)")
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    parser.add_argument("--trials", type=int, default=2, help="gate draws per shape")
    parser.add_argument("--peers", default=",".join(REFERENCE_CALLS),
                        help="reference calls timed beside SDPA's backends (default: default,fa4; '' for none)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S,D",
                        help="also measure this shape, full and causal (repeatable), e.g. 8,16,4096,128; "
                             "B,H,S/S_KV,D for a K/V length other than S, e.g. 8,32,1/4096,128 (decode)")
    parser.add_argument("--only-shapes", action="store_true",
                        help="measure the --shape shapes only, not the space's own")
    parser.add_argument("--rounds", type=int, default=3,
                        help="re-time each shape's winners interleaved with the references this many rounds (0: no)")
    parser.add_argument("--retime-paths", default="mma,wgmma", help="the paths whose winners are re-timed (default mma,wgmma)")
    parser.add_argument("--retime-top", type=int, default=2,
                        help="re-time the N fastest candidates of each path per shape of the first pass; the rounds "
                             "pick the one reported (default 2)")
    args = parser.parse_args(argv)

    space = load_space(args.space)
    extra = []
    for text in args.shape:
        b, h, seq, d, seq_kv = parse_shape(text)
        extra += [Case(b, h, seq, d, causal, dtype=dtype, seq_kv=seq_kv) for dtype in space.dtypes for causal in (False, True)]
    if args.only_shapes and not extra:
        print("error: --only-shapes: give at least one --shape", file=sys.stderr)
        return 2
    if extra:
        kept = () if args.only_shapes else space.cases
        space = dataclasses.replace(space, cases=tuple(dict.fromkeys(kept + tuple(extra))))
    configs = [Config.parse(c) for c in args.config]
    configs += configs_from_leaderboards(args.leaderboard, args.top)
    if not configs:
        paths = space.param("PATH").values
        configs = [c for c in map(Config.parse, HAND_PICKED) if c["PATH"] in paths]
    configs = [space.complete(c, key='--config') for c in configs]

    console = Console(highlight=False, width=200)
    # A configuration valid only for one head dim (e.g. from a search restricted with --shape) is
    # measured on that head dim's shapes.
    dims = sorted({c.head_dim for c in space.cases})
    spaces = [space] + [space.with_shapes(list(dict.fromkeys(c.shape for c in space.cases
                                                             if c.head_dim == d))) for d in dims]
    results = []
    with ExitStack() as stack:
        evaluators: dict[int, Evaluator] = {}

        def evaluator_for(i: int) -> Evaluator:
            if i not in evaluators:
                ev = stack.enter_context(Evaluator(spaces[i], gate_trials=args.trials))
                ev.arch = arch_for_device(ev.info()["arch"], space.target.arch)
                evaluators[i] = ev
            return evaluators[i]

        main_ev = evaluator_for(0)
        info = main_ev.info()
        peers = tuple(p for p in args.peers.split(",") if p)
        baseline = main_ev.baseline(SDPA_BACKENDS + peers)
        for config in configs:
            console.print(f"evaluating {config.label()}", style="dim")
            where = next((i for i, sp in enumerate(spaces) if sp.contains(config)), 0)
            results.append(evaluator_for(where).evaluate(config))
    best = fastest_sdpa({label: {b: r for b, r in rows.items() if b in SDPA_BACKENDS} for label, rows in baseline.items()})
    measured = [b for b in SDPA_BACKENDS + peers if any(rows.get(b, {}).get("status") == "ok" for rows in baseline.values())]
    paths = [p for p in space.param("PATH").values if any(r.config["PATH"] == p and r.ok for r in results)]
    names = {r.key: f"#{i + 1}" for i, r in enumerate(results)}

    table = Table(title=f"{space.name} on {info['gpu']}: device time µs; ratio = time / SDPA time (< 1 is faster); "
                        f"per shape, the fastest candidate of each path ({len(results)} candidates, one run)")
    table.add_column("shape")
    for b in measured:
        table.add_column(f"SDPA {b}" if b in SDPA_BACKENDS else b, justify="right")
    for p in paths:
        table.add_column(f"best {p}\nµs | TF/s", justify="right")
        table.add_column(f"{p}\n/fastest /flash /cudnn /default /bar", justify="right")
        table.add_column(f"{p}\nconfig", justify="left")
    rows = []
    for case in space.cases:
        label = case.label()
        sd = baseline.get(label, {})
        cells = [f"{sd[b]['time']['median_us']:.1f}" if sd.get(b, {}).get("status") == "ok" else "-" for b in measured]
        row = {"shape": label, "sdpa": {b: sd[b]["time"]["median_us"] for b in measured if sd.get(b, {}).get("status") == "ok"}}
        bar = min((row["sdpa"][b] for b in ("cudnn", "fa4") if b in row["sdpa"]), default=float("nan"))
        for p in paths:
            timed = [(case_time(r, label), r) for r in results if r.config["PATH"] == p and r.ok]
            timed = [(c, r) for c, r in timed if c is not None]
            if not timed:
                cells += ["-", "-", "-"]
                continue
            c, r = min(timed, key=lambda x: x[0]["time"]["median_us"])
            us = c["time"]["median_us"]
            ratios = [us / best[label][1] if label in best else float("nan")]
            ratios += [us / row["sdpa"][b] if b in row["sdpa"] else float("nan") for b in ("flash", "cudnn", "default")]
            ratios.append(us / bar)
            cells += [f"{us:.1f} | {c['tflops']:.0f}", " ".join(f"{x:.2f}" for x in ratios), names[r.key]]
            row[p] = {"config": r.config, "us": us, "tflops": c["tflops"], "ratio_fastest": ratios[0],
                      "ratio_flash": ratios[1], "ratio_cudnn": ratios[2], "ratio_default": ratios[3],
                      "ratio_bar": ratios[4], "max_abs_err": c.get("max_abs_err")}
        table.add_row(label, *cells)
        rows.append(row)
    console.print(table)
    retimed: dict[str, Any] = {}
    if args.rounds > 0:
        wanted = [p for p in args.retime_paths.split(",") if p in paths]
        winners: dict[str, dict[str, tuple[Evaluator, StaticReport]]] = {}
        reports: dict[str, tuple[Evaluator, StaticReport]] = {}
        with ExitStack() as stack:
            evaluators.clear()
            main_ev = evaluator_for(0)
            for row in rows:
                for p in wanted:
                    for i, config in enumerate(fastest(results, row["shape"], p, args.retime_top)):
                        if config.key() not in reports:
                            ev = evaluator_for(next((j for j, sp in enumerate(spaces) if sp.contains(config)), 0))
                            reports[config.key()] = (ev, ev.build(config))
                        winners.setdefault(row["shape"], {})[candidate_name(p, i)] = reports[config.key()]
            references = tuple(b for b in SDPA_BACKENDS if b in ("cudnn", "flash")) + peers
            console.print(f"re-timing {len(reports)} winners, {args.rounds} rounds interleaved with "
                          f"{', '.join(references)}", style="dim")
            samples, _ = interleaved_times(main_ev, list(space.cases), winners, references, args.rounds,
                                           {**main_ev.timing, "precision": 0.0})
        table = Table(title=f"re-timed: {args.rounds} rounds interleaved; µs the median of the rounds; ÷ the median of "
                            f"the rounds' paired ratios (< 1 is faster); bar = min(cuDNN, fa4) per round")
        table.add_column("shape")
        refs = [b for b in ("cudnn", "default", "fa4", "flash") if any(b in got for got in samples.values())]
        for b in refs:
            table.add_column(b, justify="right")
        for p in wanted:
            table.add_column(f"{p} µs | TF/s", justify="right")
            table.add_column(f"{p} ÷cudnn ÷bar", justify="right")
        for case in space.cases:
            label = case.label()
            got = samples.get(label, {})
            us = {who: [x["us"] for x in xs] for who, xs in got.items()}
            n = min((len(v) for v in us.values()), default=0)
            bars = [min(us[b][i] for b in ("cudnn", "fa4") if b in us) for i in range(n)] if "cudnn" in us or "fa4" in us else []
            entry: dict[str, Any] = {who: {"us": statistics.median(v), "rounds": v} for who, v in us.items()}
            cells = [f"{statistics.median(us[b]):.1f}" if b in us else "-" for b in refs]
            for p in wanted:
                name = rounds_winner(us, p)
                if name is None:
                    cells += ["-", "-"]
                    continue
                # the path's entry: the candidate the rounds picked (each candidate's rounds stay under its name)
                entry[p] = {**entry[name], "candidate": name}
                us[p], got[p] = us[name], got[name]
                tf = statistics.median(x["tflops"] for x in got[p])
                entry[p].update(tflops=tf, config=winners[label][name][1].config.to_dict(),
                                candidates=[winners[label][c][1].config.short_label() for c in winners[label]
                                            if c.split("#")[0] == p],
                                ratio_cudnn=paired_ratio(us[p][:n], us["cudnn"][:n]) if "cudnn" in us else None,
                                ratio_bar=paired_ratio(us[p][:n], bars) if bars else None)
                cells += [f"{statistics.median(us[p]):.1f} | {tf:.0f}",
                          " ".join("-" if x is None else f"{x:.2f}" for x in (entry[p]["ratio_cudnn"], entry[p]["ratio_bar"]))]
            table.add_row(label, *cells)
            retimed[label] = entry
        console.print(table)
        for label, per in winners.items():
            for name, (_, report) in per.items():
                picked = (retimed.get(label, {}).get(name.split("#")[0]) or {}).get("candidate") == name
                console.print(f"  {label} {name}: {report.config.short_label()}{'  (reported)' if picked else ''}",
                              style="dim")
    for b in SDPA_BACKENDS + peers:
        reasons = {rows.get(b, {}).get("reason") for rows in baseline.values() if rows.get(b, {}).get("status") != "ok"}
        if reasons - {None}:
            console.print(f"{b}: not measured on some shapes: {'; '.join(sorted(x for x in reasons if x))[:300]}", style="dim")
    for r in results:
        status = f"{r.status} {r.reason}".strip()
        err = max((c.get("max_abs_err") or 0) for c in r.cases) if r.cases else "-"
        console.print(f"{names[r.key]} {Config(r.config).short_label()}: {Config(r.config).label()}  {status}  "
                      f"registers {r.resources.get('registers')}, smem {r.resources.get('smem')}, "
                      f"spills {r.resources.get('spill_bytes')}  gate max abs err {err}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": info, "space": space.name, "baseline": baseline, "rows": rows, "retimed": retimed,
                                         "results": [r.to_json() for r in results]}, indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
