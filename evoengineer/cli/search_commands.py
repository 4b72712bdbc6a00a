"""Commands that run or list searches: ``search`` and ``runs``."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..gpu import EvalResult, fastest_sdpa
from ..kernels import arch_for_device
from ..search import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_STORAGE,
    GRACE_BEATS,
    RUN_META,
    ReplayCandidates,
    ReplayEvaluator,
    RunDir,
    RunFileError,
    SearchPart,
    SearchStats,
    best_results,
    geomean,
    link_run,
    open_study,
    recover_interrupted,
    run_parts,
    study_problem,
)
from ..search.loop import AheadBuilds, build_ahead, compile_pool, writing
from ..search.strategies import SAMPLERS, sampler_recipe
from ..search.strategies.remote import close_started, start_ahead, wanted as batch_process_wanted
from ..search.study import prepare_storage
from ..search.partition import DEFAULT_PARTITION, PARTITION_BY, Partition, narrow_evaluator, plan
from ..search.optuna_internals import unsupported_reason
from ..space import STRATEGIES, Space
from .common import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, WIDE_HELP, UsageError, duration, load_space, number, require_gpu,
                     restrict_shapes, whole)

DEFAULT_RUNS = Path("runs")


def _latest_run(root: Path, space: Space) -> Path:
    runs = sorted(p for p in root.glob(f"*-{space.name}-*") if (p / "run.json").exists())
    if not runs:
        raise UsageError(f"--resume: no run of space {space.name!r} under {root}/; give --run-dir")
    return runs[-1]


def _check_recorded(run: RunDir, meta: dict) -> None:
    """The settings a resume takes from run.json are there and of the right type."""
    where = run.path / RUN_META
    for key, kinds, what in (("strategy", (str,), "a strategy name"), ("storage", (str,), "a storage URL"),
                             ("trials", (int,), "an evaluation budget")):
        value = meta.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool) or (key == "trials" and value < 1):
            raise RunFileError(f"{where}: {key!r} is {'missing' if value is None else repr(value)[:40]}, expected {what}")
    if meta["strategy"] not in STRATEGIES:
        raise RunFileError(f"{where}: 'strategy' is {meta['strategy'][:40]!r}, expected one of {', '.join(STRATEGIES)}")
    for key in ("time_s", "top_k", "seed"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RunFileError(f"{where}: {key!r} is {repr(value)[:40]}, expected a number")


def _recorded_storage(url: str) -> str:
    """``--storage`` as run.json records it: a relative SQLite path made absolute (relative
    SQLite paths in run.json mean the run directory)."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and ":memory:" not in url and not url[len(prefix):].startswith("file:"):
        return prefix + str(Path(url[len(prefix):]).resolve())
    return url


def _apply_resume_flags(args: argparse.Namespace, meta: dict, time_flag: float | None, run: RunDir, console: Console) -> None:
    """A resumed run continues with its recorded settings; a flag given with --resume that
    differs replaces its setting (recorded for later resumes), one line each."""
    def apply(flag: str, key: str, value: Any, shown: Any = None) -> None:
        if value is None or value == meta.get(key):
            return
        console.print(f"resume: {flag} {shown if shown is not None else value} replaces the run's "
                      f"{meta.get(key) if meta.get(key) is not None else 'none'}", soft_wrap=True)
        meta[key] = value

    apply("--trials", "trials", args.trials)
    apply("--time", "time_s", time_flag, args.time)
    apply("--top-k", "top_k", args.top_k)
    apply("--strategy", "strategy", args.strategy)
    apply("--seed", "seed", args.seed)
    apply("--study", "study_name", args.study)
    if args.storage and run.storage_url(_recorded_storage(args.storage)) != run.storage_url(meta["storage"]):
        apply("--storage", "storage", _recorded_storage(args.storage), args.storage)


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


def _replay_path(text: str) -> Path:
    """``--replay``: a recording's path, or the name of one shipped with the package (``demo``)."""
    from ..resources import builtin_recordings

    path = Path(text)
    if path.is_file():
        return path
    shipped = builtin_recordings()
    if text in shipped:
        return shipped[text]
    raise UsageError(f"--replay: {text}: no such file (a results.jsonl, a recording from benchmarks/record.py, "
                     f"or a shipped recording: {', '.join(shipped) or 'none'})")


