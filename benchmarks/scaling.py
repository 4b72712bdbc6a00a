"""How a search scales over GPUs: the same space and budget on 1, 2 (and 4) GPUs.

    python benchmarks/scaling.py --space h100 --trials 160                    # 1, 2, 4 GPUs (those present)
    python benchmarks/scaling.py --space h100 --trials 160 --processes        # also: one process per GPU, one study
    python benchmarks/scaling.py --space spaces/x.yaml --replay rec.jsonl --replay-delay 0.5 --gpus 1,2,4   # no GPU
    python benchmarks/scaling.py --gpus 1,4 --processes --devices-per-process 2 --storage postgresql+psycopg://...

Each row is one `evoengineer search` (``--devices 0,..,N-1``; with ``--processes`` also N / K
searches of K devices each, ``--devices-per-process K``, sharing one study in ``--storage`` or a
SQLite file and the host's cores, ``--jobs`` each: several hosts as one host simulates them),
each with a fresh run directory and compile cache. The search loop's own time (run.json's summary) gives evaluations per
minute; the process time (workers' start, SDPA baseline) is shown besides. Duplicates are
configurations recorded more than once in one partition; the split is the evaluations per GPU.
Several searches of one row: the longest of their loops counts, and ``skew`` says how far apart
their loops began.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from evoengineer.search.cpus import compile_plan  # noqa: E402


def _gpus_present() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _search(args: argparse.Namespace, run: Path, extra: list[str], cache: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "evoengineer", "search", "--space", args.space, "--trials", str(args.trials),
           "--strategy", args.strategy, "--seed", str(args.seed), "--run-dir", str(run), "--retime-rounds", "0",
           "--json", *extra]
    if args.replay:
        cmd += ["--replay", args.replay, "--replay-delay", str(args.replay_delay)]
    env = {**os.environ, "EVOENGINEER_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=run.parent)


def _finish(procs: list[subprocess.Popen], runs: list[Path], started: float, mode: str, gpus: int) -> dict:
    summaries = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode not in (0, 1):  # 1: no correct candidate, still a measurement
            raise SystemExit(f"search failed ({mode}, {gpus} GPU(s)):\n{err.strip()[-2000:]}")
        summaries.append(json.loads(out)["summary"])
    wall = time.perf_counter() - started
    # a configuration searched in two partitions (head dims) is two evaluations, not a duplicate
    keys = [(record.get("partition"), record["key"]) for run in runs if (run / "results.jsonl").exists()
            for line in (run / "results.jsonl").read_text().splitlines() if line.strip().endswith("}")
            for record in (json.loads(line),)]
    split: Counter[str] = Counter()
    for i, s in enumerate(summaries):
        for device, n in s.get("per_device", {str(i): s["evaluated"]}).items():
            split[device if len(summaries) == 1 else f"{i}.{device}"] += n
    evaluated = sum(s["evaluated"] for s in summaries)
    loop_s = max(s["elapsed_s"] for s in summaries)
    starts = [s["started_unix"] for s in summaries if "started_unix" in s]
    skew = round(max(starts) - min(starts), 1) if len(starts) > 1 else 0.0  # the searches' loops began this far apart
    busy = [s.get("gpu_busy_share") for s in summaries if s.get("gpu_busy_share") is not None]
    phases: Counter[str] = Counter()
    for s in summaries:
        for name, row in s.get("phases", {}).items():
            phases[name] += row["total_s"]
    return {"mode": mode, "gpus": gpus, "evaluations": evaluated, "loop_s": loop_s, "process_s": round(wall, 1),
            "evaluations_per_minute": round(60 * evaluated / loop_s, 1) if loop_s else None, "skew_s": skew,
            "duplicates": len(keys) - len(set(keys)), "split": dict(sorted(split.items())),
            "gpu_busy_share": round(sum(busy) / len(busy), 3) if busy else None,
            "phases_ms_per_evaluation": {k: round(1000 * v / evaluated, 1) for k, v in phases.items()} if evaluated else {}}


class Clocks:
    """The GPUs' SM clock, temperature and power while a row runs (``nvidia-smi`` every 0.5 s):
    a row slower per evaluation on more GPUs may be a host's power or cooling, not the search."""

    def __init__(self, gpus: int) -> None:
        self.gpus, self.proc = gpus, None
        if gpus and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,clocks.sm,temperature.gpu,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "500"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = []
        for line in out.splitlines():
            try:
                index, mhz, temp, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            if index < self.gpus and watts > 150:  # the GPUs of the row, while they work
                rows.append((mhz, temp, watts))
        if not rows:
            return {}
        return {"sm_mhz": round(sum(r[0] for r in rows) / len(rows)), "max_temp_c": max(r[1] for r in rows),
                "watts": round(sum(r[2] for r in rows) / len(rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", default="h100")
    ap.add_argument("--trials", type=int, default=160)
    ap.add_argument("--strategy", default="evo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", default="1,2,4", help="GPU counts to run (default 1,2,4; those above the GPUs present are skipped)")
    ap.add_argument("--processes", action="store_true", help="also run N searches (one per GPU) sharing one study")
    ap.add_argument("--devices-per-process", type=int, default=1, metavar="K",
                    help="with --processes: N / K searches of K GPUs each (default 1), e.g. 2 on 4 GPUs: two of two")
    ap.add_argument("--storage", metavar="URL",
                    help="with --processes: the shared study's storage, e.g. postgresql+psycopg://user@host/db "
                         "(default: a SQLite file per row); each row gets its own study in it")
    ap.add_argument("--jobs", type=int, metavar="N",
                    help="compile processes of each row (default: the search's own default; with --processes "
                         "split between the searches)")
    ap.add_argument("--replay", help="replay a recording instead of using GPUs (simulated devices)")
    ap.add_argument("--replay-delay", type=float, default=0.5, help="seconds per replayed evaluation (default 0.5)")
    ap.add_argument("--out", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    present = 10**6 if args.replay else _gpus_present()
    counts = [n for n in (int(x) for x in args.gpus.split(",")) if n <= present]
    if not counts:
        raise SystemExit(f"no GPU here ({present} present); --replay REC runs simulated devices")
    root = Path(args.out or tempfile.mkdtemp(prefix="evo-scaling-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in counts:
        devices = ",".join(str(i) for i in range(n))
        run = root / f"devices-{n}"
        started = time.perf_counter()
        clocks = Clocks(0 if args.replay else n)
        jobs = ["--jobs", str(args.jobs)] if args.jobs and not args.replay else []
        proc = _search(args, run, ["--devices", devices, "--quiet", *jobs], root / f"cache-devices-{n}")
        rows.append({**_finish([proc], [run], started, "--devices", n), **clocks.stop()})
        per = args.devices_per_process
        if args.processes and n > per and n % per == 0:
            storage = args.storage or f"sqlite:///{root / f'shared-{n}.db'}"
            groups = [",".join(str(d) for d in range(i * per, (i + 1) * per)) for i in range(n // per)]
            runs = [root / f"process-{n}-{i}" for i in range(len(groups))]
            study = f"scaling-{n}-{os.getpid()}-{int(time.time())}"
            started = time.perf_counter()
            clocks = Clocks(0 if args.replay else n)
            # the searches share the compile processes one search of all n GPUs would have
            jobs = ["--jobs", str(max(1, (args.jobs or compile_plan(range(n))[1]) // len(groups)))] if not args.replay else []
            procs = [_search(args, r, ["--devices", group, "--storage", storage, "--study", study, "--quiet", *jobs],
                             root / f"cache-process-{n}") for r, group in zip(runs, groups)]
            rows.append({**_finish(procs, runs, started, f"{len(groups)}x{per}", n), **clocks.stop()})
    base = next((r["evaluations_per_minute"] for r in rows if r["gpus"] == 1), None)
    for r in rows:
        r["speedup"] = round(r["evaluations_per_minute"] / base, 2) if base and r["evaluations_per_minute"] else None
    if args.json:
        print(json.dumps({"space": args.space, "trials": args.trials, "runs": str(root), "rows": rows}))
        return
    print(f"space {args.space}, budget {args.trials}, strategy {args.strategy}"
          + (f", replay ({args.replay_delay:g} s per evaluation)" if args.replay else "") + f"; runs in {root}")
    print(f"{'mode':<10}{'GPUs':>5}{'evals':>7}{'loop s':>8}{'proc s':>8}{'evals/min':>10}{'speed-up':>9}{'dups':>5}"
          f"{'busy':>6}{'skew':>6}  split")
    for r in rows:
        split = " ".join(f"{d}:{k}" for d, k in r["split"].items())
        busy = f"{100 * r['gpu_busy_share']:.0f}%" if r["gpu_busy_share"] is not None else "-"
        print(f"{r['mode']:<10}{r['gpus']:>5}{r['evaluations']:>7}{r['loop_s']:>8.1f}{r['process_s']:>8.1f}"
              f"{r['evaluations_per_minute']:>10.1f}{(r['speedup'] or 0):>8.2f}x{r['duplicates']:>5}{busy:>6}"
              f"{r['skew_s']:>6.1f}  {split}")
    print("where an evaluation's time went (ms per evaluation, summed over the GPUs):")
    for r in rows:
        phases = " ".join(f"{name} {ms:g}" for name, ms in r["phases_ms_per_evaluation"].items() if ms >= 0.5)
        print(f"  {r['mode']} x{r['gpus']}: {phases}")
    if any("sm_mhz" in r for r in rows):
        print("the GPUs while working (mean SM clock, power; hottest):")
        for r in rows:
            if "sm_mhz" in r:
                print(f"  {r['mode']} x{r['gpus']}: {r['sm_mhz']} MHz, {r['watts']} W; {r['max_temp_c']:g} C")


if __name__ == "__main__":
    main()
