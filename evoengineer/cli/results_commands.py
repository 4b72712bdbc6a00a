"""Commands over a finished run: ``leaderboard``, ``export``, ``plot``, ``report``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from .common import EXIT_OK, WIDE_HELP, UsageError, run_path, whole


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from ..results import leaderboard_csv, leaderboard_grid, load_leaderboard, print_grid

    if args.per_shape:
        return _per_shape(args)
    if len(args.run) > 1:
        raise UsageError("leaderboard: one run at a time (several runs only with --per-shape)")
    _check_runs([run_path(args.run[0])])
    board = load_leaderboard(run_path(args.run[0]), args.top)
    if args.json:
        print(json.dumps(board))
    elif args.csv:
        print(leaderboard_csv(board), end="")
    else:
        print_grid(Console(highlight=False), leaderboard_grid(board), wide=args.wide)
    return EXIT_OK


def _per_shape(args: argparse.Namespace) -> int:
    from ..results import ExportError, config_legend, per_shape_table, per_shape_winners

    _check_runs([run_path(r) for r in args.run])
    try:
        per = per_shape_winners([run_path(r) for r in args.run])
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    if args.csv:
        raise UsageError("leaderboard --per-shape: --json or the table, not --csv")
    if args.json:
        print(json.dumps(per.to_json()))
        return EXIT_OK
    console = Console(highlight=False, width=80)
    if not per.winners:
        console.print("no per-case timings in these runs (replayed runs record none); export uses the fallback only")
    else:
        console.print(per_shape_table(per))
    console.print("×SDPA: the fastest SDPA backend's time / the winner's (> 1: faster)")
    for line in config_legend(per):
        console.print(line, soft_wrap=True)
    return EXIT_OK


def _check_runs(paths: list[Path]) -> None:
    """Each run's results.jsonl agrees with its study (else one line, exit 2); a run whose
    study cannot be consulted gets a note on stderr."""
    from ..search import RunDir, check_records

    for path in paths:
        note = check_records(RunDir.open(path))
        if note:
            print(note, file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    from ..results import ExportError, export_entry, export_runs, load_leaderboard
    from ..results.export_backward import backward_choice, backward_runs, measured_backward

    runs = [run_path(r) for r in args.run]
    _check_runs(runs)
    try:
        if args.no_backward and args.backward:
            raise UsageError("--backward and --no-backward: give one of them")
        runs, trained = backward_runs(runs)
        if trained and args.no_backward:
            raise UsageError(f"--no-backward: {trained[0]} is a backward run; drop one of them")
        if not runs:
            raise UsageError(f"{trained[0]} is a backward run: export it beside a forward run "
                             f"(evoengineer export FORWARD_RUN {trained[0]} --out DIR)")
        measured, exact = measured_backward(trained) if trained else ([], {})
        backward = backward_choice(args.backward or [], enabled=not args.no_backward, measured=measured, exact=exact)
        if args.rank is not None:
            if len(runs) > 1:
                raise UsageError("--rank N exports one configuration of one forward run (beside backward runs); "
                                 "give one, or drop --rank")
            board = load_leaderboard(runs[0])
            entry = next((e for e in board["entries"] if e["rank"] == args.rank), None)
            if entry is None:
                raise UsageError(f"--rank {args.rank}: {runs[0]} has {len(board['entries'])} ranked entries")
            written = export_entry(runs[0], entry, board, Path(args.out), module_name=args.module, backward=backward)
        else:
            written = export_runs(runs, Path(args.out), module_name=args.module, backward=backward)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    console = Console(highlight=False)
    for path in written:
        console.print(f"wrote {path}")
    console.print(f"use: import sys; sys.path.insert(0, '{args.out}'); from {written[0].stem} import attention", soft_wrap=True)
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401

        from ..results.plot import plot_run
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'evoengineer[plot]'") from None
    run = run_path(args.run)
    out = plot_run(run, Path(args.out) if args.out else run / "progress.png")
    Console(highlight=False).print(f"wrote {out}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("the report draws its figures with matplotlib: pip install 'evoengineer[plot]'") from None
    from ..results import write_report

    run = run_path(args.run)
    out = write_report(run, Path(args.out) if args.out else None)
    Console(highlight=False, soft_wrap=True).print(f"wrote {out}")  # a path stays on one line
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leaderboard", help="the ranked finalists of a run, with SDPA rows")
    p.add_argument("run", nargs="+", help="a run directory (runs/<run>); several with --per-shape")
    p.add_argument("--top", type=whole(1), metavar="N", help="show the first N")
    p.add_argument("--per-shape", action="store_true",
                   help="the fastest configuration of every measured case (across the runs given), with SDPA's")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the leaderboard as one JSON object (full configurations)")
    fmt.add_argument("--csv", action="store_true", help="print CSV: one row per entry and per SDPA backend (full configurations)")
    fmt.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_leaderboard)

    p = sub.add_parser("plot", help="plot a run: each evaluation, the best so far, SDPA lines (PNG)")
    p.add_argument("run", help="a run directory (runs/<run>)")
    p.add_argument("--out", help="PNG path (default runs/<run>/progress.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="one self-contained HTML page about a run (figures embedded)",
                       description="Write one HTML file with the run's best so far over evaluations and over time, every "
                       "evaluation by path and status, parameter importances from its Optuna study, the re-timed "
                       "leaderboard against each SDPA backend, the fastest configuration per shape and the environment. "
                       "Figures are embedded PNGs; the file needs nothing else. Needs matplotlib (evoengineer[plot]).")
    p.add_argument("run", help="a run directory (runs/<run>)")
    p.add_argument("--out", help="HTML path (default runs/<run>/report.html)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="write a drop-in attention module: sources, launch metadata, dispatch table")
    p.add_argument("run", nargs="+", help="run directories (runs/<run>): per case the fastest configuration of them all; "
                                          "a backward run (--space h100-backward) gives the backward's per case")
    p.add_argument("--rank", type=whole(1), help="export only this leaderboard rank of one run (a single configuration)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--module", default="evo_attention",
                   help="name of the exported package (a Python identifier; default evo_attention)")
    p.add_argument("--backward", action="append", metavar="[D<head_dim>:]CONFIG",
                   help="the backward configuration to export for training (repeatable): a name of "
                        "backward_rules.BACKWARD_CONFIGS (m64n128) or parameters (BLOCK_M=32,BLOCK_N=64,DQ_MODE=separate), "
                        "for one head dim with a D<head_dim>: prefix; default: each head dim's default configuration")
    p.add_argument("--no-backward", action="store_true", help="export the inference kernels only (no training)")
    p.set_defaults(func=cmd_export)