def _replay_space(args: argparse.Namespace, path: Path, replay: ReplayEvaluator) -> Space:
    """The space a replay searches: ``--space``, else the recording's own (a shipped
    recording's ``NAME.yaml`` beside it, or the built-in space its header names)."""
    if args.space:
        return load_space(args.space)
    beside = path.with_name(path.name.split(".")[0] + ".yaml")
    from ..resources import recordings_dir

    if path.parent.resolve() == recordings_dir().resolve() and beside.is_file():
        return load_space(beside)
    if "space" in replay.header:
        return load_space(str(replay.header["space"]))
    raise UsageError(f"--space: required with --replay {path.name} (its header names no built-in space)")


def _quiet_optuna(verbose: bool) -> None:
    """Optuna's own INFO lines (``A new study created in RDB ...``) only with ``--verbose``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.WARNING)


def cmd_search(args: argparse.Namespace) -> int:
    unsupported = unsupported_reason()  # the search reaches under Optuna's API: stop before anything is written
    if unsupported:
        raise UsageError(unsupported)
    _quiet_optuna(args.verbose)
    space, replay = _search_space(args)
    devices = _parse_devices(args)
    console = Console(highlight=False, stderr=args.json)  # with --json, stdout holds only the JSON
    time_s = args.time if args.time is not None else space.search.time_s
    trials = args.trials if args.trials is not None else space.search.budget
    top_k = args.top_k if args.top_k is not None else space.search.top_k

    # -- which run, which shapes: checked before anything is written ------------------------
    created: Path | None = None  # a directory this command made, removed again if the search cannot start
    if args.resume:
        path = Path(args.run_dir) if args.run_dir else _latest_run(DEFAULT_RUNS, space)
        if not (path / "run.json").exists():
            raise UsageError(f"--resume: {path} is not a run directory (no run.json)")
        run = RunDir.open(path)
        meta = run.meta()
        _check_recorded(run, meta)
        if not os.access(run.path, os.W_OK):
            raise RunFileError(f"{run.path}: the run directory is not writable (a read-only file system or its "
                               "permissions); copy the run somewhere writable to resume it")
        if args.shape and sorted(args.shape) != sorted(meta.get("shapes") or []):
            raise UsageError(f"--resume: the run in {path} searched shapes {meta.get('shapes') or 'all'}; resume it without --shape")
        if args.add_shape and sorted(args.add_shape) != sorted(meta.get("added_shapes") or []):
            raise UsageError(f"--resume: the run in {path} added shapes {meta.get('added_shapes') or 'none'}; "
                             "resume it without --add-shape")
        recorded_by = meta.get("partition") or "none"  # a run from before partitions searched one
        if args.partition and args.partition != recorded_by:
            raise UsageError(f"--resume: the run in {path} was searched with --partition {recorded_by}; "
                             "resume it without --partition")
        partition_by = recorded_by
        space = restrict_shapes(space, meta.get("shapes"), meta.get("added_shapes"))
        _apply_resume_flags(args, meta, args.time, run, console)
        strategy, seed, trials = meta["strategy"], meta.get("seed") or 0, meta["trials"]
        time_s, top_k = meta.get("time_s"), meta.get("top_k") or space.search.top_k
        storage = run.storage_url(meta["storage"])
        records, _ = run.read_results()  # a damaged record stops the resume here, before any evaluation
        for part in plan(space, partition_by):  # each partition's study
            mine = sum(1 for r in records if r.get("partition") == part.name)
            problem = study_problem(storage, part.study_name(meta.get("study_name") or run.name), meta.get("run_id"),
                                    run.sqlite_file(storage), mine, bool(meta.get("study_linked")))
            if problem:
                raise UsageError(f"--resume: {problem}")
        meta.setdefault("run_id", uuid.uuid4().hex)
        meta.setdefault("run_name", run.name)
    else:
        space = restrict_shapes(space, args.shape, args.add_shape)
        partition_by = args.partition or DEFAULT_PARTITION
        strategy, seed = args.strategy or space.search.strategy, args.seed or 0
        if args.run_dir and (Path(args.run_dir) / "run.json").exists():
            raise UsageError(f"--run-dir: {args.run_dir} already holds a run; add --resume to continue it")

    # -- the evaluators: one per device ---------------------------------------------------
    evaluators: list[Any]
    pool = None  # the compile processes (a GPU search), one pool for every partition
    ahead = AheadBuilds()  # the builds submitted to it before the search asks for them
    if replay is not None:
        mismatch = replay.mismatch(space)
        if mismatch:
            raise UsageError(f"--replay: {mismatch}")
        labels = [c.label() for c in space.cases]
        evaluators = ReplayCandidates(replay.path, args.replay_delay, replay=replay, labels=labels).on_devices(devices)
        recorded = replay.baseline()
        baseline = {label: recorded[label] for label in labels if label in recorded}
        info = {"gpu": f"{replay.gpu} (replay)" if replay.gpu else f"replay of {replay.path.name}", "replay": str(replay.path)}
        arch = space.target.arch
    else:
        require_gpu()
        pool = compile_pool(args.jobs, devices)  # its processes start and warm up beside the GPU workers and SDPA's timing
        try:
            evaluators, info, arch, space = _start_gpus(space, devices, seed, console)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if replay is not None and not replay.case_labels() and partition_by != "none":
        if args.partition:  # a recording of geometric means alone cannot answer for a part of the cases
            console.print(f"note: {replay.path.name} holds no per-case times: one search over every case "
                          "(--partition none)", soft_wrap=True)
        partition_by = "none"

    try:
        try:
            partitions = plan(space, partition_by, trials)
        except ValueError as exc:
            raise UsageError(f"--partition {partition_by}: {exc}") from None
        if len(partitions) > 1 and any(p.trials < 1 for p in partitions):
            raise UsageError(f"--trials {trials}: fewer evaluations than the {len(partitions)} partitions of the search "
                             f"({', '.join(str(p.name) for p in partitions)}); give at least {len(partitions)}, "
                             "or --partition none")
        if pool is not None:  # the strategy's first proposals compile while SDPA is timed
            opening = SAMPLERS[strategy].opening
            for part in partitions:
                build_ahead(pool, part.space, opening(part.space), arch, ahead, keep=True)
        if not args.resume:
            run, created = _new_run(args, space)
            recorded_storage = _recorded_storage(args.storage) if args.storage else DEFAULT_STORAGE
            storage = run.storage_url(recorded_storage)
            meta = {"space": space.name, "space_path": str(space.path), "strategy": strategy, "seed": seed,
                    "storage": recorded_storage, "study_name": args.study or run.name, "run_id": uuid.uuid4().hex,
                    "run_name": run.name, "trials": trials, "time_s": time_s, "top_k": top_k,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "replay": str(replay.path) if replay else None,
                    "shapes": args.shape or None, "added_shapes": args.add_shape or None, "partition": partition_by}
        prepare_storage(storage)  # searches that start together race to make a new database's tables: not after SDPA's timing
        if batch_process_wanted(len(devices)):  # each partition's strategy's batch process: started now, beside the GPUs'
            for part in partitions:
                start_ahead(sampler_recipe(strategy, part.space, seed=seed), storage, part.study_name(meta["study_name"]),
                            len(devices))
        if replay is None:
            if args.resume and (run.path / "baseline.json").exists():
                baseline = json.loads((run.path / "baseline.json").read_text())
            else:
                with console.status("timing SDPA's backends" + ("' backward" if space.backward else "") + " on every shape"):
                    baseline = evaluators[0].baseline()
                run.write_json("baseline.json", baseline)
        elif baseline:
            run.write_json("baseline.json", baseline)
        meta.update(gpu=info, arch=arch, devices=devices, case_flops={c.label(): space.flops(c) for c in space.cases},
                    partitions=[p.to_json(meta["study_name"]) for p in partitions] if len(partitions) > 1 else None)
        run.write_meta(meta)
        run.write_json("env.json", info)
    except BaseException:
        _close(evaluators, pool)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)  # no stub run left behind
        raise

    studies = _open_studies(args, run, meta, partitions, strategy, seed, storage, console)
    on = f"{len(devices)} × {info.get('gpu')} (devices {','.join(map(str, devices))})" if len(devices) > 1 else info.get("gpu")
    # paths and commands on lines of their own, never wrapped, so that they copy whole
    console.print(f"run [bold]{run.path}[/]", soft_wrap=True)
    console.print(f"strategy {strategy}, budget {trials} evaluations" + (f" or {time_s / 60:.1f} min" if time_s else "")
                  + f", on {on}", soft_wrap=True)
    if len(partitions) > 1:
        console.print(f"{len(partitions)} partitions (--partition {partition_by}), side by side, evaluations each: "
                      + ", ".join(f"{p.name} {p.trials}" for p in partitions), soft_wrap=True)
    console.print(f"dashboard: optuna-dashboard {storage}", soft_wrap=True)

    for study in studies:  # the strategies' valid sets and tables, before the search's clock starts
        getattr(study.sampler, "warm", lambda: None)()
    stats = SearchStats(devices=len(evaluators))
    with _SearchProgress(partitions, baseline, console, done=len(run.results()),
                         disable=args.quiet or args.json) as progress:
        run_parts([SearchPart(part.space, study, part.trials, part.name) for part, study in zip(partitions, studies)],
                  evaluators, run, arch=arch, time_s=time_s, on_result=progress.on_result, build=not args.replay,
                  stats=stats, pool=pool, compile_workers=args.jobs, ahead=ahead)

    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    summary = stats.summary()
    board = _finalize(run, partitions, evaluators, top_k, baseline, info, console,
                      retime_rounds=0 if args.replay else args.retime_rounds)
    _close(evaluators)
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), summary=summary)
    run.write_meta(meta)

    if args.json:
        print(json.dumps({"run": str(run.path), "storage": storage, "study": meta["study_name"], "summary": summary,
                          "leaderboard": board["entries"]}))
    else:
        _print_outcome(args, console, run, storage, summary, board, several=len(partitions) > 1)
    return EXIT_OK if board["entries"] else EXIT_FAILED


def _search_space(args: argparse.Namespace) -> tuple[Space, ReplayEvaluator | None]:
    """The space to search and, with ``--replay``, the recording that answers for the GPU."""
    replay_path = _replay_path(args.replay) if args.replay else None
    replay: ReplayEvaluator | None = None
    if replay_path is not None:
        try:
            replay = ReplayEvaluator(replay_path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--replay: {replay_path}: not a recording ({exc})") from None
        space = _replay_space(args, replay_path, replay)
    elif not args.space:
        raise UsageError("--space: required (a YAML path or a built-in name; `evoengineer spaces` lists them), "
                         "or --replay demo to replay a recording without a GPU")
    else:
        space = load_space(args.space)
    if space.recorded:  # known only by its recording: search it by replay
        if replay is None:
            raise UsageError(f"--space: {args.space} is a recorded problem (problem.kind: recorded); search it with --replay RECORDING")
        space = replay.narrow(space)
    return space, replay


def _open_studies(args: argparse.Namespace, run: RunDir, meta: dict, partitions: list[Partition], strategy: str,
                  seed: int, storage: str, console: Console) -> list[Any]:
    """One study per partition, all in the run's storage, linked to the run; on resume, the
    evaluations a killed search left under way recovered."""
    heartbeat = args.heartbeat or meta.get("heartbeat_s") or DEFAULT_HEARTBEAT_S
    meta["heartbeat_s"] = heartbeat
    studies = []
    for part in partitions:
        study = open_study(part.space, run, strategy=strategy, seed=seed, storage=storage,
                           study_name=part.study_name(meta["study_name"]), resume=bool(args.resume or args.study),
                           heartbeat_s=heartbeat)
        link_run(study, meta["run_id"], run.name)
        studies.append(study)
    if not meta.get("study_linked"):
        meta["study_linked"] = True
        run.write_meta(meta)
    if args.resume:
        recovered = sum(recover_interrupted(study, run, part.space, part.name) for part, study in zip(partitions, studies))
        if recovered:
            console.print(f"resumed: {recovered} interrupted evaluation(s) recovered")
    return studies


def _new_run(args: argparse.Namespace, space: Space) -> tuple[RunDir, Path | None]:
    """A new run directory (``--run-dir`` or one under runs/) with the space it searches, and the
    directory this command made (removed again if the search cannot start)."""
    if not args.run_dir:
        run = RunDir.create(DEFAULT_RUNS, space)
        return run, run.path
    path = Path(args.run_dir)
    created = None if path.exists() else path
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "sources").mkdir(exist_ok=True)
        (path / "space.yaml").write_text(space.source_text())
    return RunDir(path), created


class _SearchProgress:
    """The search's progress bar: evaluations, and each partition's best against the fastest
    SDPA backend's time (geometric means over its cases)."""

    def __init__(self, partitions: list[Partition], baseline: dict, console: Console, *, done: int, disable: bool) -> None:
        best_sdpa = fastest_sdpa(baseline)
        self.partitions = partitions
        self.references: dict[str | None, float | None] = {}
        for part in partitions:
            times = [best_sdpa[label][1] for label in part.labels if label in best_sdpa]
            self.references[part.name] = geomean(times) if times and len(times) == len(part.labels) else None
        self.best_us: dict[str | None, float] = {}
        total = sum(p.trials for p in partitions)
        self.progress = Progress(TextColumn("[bold]search[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[best]}"), TextColumn("{task.fields[counts]}"), console=console,
                                 disable=disable)
        self.task = self.progress.add_task("search", total=total, completed=min(done, total), best="", counts="")

    def __enter__(self) -> "_SearchProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def best_line(self) -> str:
        if len(self.partitions) == 1:
            name = self.partitions[0].name
            best, reference = self.best_us.get(name), self.references[name]
            if best is None:
                return ""
            return f"best {best:.2f} µs" + (f" ({reference / best:.2f}× fastest SDPA)" if reference else "")
        # several partitions side by side: each one's best against the fastest SDPA
        shown = []
        for name in (p.name for p in self.partitions):
            if name in self.best_us:
                reference = self.references[name]
                shown.append(f"{name} " + (f"{reference / self.best_us[name]:.2f}×" if reference else f"{self.best_us[name]:.1f} µs"))
        return " ".join(shown)

    def on_result(self, result: EvalResult, stats: SearchStats, part: str | None) -> None:
        if result.ok and (part not in self.best_us or result.objective_us < self.best_us[part]):
            self.best_us[part] = result.objective_us
        counts = " ".join(f"{k} {v}" for k, v in stats.counts.items() if v)
        self.progress.update(self.task, advance=1, best=self.best_line(), counts=counts)


