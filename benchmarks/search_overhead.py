"""What the search loop costs besides the GPU: a replay search whose evaluations sleep
``--delay`` seconds (standing for the GPU's gate and timing), measured in-process.

    python benchmarks/search_overhead.py --space h100 --trials 200 --delay 0.6
    python benchmarks/search_overhead.py --space h100 --trials 200 --delay 0.6 --devices 4
    python benchmarks/search_overhead.py --delay 0 --trials 200      # the loop alone

Reports evaluations per minute, the GPU-busy share (the delays' sum over the wall time
times the devices), the non-GPU overhead per evaluation in ms (the devices' time not spent
in an evaluation, per evaluation) and the search thread's CPU time per evaluation (which a
loaded machine does not inflate). Without ``--recording`` the space's valid configurations
get made-up results (10 % failures). ``--compile`` builds every candidate with NVRTC ahead,
as on a GPU box (no GPU needed). Runs on older versions of the search loop too (one device).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as the evoengineer command sets it (evoengineer/cli/__init__.py)
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=<another checkout> measures that one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic_recording(space, path: Path) -> Path:
    """Made-up results for every valid configuration of ``space``: 10 % fail the gate."""
    with path.open("w") as fh:
        fh.write(json.dumps({"header": {"space": space.name, "gpu": "synthetic"}}) + "\n")
        for config in space.valid_configs():
            h = int(hashlib.sha256(config.key().encode()).hexdigest()[:8], 16)
            ok = h % 10 != 0
            fh.write(json.dumps({"config": config.to_dict(), "key": config.key(), "status": "ok" if ok else "incorrect",
                                 "reason": "" if ok else "synthetic", "objective_us": 50 + (h % 1000) / 10 if ok else None}) + "\n")
    return path


def measure(args: argparse.Namespace, root: Path) -> dict:
    import optuna

    from evoengineer.search import ReplayCandidates, RunDir, open_study, run_search
    from evoengineer.space import load_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_space(args.space)
    recording = Path(args.recording) if args.recording else synthetic_recording(space, root / "recording.jsonl")
    run = RunDir.create(root / "runs", space)
    study = open_study(space, run, strategy=args.strategy, seed=args.seed, storage=args.storage,
                       study_name=None if not args.storage else f"overhead-{run.path.name}", resume=False)
    getattr(study.sampler, "valid", None)  # enumerate the space before the clock starts
    one = ReplayCandidates(recording, args.delay)
    evaluators = one.on_devices(list(range(args.devices))) if args.devices > 1 else one
    if args.devices > 1 and not hasattr(one, "on_devices"):
        raise SystemExit("this version of the search loop evaluates on one device only")
    kwargs = {"arch": space.target.arch, "trials": args.trials, "build": args.compile}
    if args.compile and "compile_workers" in inspect.signature(run_search).parameters and args.compile_workers:
        kwargs["compile_workers"] = args.compile_workers
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    stats = run_search(space, evaluators, run, study, **kwargs)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    n = stats.evaluated
    busy = stats.gpu_busy_s
    phases = getattr(stats, "phases", {})
    return {
        "devices": args.devices, "evaluations": n, "wall_s": round(wall, 2),
        "evaluations_per_minute": round(60 * n / wall, 1),
        "gpu_busy_share": round(busy / (wall * args.devices), 3),
        "overhead_ms_per_evaluation": round(1000 * (wall * args.devices - busy) / n, 1),
        "search_cpu_ms_per_evaluation": round(1000 * cpu / n, 1),
        "phases_mean_ms": {k: round(1000 * v / n, 1) for k, v in phases.items() if v},
        # the strategy's batches computed in the search process (not those of a batch process)
        "batches_here": dict(getattr(study.sampler, "batch_stats", {})),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", default="h100")
    ap.add_argument("--recording", help="a results recording to replay (default: made-up results for the space)")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds each evaluation stands for on the GPU (default 0)")
    ap.add_argument("--devices", type=int, default=1, help="simulated devices evaluating in parallel (default 1)")
    ap.add_argument("--strategy", default="evo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--storage", help="Optuna storage URL (default: SQLite in the run directory)")
    ap.add_argument("--compile", action="store_true", help="compile each candidate ahead with NVRTC, as a GPU search does")
    ap.add_argument("--compile-workers", type=int, help="compile processes (default: CPUs - 1)")
    ap.add_argument("--repeat", type=int, default=1, help="measure this many times")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="evo-overhead-") as tmp:
            rows.append(measure(args, Path(tmp)))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"replay search, space {args.space}, strategy {args.strategy}, {args.trials} evaluations, "
          f"{args.delay:g} s per evaluation, {args.devices} device(s){', NVRTC compile ahead' if args.compile else ''}")
    print(f"{'evals':>6} {'wall s':>8} {'evals/min':>10} {'GPU busy':>9} {'overhead ms/eval':>17} {'search CPU ms/eval':>19}")
    for r in rows:
        print(f"{r['evaluations']:>6} {r['wall_s']:>8.1f} {r['evaluations_per_minute']:>10.1f} {r['gpu_busy_share'] * 100:>8.1f}% "
              f"{r['overhead_ms_per_evaluation']:>17.1f} {r['search_cpu_ms_per_evaluation']:>19.1f}")
    if rows[-1]["phases_mean_ms"]:
        print("mean ms per evaluation: " + ", ".join(f"{k} {v:g}" for k, v in rows[-1]["phases_mean_ms"].items()))


if __name__ == "__main__":
    main()
