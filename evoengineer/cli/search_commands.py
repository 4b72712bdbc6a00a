"""Commands that run or list searches: ``search`` and ``runs``."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..gpu import EvalResult, fastest_sdpa
from ..kernels import arch_for_device
from ..search import (
    DEFAULT_HEARTBEAT_S,
    GRACE_BEATS,
    ReplayCandidates,
    RunDir,
    SearchStats,
    best_results,
    geomean,
    open_study,
    recover_interrupted,
    run_search,
)
from ..space import STRATEGIES, Config, Space, parse_duration
from .common import EXIT_FAILED, EXIT_OK, WIDE_HELP, UsageError, load_space, require_gpu, restrict_shapes

DEFAULT_RUNS = Path("runs")


def _latest_run(root: Path, space: Space) -> Path:
    runs = sorted(p for p in root.glob(f"*-{space.name}-*") if (p / "run.json").exists())
    if not runs:
        raise UsageError(f"--resume: no run of space {space.name!r} under {root}/; give --run-dir")
    return runs[-1]


def _parse_devices(args: argparse.Namespace) -> list[int]:
    """``--devices 0,1,3`` or ``all`` (every visible GPU); ``--device N`` alone means [N]."""
    if args.devices is None:
        return [args.device if args.device is not None else 0]
    if args.device is not None:
        raise UsageError("--device and --devices: give one of them")
    text = args.devices.strip()
    if text == "all":
        if args.replay:
            raise UsageError("--devices all: a replay has no GPUs to count; give the simulated devices, e.g. --devices 0,1")
        require_gpu()
        import torch

        return list(range(torch.cuda.device_count()))
    try:
        devices = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise UsageError(f"--devices: expected device indices such as 0,1 or 'all', got {text!r}") from None
    if not devices or len(set(devices)) != len(devices) or min(devices) < 0:
        raise UsageError(f"--devices: expected distinct device indices such as 0,1 or 'all', got {text!r}")
    return devices


def cmd_search(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    devices = _parse_devices(args)
    if args.replay and not Path(args.replay).is_file():
        raise UsageError(f"--replay: {args.replay}: no such file (a results.jsonl or a recording from benchmarks/record.py)")
    if space.recorded:  # known only by its recording: search it by replay
        if not args.replay:
            raise UsageError(f"--space: {args.space} is a recorded problem (problem.kind: recorded); search it with --replay RECORDING")
        space = ReplayCandidates(Path(args.replay)).replay.narrow(space)
    if args.heartbeat is not None and args.heartbeat < 1:
        raise UsageError(f"--heartbeat: expected a whole number of seconds >= 1, got {args.heartbeat}")
    console = Console(highlight=False, stderr=args.json)  # with --json, stdout holds only the JSON
    try:
        time_s = parse_duration(args.time) if args.time else space.search.time_s
    except ValueError as exc:
        raise UsageError(f"--time: {exc}") from None
    trials = args.trials or space.search.budget
    top_k = args.top_k or space.search.top_k

    # -- where results go ---------------------------------------------------------
    if args.resume:
        path = Path(args.run_dir) if args.run_dir else _latest_run(DEFAULT_RUNS, space)
        if not (path / "run.json").exists():
            raise UsageError(f"--resume: {path} is not a run directory (no run.json)")
        run = RunDir(path)
        meta = run.meta()
        strategy, seed, storage = meta["strategy"], meta["seed"], meta["storage"]
        if args.shape and sorted(args.shape) != sorted(meta.get("shapes") or []):
            raise UsageError(f"--resume: the run in {path} searched shapes {meta.get('shapes') or 'all'}; resume it without --shape")
        if args.add_shape and sorted(args.add_shape) != sorted(meta.get("added_shapes") or []):
            raise UsageError(f"--resume: the run in {path} added shapes {meta.get('added_shapes') or 'none'}; "
                             "resume it without --add-shape")
        space = restrict_shapes(space, meta.get("shapes"), meta.get("added_shapes"))
    else:
        space = restrict_shapes(space, args.shape, args.add_shape)
        strategy, seed = args.strategy or space.search.strategy, args.seed
        if args.run_dir:
            path = Path(args.run_dir)
            if (path / "run.json").exists():
                raise UsageError(f"--run-dir: {path} already holds a run; add --resume to continue it")
            path.mkdir(parents=True, exist_ok=True)
            (path / "sources").mkdir(exist_ok=True)
            (path / "space.yaml").write_text(space.path.read_text())
            run = RunDir(path)
        else:
            run = RunDir.create(DEFAULT_RUNS, space)
        storage = args.storage or run.default_storage()
        meta = {"space": space.name, "space_path": str(space.path), "strategy": strategy, "seed": seed, "storage": storage,
                "study_name": args.study or run.path.name, "trials": trials, "time_s": time_s, "top_k": top_k,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "replay": str(args.replay) if args.replay else None,
                "shapes": args.shape or None, "added_shapes": args.add_shape or None}

    # -- the evaluators: one per device ---------------------------------------------------
    evaluators: list[Any]
    if args.replay:
        evaluators = ReplayCandidates(Path(args.replay), args.replay_delay).on_devices(devices)
        info, arch, baseline = {"gpu": f"replay of {args.replay}"}, space.target.arch, {}
    else:
        from ..gpu import Evaluator

        require_gpu()
        import torch

        missing = [d for d in devices if d >= torch.cuda.device_count()]
        if missing:
            raise UsageError(f"--devices: no GPU {missing[0]} on this machine ({torch.cuda.device_count()} visible)")
        best_case_us: dict[str, float] = {}  # one racing table for every lane
        evaluators = [Evaluator(space, device=d, seed=seed or 0, best_case_us=best_case_us) for d in devices]
        for ev in evaluators:
            ev.worker.start()  # the workers start together
        with console.status(f"starting {len(evaluators)} GPU worker(s)"):
            infos = [ev.info() for ev in evaluators]
        for d, one in zip(devices, infos):
            if one.get("status") != "ok":
                raise UsageError(f"the GPU worker on device {d} failed to start: {one.get('reason', '')}")
        archs = sorted({one["arch"] for one in infos})
        if len(archs) > 1:
            raise UsageError(f"--devices: the GPUs differ ({', '.join(archs)}); run one search per kind of GPU on one study")
        info, arch = infos[0], arch_for_device(archs[0], space.target.arch)
        if len(devices) > 1:
            info = {**info, "devices": devices, "gpus": [one["gpu"] for one in infos]}
        if arch != space.target.arch:
            console.print(f"[yellow]note:[/] space {space.name} targets {space.target.name} ({space.target.arch}); "
                          f"this GPU is {info['gpu']} ({archs[0]}): compiling for {arch}, without the paths "
                          f"only {space.target.arch} has")
            space = space.for_arch(arch)
        for ev in evaluators:
            ev.arch, ev.space = arch, space
        if args.resume and (run.path / "baseline.json").exists():
            baseline = json.loads((run.path / "baseline.json").read_text())
        else:
            with console.status("timing SDPA's backends on every shape"):
                baseline = evaluators[0].baseline()
            run.write_json("baseline.json", baseline)
    meta.update(gpu=info, arch=arch, devices=devices, case_flops={c.label(): c.flops() for c in space.cases})
    run.write_meta(meta)
    run.write_json("env.json", info)

    heartbeat = args.heartbeat or meta.get("heartbeat_s") or DEFAULT_HEARTBEAT_S
    meta["heartbeat_s"] = heartbeat
    study = open_study(space, run, strategy=strategy, seed=seed, storage=storage, study_name=meta["study_name"],
                       resume=bool(args.resume or args.study), heartbeat_s=heartbeat)
    if args.resume:
        recovered = recover_interrupted(study, run, space)
        if recovered:
            console.print(f"resumed: {recovered} interrupted evaluation(s) recovered")
    best_sdpa = fastest_sdpa(baseline)
    sdpa_geomean = geomean([best_sdpa[c.label()][1] for c in space.cases]) if len(best_sdpa) == len(space.cases) else None

    on = f"{len(devices)} × {info.get('gpu')} (devices {','.join(map(str, devices))})" if len(devices) > 1 else info.get("gpu")
    console.print(f"run [bold]{run.path}[/]  strategy {strategy}  budget {trials} evaluations"
                  + (f" or {time_s / 60:.1f} min" if time_s else "") + f"  on {on}")
    console.print(f"study: {storage}  (optuna-dashboard {storage})")

    done_before = sum(1 for r in run.results())
    with Progress(TextColumn("[bold]search[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[best]}"), TextColumn("{task.fields[counts]}"), console=console,
                  disable=args.quiet or args.json) as progress:
        task = progress.add_task("search", total=trials, completed=min(done_before, trials), best="", counts="")

        def on_result(result: EvalResult, stats: SearchStats) -> None:
            best = ""
            if stats.best:
                best = f"best {stats.best.objective_us:.2f} µs"
                if sdpa_geomean:
                    best += f" ({sdpa_geomean / stats.best.objective_us:.2f}× fastest SDPA)"
            counts = " ".join(f"{k} {v}" for k, v in stats.counts.items() if v)
            progress.update(task, advance=1, best=best, counts=counts)

        stats = run_search(space, evaluators, run, study, arch=arch, trials=trials, time_s=time_s, on_result=on_result,
                           build=not args.replay)

    summary = stats.summary()
    finalists = best_results(run, top_k)
    board = _finalize(run, space, evaluators[0], finalists, baseline, info, console,
                      retime_rounds=0 if args.replay else args.retime_rounds)
    for ev in evaluators:
        if hasattr(ev, "close"):
            ev.close()
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), summary=summary)
    run.write_meta(meta)

    if args.json:
        print(json.dumps({"run": str(run.path), "storage": storage, "study": meta["study_name"], "summary": summary,
                          "leaderboard": board["entries"]}))
        return EXIT_OK if board["entries"] else EXIT_FAILED
    from ..results import leaderboard_grid, print_grid, profile_grid, search_summary_grid

    print_grid(console, search_summary_grid(summary), wide=args.wide)
    if args.profile:
        print_grid(console, profile_grid(summary), wide=args.wide)
    if board["entries"]:
        print_grid(console, leaderboard_grid(board), wide=args.wide)
    console.print(f"run directory: {run.path}\nleaderboard: evoengineer leaderboard {run.path}\n"
                  f"export: evoengineer export {run.path} --rank 1 --out best/\ndashboard: optuna-dashboard {storage}")
    return EXIT_OK if board["entries"] else EXIT_FAILED


def _finalize(run: RunDir, space: Space, evaluator: Any, finalists: list[dict], baseline: dict, info: dict,
              console: Console, retime_rounds: int) -> dict:
    from ..results import LEADERBOARD, build_leaderboard

    retimed = None
    if finalists and retime_rounds:
        from ..gpu import retime

        with console.status(f"re-timing the top {len(finalists)} interleaved with SDPA ({retime_rounds} rounds)"):
            reports = [evaluator.build(Config(r["config"])) for r in finalists]
            retimed = retime(evaluator, reports, rounds=retime_rounds)
        run.write_json("retimed.json", retimed)
    flops = {c.label(): c.flops() for c in space.cases}
    board = build_leaderboard(finalists, retimed, baseline, flops, info.get("gpu", "?"))
    board.update(space=space.name, run=str(run.path))
    run.write_json(LEADERBOARD, board)
    return board


def cmd_runs(args: argparse.Namespace) -> int:
    root = Path(args.root)
    rows = []
    for path in sorted(root.glob("*/run.json")):
        meta = json.loads(path.read_text())
        run = RunDir(path.parent)
        results = run.results()
        ok = [r for r in results if r["status"] == "ok"]
        best = min((r["objective_us"] for r in ok), default=None)
        rows.append({"run": str(path.parent), "space": meta.get("space"), "strategy": meta.get("strategy"),
                     "gpu": (meta.get("gpu") or {}).get("gpu"), "evaluations": len(results), "ok": len(ok),
                     "best_us": best, "finished": bool(meta.get("finished")), "started": meta.get("started")})
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    if not rows:
        Console().print(f"no runs under {root}/ (evoengineer search --space SPACE starts one)")
        return EXIT_OK
    from ..results import print_grid, runs_grid

    print_grid(Console(highlight=False), runs_grid(str(root), rows), wide=args.wide)
    return EXIT_OK


def _run_path(text: str) -> Path:
    path = Path(text)
    if not (path / "run.json").exists():
        raise UsageError(f"{path}: not a run directory (no run.json); `evoengineer runs` lists them")
    return path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search a space for the fastest correct kernel (GPU)",
                       description="Propose valid configurations with a strategy, compile ahead in parallel, gate and "
                       "time each on the GPU, record everything in a run directory and an Optuna study, then re-time "
                       "the top-K interleaved with SDPA and write the leaderboard. Ctrl-C or a kill leaves a run that "
                       "--resume continues.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name (l4, h100, h100-bf16, h100-decode; `evoengineer spaces` lists them)")
    p.add_argument("--strategy", choices=STRATEGIES, help="evo, tpe, random or grid (default: the space's)")
    p.add_argument("--trials", type=int, help="evaluation budget (default: the space's search.budget)")
    p.add_argument("--time", help="time budget such as 90s, 15m, 1h (default: the space's search.time)")
    p.add_argument("--top-k", type=int, dest="top_k", help="finalists to re-time for the leaderboard (default: the space's)")
    p.add_argument("--seed", type=int, default=0, help="strategy and input seed (default 0)")
    p.add_argument("--shape", action="append", metavar="B,H,S,D",
                   help="search only this shape of the space, full and causal (repeatable; default: every shape); "
                        "B,H,S/S_KV,D names a shape whose K/V length differs, e.g. 8,32,1/4096,128 (decode). "
                        "One search per regime finds each its own winner, e.g. --shape 1,8,512,64 for the small, "
                        "latency-bound shape")
    p.add_argument("--add-shape", action="append", metavar="B,H,S,D", dest="add_shape",
                   help="also search this shape, which the space does not list, full and causal, in the space's "
                        "dtypes (repeatable; alone, the search covers only the added shapes), e.g. --add-shape "
                        "8,16,4096,128 for a per-shape search of a long sequence; its head dim must be the space's")
    p.add_argument("--run-dir", help="the run's directory (default runs/<date>-<space>-<id>/)")
    p.add_argument("--storage", help="Optuna storage URL for the study (default: SQLite inside the run directory)")
    p.add_argument("--study", help="study name to create or join in --storage: several searches (one per GPU or host, "
                   "each with its own run directory) given the same --storage and --study share one search")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir (default: the latest run of the space)")
    p.add_argument("--device", type=int, help="CUDA device index (default 0)")
    p.add_argument("--devices", help="evaluate on several GPUs of this host at once: indices such as 0,1,2,3 or 'all' "
                   "(one worker per GPU, one search, one study; with --replay, simulated devices)")
    p.add_argument("--heartbeat", type=int, metavar="S",
                   help=f"seconds between the heartbeats of running trials in the study (default {DEFAULT_HEARTBEAT_S}); "
                        f"a trial silent for {GRACE_BEATS} heartbeats belongs to a dead search and is re-queued")
    p.add_argument("--retime-rounds", type=int, default=3, help="interleaved re-timing rounds for the finalists (default 3)")
    p.add_argument("--replay", help="answer from a recorded results file instead of a GPU (no compile, no GPU)")
    p.add_argument("--replay-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.add_argument("--profile", action="store_true",
                   help="print where the time went: per phase (strategy, compile, load, gate, timing, ipc, storage) "
                        "the total, the mean per evaluation and the share of the wall time")
    p.add_argument("--json", action="store_true", help="print the run's summary (as in run.json) and leaderboard as JSON")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("runs", help="list search runs")
    p.add_argument("--root", default=str(DEFAULT_RUNS), help="where runs live (default runs/)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_runs)