def _print_outcome(args: argparse.Namespace, console: Console, run: RunDir, storage: str, summary: dict, board: dict,
                   several: bool) -> None:
    """The summary, the leaderboard and the next commands, after a search."""
    from ..results import leaderboard_grid, print_grid, profile_grid, search_summary_grid

    print_grid(console, search_summary_grid(summary), wide=args.wide)
    if args.profile:
        print_grid(console, profile_grid(summary), wide=args.wide)
    if board["entries"]:
        print_grid(console, leaderboard_grid(board), wide=args.wide)
        next_steps = [f"leaderboard: evoengineer leaderboard {run.path}", f"report:      evoengineer report {run.path}",
                      f"export:      evoengineer export {run.path} --out best/" if several else
                      f"export:      evoengineer export {run.path} --rank 1 --out best/"]
    else:
        next_steps = [f"no configuration passed: each one's status and reason are in {run.path / 'results.jsonl'}"]
    for line in [f"run directory: {run.path}", *next_steps, f"dashboard:   optuna-dashboard {storage}"]:
        console.print(line, soft_wrap=True, markup=False)


def _start_gpus(space: Space, devices: list[int], seed: int | None, console: Console) -> tuple[list[Any], dict, str, Space]:
    """One started GPU worker per device: (evaluators, the GPU's info, the arch compiled for,
    the space for that arch). A worker that fails to start, or GPUs of several kinds, stop here."""
    from ..gpu import Evaluator

    import torch

    missing = [d for d in devices if d >= torch.cuda.device_count()]
    if missing:
        raise UsageError(f"--devices: no GPU {missing[0]} on this machine ({torch.cuda.device_count()} visible)")
    best_case_us: dict[str, float] = {}  # one racing table for every lane
    evaluators = [Evaluator(space, device=d, seed=seed or 0, best_case_us=best_case_us) for d in devices]
    try:
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
    except BaseException:
        _close(evaluators)
        raise
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
    return evaluators, info, arch, space


