"""How long a strategy takes to propose, as the study's history grows.

    python benchmarks/proposal_time.py --recording benchmarks/recordings/kt_gemm_rtx3090.jsonl.gz --trials 2000

Replays a recording through a study on SQLite (as a search keeps it, in a temporary
directory), one trial after another, and times each proposal: the ask and the strategy's
``sample_relative``, where it reads the history, proposes (a batch of ``--batch`` when none
is waiting) and claims the configuration in the ledger. Prints the median and 90th percentile per window of the history.
Besides the wall time, the CPU time of the proposing thread (which a machine shared with
other work does not inflate as much); say how loaded the machine was.

``--search-ask`` times what a search does per evaluation on its loop's thread instead: its ask
(a new trial, its budget slot, the strategy's proposal, claimed in one transaction with the
trial's parameters), told as the search tells it (one transaction). Optuna's ``study.ask``
also reads back every trial it has not seen finish, which the search does not call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the evoengineer command sets it (evoengineer/cli/__init__.py)
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=<another checkout> measures that one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from evoengineer.search import ReplayEvaluator, make_storage  # noqa: E402
from evoengineer.search.strategies import make_sampler, suggest_config  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.ERROR)


def measure(recording: Path, strategy: str, trials: int, seed: int, batch: int, root: Path) -> tuple[list[float], list[float]]:
    """Wall and CPU (this thread's) seconds per proposal, in trial order."""
    replay = ReplayEvaluator(recording)
    space = replay.space()
    sampler = make_sampler(strategy, space, seed=seed)
    sampler.batch_size = batch
    sampler.valid  # noqa: B018 - the space is enumerated once, before the clock
    storage = make_storage(f"sqlite:///{root / 'study.db'}", heartbeat_s=None)
    study = optuna.create_study(storage=storage, sampler=sampler, direction="minimize")
    times, cpu = [], []
    for _ in range(min(trials, len(sampler.valid))):
        started, cpu_started = time.perf_counter(), time.thread_time()
        trial = study.ask()
        trial.relative_params  # noqa: B018 - the strategy reads the history, proposes and claims
        times.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - cpu_started)
        config = suggest_config(trial, space)  # stores the parameters (the search does it in one transaction)
        result = replay.evaluate(config)
        if result.ok:
            study.tell(trial, result.objective_us)
        else:
            study.tell(trial, state=TrialState.FAIL)
    return times, cpu


def measure_search_ask(recording: Path, strategy: str, trials: int, seed: int, batch: int,
                       root: Path) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds per ask of the search loop (``_Search.ask``), in trial order."""
    from evoengineer.search import ReplayCandidates, RunDir, SearchStats
    from evoengineer.search.loop import _Search

    replay = ReplayEvaluator(recording)
    space = replay.space()
    sampler = make_sampler(strategy, space, seed=seed)
    sampler.batch_size = batch
    sampler.claim_params = True  # as the search loop sets it
    sampler.valid  # noqa: B018 - the space is enumerated once, before the clock
    storage = make_storage(f"sqlite:///{root / 'study.db'}", heartbeat_s=None)
    study = optuna.create_study(storage=storage, sampler=sampler, direction="minimize")
    (root / "run").mkdir()
    run = RunDir(root / "run")
    n = min(trials, len(sampler.valid))
    search = _Search(space, run, study, n, build=False, arch=space.target.arch)
    evaluator, stats = ReplayCandidates(recording, replay=replay), SearchStats()
    times, cpu = [], []
    for _ in range(n):
        started, cpu_started = time.perf_counter(), time.thread_time()
        candidate = search.ask(None)
        times.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - cpu_started)
        if candidate is None:
            break
        search.record(candidate, evaluator.evaluate(candidate.config), None, stats)
    return times, cpu


def windows(times: list[float], cpu: list[float], edges: list[int]) -> list[dict]:
    out = []
    for lo, hi in zip(edges, edges[1:]):
        part, part_cpu = sorted(times[lo:hi]), sorted(cpu[lo:hi])
        if not part:
            continue
        out.append({"from": lo, "to": min(hi, len(times)), "median_ms": round(1000 * statistics.median(part), 1),
                    "p90_ms": round(1000 * part[int(0.9 * (len(part) - 1))], 1), "max_ms": round(1000 * part[-1], 1),
                    "cpu_median_ms": round(1000 * statistics.median(part_cpu), 1),
                    "cpu_p90_ms": round(1000 * part_cpu[int(0.9 * (len(part_cpu) - 1))], 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recording", type=Path, default=Path("benchmarks/recordings/kt_gemm_rtx3090.jsonl.gz"))
    ap.add_argument("--strategy", default="evo")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="proposals computed at once (default 1)")
    ap.add_argument("--search-ask", action="store_true",
                    help="time the search loop's ask (trial, budget slot, proposal, claim), not Optuna's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="evo-proposal-time-") as tmp:
        how = measure_search_ask if args.search_ask else measure
        times, cpu = how(args.recording, args.strategy, args.trials, args.seed, args.batch, Path(tmp))
    edges = [0, 100, 500, 1000, 1500, 1900, 2000, 10**9]
    rows = windows(times, cpu, [e for e in edges if e < len(times)] + [len(times)])
    if args.json:
        print(json.dumps({"recording": str(args.recording), "strategy": args.strategy, "batch": args.batch,
                          "ask": "search" if args.search_ask else "optuna", "windows": rows}))
        return
    print(f"{args.strategy} on {args.recording.name}, batch {args.batch}, {len(times)} proposals (SQLite study"
          + (", the search loop's ask)" if args.search_ask else ", Optuna's ask)"))
    print(f"{'evaluations':>14} {'wall: median ms':>16} {'p90 ms':>8} {'max ms':>8} {'CPU: median ms':>15} {'p90 ms':>8}")
    for r in rows:
        print(f"{r['from']:>6}-{r['to']:<7} {r['median_ms']:>16.1f} {r['p90_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{r['cpu_median_ms']:>15.1f} {r['cpu_p90_ms']:>8.1f}")


if __name__ == "__main__":
    main()