def _close(evaluators: list[Any], pool: Any = None) -> None:
    close_started()
    for ev in evaluators:
        if hasattr(ev, "close"):
            ev.close()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def _finalize(run: RunDir, partitions: list[Partition], evaluators: list[Any], top_k: int, baseline: dict, info: dict,
              console: Console, retime_rounds: int) -> dict:
    """Each partition's ``top_k`` re-timed and ranked; the run's leaderboard (one board, in
    sections per partition for a search in partitions) written and returned."""
    from ..results import LEADERBOARD, build_leaderboard, merge_boards

    evaluator = evaluators[0]
    boards: list[tuple[str, list[str], dict]] = []
    retimed_all: dict[str, dict] = {"candidates": {}, "failures": {}, "sdpa": {}}
    for part in partitions:
        finalists = best_results(run, top_k, part.name)
        retimed = None
        if finalists and retime_rounds:
            from ..bench import retime

            narrow_evaluator(evaluator, part.space)
            with console.status(f"re-timing the top {len(finalists)}{' of ' + part.name if part.name else ''} "
                                f"interleaved with SDPA ({retime_rounds} rounds)"):
                reports = [evaluator.build(part.space.config(r["config"])) for r in finalists]
                retimed = retime(evaluator, reports, rounds=retime_rounds)
            for section, rows in retimed_all.items():  # one file: per configuration and case, per case
                for name, per in retimed.get(section, {}).items():
                    rows[name] = {**rows.get(name, {}), **per} if isinstance(per, dict) else per
        flops = {c.label(): part.space.flops(c) for c in part.space.cases}
        boards.append((part.name or "", part.labels, build_leaderboard(finalists, retimed, baseline, flops, info.get("gpu", "?"))))
    if any(retimed_all.values()):
        run.write_json("retimed.json", retimed_all)
    board = merge_boards(boards) if len(partitions) > 1 else boards[0][2]
    board.update(space=partitions[0].space.name, run=str(run.path))
    run.write_json(LEADERBOARD, board)
    return board


def cmd_runs(args: argparse.Namespace) -> int:
    root = Path(args.root)
    rows, damaged = [], 0
    for path in sorted(root.glob("*/run.json")):
        run = RunDir(path.parent)
        try:
            meta = run.meta()
            results = run.results()
        except RunFileError as exc:  # listed on stderr, one line each; the other runs are still listed
            print(f"error: {exc}", file=sys.stderr)
            damaged += 1
            continue
        ok = [r for r in results if r["status"] == "ok"]
        best = min((r["objective_us"] for r in ok), default=None)
        rows.append({"run": str(path.parent), "space": meta.get("space"), "strategy": meta.get("strategy"),
                     "gpu": (meta.get("gpu") or {}).get("gpu"), "evaluations": len(results), "ok": len(ok),
                     "best_us": best, "finished": bool(meta.get("finished")), "started": meta.get("started")})
    status = EXIT_USAGE if damaged else EXIT_OK
    if args.json:
        print(json.dumps(rows))
        return status
    if not rows:
        Console().print(f"no runs under {root}/ (evoengineer search --space SPACE starts one)")
        return status
    from ..results import print_grid, runs_grid

    print_grid(Console(highlight=False), runs_grid(str(root), rows), wide=args.wide)
    return status


DEMO_TRIALS = 120


def cmd_demo(args: argparse.Namespace) -> int:
    """``search --replay demo``: the shipped H100 recording on its own space, no GPU needed."""
    argv = ["--replay", "demo", "--strategy", args.strategy, "--trials", str(args.trials), "--seed", str(args.seed)]
    argv += ["--run-dir", args.run_dir] if args.run_dir else []
    argv += [flag for flag, on in (("--quiet", args.quiet), ("--wide", args.wide), ("--verbose", args.verbose)) if on]
    return cmd_search(args.search_parser.parse_args(argv))


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
    p.add_argument("--space", help="space YAML path or built-in name (l4, h100, h100-bf16, h100-decode; `evoengineer spaces` "
                   "lists them); with --replay, the recording's own space by default")
    p.add_argument("--strategy", choices=STRATEGIES, help="evo, tpe, random or grid (default: the space's)")
    p.add_argument("--trials", type=whole(1), help="evaluation budget (default: the space's search.budget)")
    p.add_argument("--time", type=duration, help="time budget such as 90s, 15m, 1h (default: the space's search.time)")
    p.add_argument("--top-k", type=whole(1), dest="top_k", help="finalists to re-time for the leaderboard (default: the space's)")
    p.add_argument("--seed", type=whole(0), help="strategy and input seed (default 0)")
    p.add_argument("--shape", action="append", metavar="B,H,S,D",
                   help="search only this shape of the space, full and causal (repeatable; default: every shape); "
                        "B,H,S/S_KV,D names a shape whose K/V length differs, e.g. 8,32,1/4096,128 (decode). "
                        "A search of one shape finds its own winner, e.g. --shape 1,8,512,64 for the small, "
                        "latency-bound shape (--partition shape: each shape so)")
    p.add_argument("--partition", choices=PARTITION_BY,
                   help="search each part of the space's cases on its own, as export dispatches: head-dim: "
                        "one search per dtype, head dim and decode or not, each with the configurations valid at "
                        "its head dim and its share of the budget; regime (default): as head-dim, a head dim's "
                        "small shapes (fewer 128-row tiles than SMs) apart from its large ones; shape: one per "
                        "shape (what --shape does, for every shape); none: one geometric mean over every case")
    p.add_argument("--add-shape", action="append", metavar="B,H,S,D", dest="add_shape",
                   help="also search this shape, which the space does not list, full and causal, in the space's "
                        "dtypes (repeatable; alone, the search covers only the added shapes), e.g. --add-shape "
                        "8,16,4096,128 for a per-shape search of a long sequence; its head dim must be the space's")
    p.add_argument("--run-dir", help="the run's directory (default runs/<date>-<space>-<id>/)")
    p.add_argument("--storage", help="Optuna storage URL for the study (default: SQLite inside the run directory)")
    p.add_argument("--study", help="study name to create or join in --storage: several searches (one per GPU or host, "
                   "each with its own run directory) given the same --storage and --study share one search")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir (default: the latest run of the space)")
    p.add_argument("--device", type=whole(0), help="CUDA device index (default 0)")
    p.add_argument("--devices", help="evaluate on several GPUs of this host at once: indices such as 0,1,2,3 or 'all' "
                   "(one worker per GPU, one search, one study; with --replay, simulated devices)")
    p.add_argument("--heartbeat", type=whole(1), metavar="S",
                   help=f"seconds between the heartbeats of running trials in the study (default {DEFAULT_HEARTBEAT_S}); "
                        f"a trial silent for {GRACE_BEATS} heartbeats belongs to a dead search and is re-queued")
    p.add_argument("--jobs", type=whole(1), default=None,
                   help="parallel compile processes (default: one per CPU, less the cores kept for the GPU workers and "
                        "the search on a host with cores to spare); searches sharing a host share its cores: "
                        "give each its part")
    p.add_argument("--retime-rounds", type=whole(0), default=3,
                   help="interleaved re-timing rounds for the finalists (default 3; 0: rank on the search's timings)")
    p.add_argument("--replay", metavar="RECORDING",
                   help="answer from a recording instead of a GPU (no compile, no GPU): a results.jsonl, a recording "
                        "from benchmarks/record.py, or `demo` (shipped: an H100's times for the h100 space's mma path)")
    p.add_argument("--replay-delay", type=number(0), default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.add_argument("--profile", action="store_true",
                   help="print where the time went: per phase (strategy, compile, load, gate, timing, ipc, storage) "
                        "the total, the mean per evaluation and the share of the wall time")
    p.add_argument("--json", action="store_true", help="print the run's summary (as in run.json) and leaderboard as JSON")
    p.add_argument("--verbose", action="store_true", help="also print Optuna's own log lines")
    p.set_defaults(func=cmd_search)
    search_parser = p

    p = sub.add_parser("demo", help="a search without a GPU: replay an H100's recorded times (search --replay demo)",
                       description="Search the h100 space's mma path on B1 H8 S512 D64 (778 valid configurations), "
                       "answered from times an H100 recorded for every one of them (shipped with the package): the "
                       "search, its run directory and leaderboard as on a GPU, in seconds. Then leaderboard, report "
                       "and export take the run directory it prints, as after any search.")
    p.add_argument("--trials", type=whole(1), default=DEMO_TRIALS, help=f"evaluation budget (default {DEMO_TRIALS})")
    p.add_argument("--strategy", choices=STRATEGIES, default="evo", help="evo, tpe, random or grid (default evo)")
    p.add_argument("--seed", type=whole(0), default=0, help="strategy seed (default 0)")
    p.add_argument("--run-dir", help="the run's directory (default runs/<date>-h100_mma_seed-<id>/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.add_argument("--verbose", action="store_true", help="also print Optuna's own log lines")
    p.set_defaults(func=cmd_demo, search_parser=search_parser)

    p = sub.add_parser("runs", help="list search runs")
    p.add_argument("--root", default=str(DEFAULT_RUNS), help="where runs live (default runs/)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_runs)


