"""Search strategies compared on exhaustive recordings: ours, Optuna's and Kernel Tuner's.

    python benchmarks/strategies.py                                  # every recording we have
    python benchmarks/strategies.py --recording recordings/h100_mma_seed.jsonl \\
        --seeds 25 --plot strategies.png --json strategies.json
    python benchmarks/strategies.py --strategies evo --batch 1,4,8,16 --stop-within 0.02   # batch sizes

Recordings: ours (``tests/data/replay_*.jsonl``, ``recordings/h100_mma_seed.jsonl``, ``benchmarks/recordings/h100_*.jsonl``) and
Kernel Tuner's community caches converted by ``evoengineer import-cache``
(``benchmarks/recordings/kt_*.jsonl.gz``: CLBlast GEMM on an RTX 3090 and an RTX 2080 Ti, a 2D
convolution and point-in-polygon on an RTX 3090, from the AutoTuningAssociation/benchmark_hub
repository). ``--batch K`` replays our strategies proposing K configurations at once (K trials
asked, then the K evaluated): a row per K. ``--stop-within F`` ends a run once within F of the
optimum, which the counts to the thresholds at or above F do not change.

Each recording holds every valid configuration of a space, timed on a GPU, so a strategy is
replayed without one (no subprocesses, no GPU; runs spread over a process pool). A run
evaluates up to ``--budget`` distinct valid configurations (default: all of them); a strategy
that proposes a configuration again or an invalid one is not charged for it, as a cache or
the space's constraints would answer it without a GPU.

Strategies:

- ours (``evoengineer.search.strategies``): evo (the default), tpe, random, grid. The
  recordings' seed configurations are dropped (``--keep-seeds`` keeps them): they are known
  winners, and a benchmark of the search should not start from the answer.
- Optuna's own samplers, unaware of the constraints (an invalid proposal is told as failed):
  ``optuna-random``, ``optuna-tpe`` (Optuna's defaults) and ``optuna-nsga2`` (population 20);
  a sampler that proposes ``MAX_IDLE_ASKS`` invalid or evaluated configurations in a row is stuck
  and its run ends there.
  ``optuna-gp`` (GPSampler) runs when named: it fits a Gaussian process on every proposal,
  invalid ones included, and takes minutes per run. Left out: CmaEsSampler and QMCSampler
  (they sample categorical parameters with their independent sampler, i.e. RandomSampler:
  the same draws as optuna-random), NSGAIIISampler (many-objective; with one objective it is
  NSGA-II), GridSampler and BruteForceSampler (exhaustive, as grid).
- Kernel Tuner's strategies (``kt-NAME``, when ``kernel_tuner`` is installed: ``pip install
  -e '.[bench]'``), replayed in its simulation mode on a cache converted from the recording
  (``kernel_tuner_replay.py``), each with its default options and ``max_fevals``; a run that
  keeps revisiting cached configurations is stopped (``kernel_tuner_replay.REPEAT_CAP``).

Per recording and strategy, over ``--seeds`` seeds: the evaluations to reach within 1%, 2% and
5% of the recording's optimum (median and interquartile range, runs that never got there
counted as missing and as infinitely many in the quantiles), best-so-far curves (a PNG: median
with the interquartile band, log x) and the performance score of Willemsen et al.:

    F.-J. Willemsen, R. Schoonhoven, J. Filipovič, J. O. Tørring, R. van Nieuwpoort,
    B. van Werkhoven, "A methodology for comparing optimization algorithms for auto-tuning",
    Future Generation Computer Systems 159 (2024) 489-504, doi:10.1016/j.future.2024.05.021.

Their score, over a budget range, is P(b) = (R(b) - S(b)) / (R(b) - opt): S(b) the strategy's
median best-so-far after b evaluations, R(b) the expected best-so-far of random search without
replacement (calculated, not sampled), opt the optimum; 0 is random search, 1 the optimum at
every budget, below 0 worse than random. The range runs from the budget at which random search
is expected to reach 50% of the way from the median to the optimum to the budget at which it
reaches 96% (the settings of the paper's evaluation); the expected number of draws to reach
a value that k of N configurations attain is (N + 1) / (k + 1). The score is the mean of P over
that range, then over recordings. Before its first successful evaluation a run's best-so-far
counts as the recording's worst successful value (for R(b) likewise).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per run: the runs fill the cores already
import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_tuner_replay as ktr  # noqa: E402

from evoengineer.search import ReplayEvaluator  # noqa: E402
from evoengineer.search.strategies import SAMPLERS, make_sampler, suggest_config  # noqa: E402
from evoengineer.space import Config, SearchSettings, Space  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECORDINGS = ("tests/data/replay_*.jsonl*", "recordings/*.jsonl*", "benchmarks/recordings/*.jsonl*")
THRESHOLDS = (0.01, 0.02, 0.05)
CUTOFF_START, CUTOFF_END = 0.5, 0.96
DEFAULT_STRATEGY = SearchSettings().strategy
OURS = tuple(SAMPLERS)
OPTUNA = ("optuna-random", "optuna-tpe", "optuna-nsga2")
OPTUNA_OPT_IN = ("optuna-gp",)
DETERMINISTIC = {"grid", *(f"kt-{s}" for s in ktr.DETERMINISTIC)}
MAX_IDLE_ASKS = 300  # proposals in a row that are invalid or already evaluated: the sampler is stuck

optuna.logging.set_verbosity(optuna.logging.ERROR)


class UsageError(Exception):
    """A mistake in the command line: one line, exit code 2."""


# -- recordings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """A recording of every valid configuration of a space, ready to replay."""

    path: Path
    replay: ReplayEvaluator
    space: Space
    valid: tuple[Config, ...]
    values: dict[Config, float | None]

    @property
    def name(self) -> str:
        return self.path.name.split(".")[0]

    @property
    def ok_values(self) -> np.ndarray:
        return np.sort(np.array([v for v in self.values.values() if v is not None], dtype=float))

    @property
    def optimum(self) -> float:
        return float(self.ok_values[0])

    @property
    def worst(self) -> float:
        return float(self.ok_values[-1])

    def within(self, fraction: float) -> int:
        """How many configurations are within ``fraction`` of the optimum."""
        return int(np.sum(self.ok_values <= self.optimum * (1 + fraction)))


@lru_cache(maxsize=None)
def load_recording(path: str, keep_seeds: bool = False) -> Recording:
    replay = ReplayEvaluator(path)
    space = replay.space()
    if not keep_seeds:
        space = dataclasses.replace(space, search=dataclasses.replace(space.search, seeds=(), listed_seeds=()))
    valid = tuple(space.valid_configs())
    values = {}
    for config in valid:
        result = replay.evaluate(config)
        values[config] = result.objective_us if result.ok else None
    if all(v is None for v in values.values()):
        raise UsageError(f"{path}: no successful configuration")
    return Recording(Path(path), replay, space, valid, values)


def default_recordings() -> list[Path]:
    found: list[Path] = []
    for pattern in DEFAULT_RECORDINGS:
        found += sorted(ROOT.glob(pattern))
    return found


# -- runs: each returns the objectives (None: failed) of the distinct configurations, in order


def run_ours(rec: Recording, name: str, seed: int, budget: int, batch: int = 1, stop: float = 0.0) -> list[float | None]:
    """With ``batch`` k > 1: k trials are asked (the strategy proposes the k at once, each
    later one seeing the earlier ones as pending), then the k are evaluated and told."""
    sampler = make_sampler(name, rec.space, seed=seed)
    sampler.batch_size = batch
    study = optuna.create_study(sampler=sampler)
    trace: list[float | None] = []
    while len(trace) < budget:
        trials = [study.ask() for _ in range(min(batch, budget - len(trace)))]
        configs = [suggest_config(trial, rec.space) for trial in trials]
        for trial, config in zip(trials, configs):
            result = rec.replay.evaluate(config)
            trace.append(result.objective_us if result.ok else None)
            if result.ok:
                study.tell(trial, result.objective_us)
            else:
                study.tell(trial, state=TrialState.FAIL)
        if any(v is not None and v <= rec.optimum * (1 + stop) for v in trace[-len(trials):]):
            break  # nothing left to find (or, with ``stop``, close enough)
    return trace


def _optuna_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    if name == "optuna-random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "optuna-tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "optuna-nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=20)
    if name == "optuna-gp":
        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
    raise ValueError(name)


def run_optuna(rec: Recording, name: str, seed: int, budget: int, stop: float = 0.0) -> list[float | None]:
    """One of Optuna's samplers over the raw product of the parameters: an invalid proposal is
    told as failed, one already evaluated gets its recorded result again; neither is charged."""
    valid = set(rec.valid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(sampler=_optuna_sampler(name, seed))
        done: dict[Config, float | None] = {}
        trace: list[float | None] = []
        idle = 0
        while len(trace) < budget and idle < MAX_IDLE_ASKS:
            trial = study.ask()
            config = Config({p.name: trial.suggest_categorical(p.name, list(p.values)) for p in rec.space.params})
            if config not in valid:
                study.tell(trial, state=TrialState.FAIL)
                idle += 1
                continue
            if config in done:
                idle += 1
            else:
                idle = 0
                done[config] = rec.values[config]
                trace.append(done[config])
            value = done[config]
            if value is None:
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, value)
            if value is not None and value <= rec.optimum * (1 + stop):
                break
    return trace


def run_kernel_tuner(rec: Recording, name: str, seed: int, budget: int, cache: Path) -> list[float | None]:
    return ktr.run_strategy(cache, rec.space, name.removeprefix("kt-"), seed, budget)


@dataclass(frozen=True)
class Task:
    recording: str
    keep_seeds: bool
    strategy: str
    seed: int
    budget: int
    kt_cache: str | None = None
    batch: int = 1
    stop: float = 0.0

    @property
    def label(self) -> str:
        """The strategy's row: ``evo``, or ``evo k=8`` for proposals in batches of 8."""
        return self.strategy if self.batch == 1 else f"{self.strategy} k={self.batch}"


def run_task(task: Task) -> tuple[Task, list[float | None], float]:
    rec = load_recording(task.recording, task.keep_seeds)
    started = time.perf_counter()
    if task.strategy in OURS:
        trace = run_ours(rec, task.strategy, task.seed, task.budget, task.batch, task.stop)
    elif task.strategy.startswith("optuna-"):
        trace = run_optuna(rec, task.strategy, task.seed, task.budget, task.stop)
    elif task.strategy.startswith("kt-"):
        assert task.kt_cache is not None
        trace = run_kernel_tuner(rec, task.strategy, task.seed, task.budget, Path(task.kt_cache))
    else:
        raise ValueError(f"unknown strategy {task.strategy!r}")
    return task, trace, time.perf_counter() - started


# -- statistics ---------------------------------------------------------------------------


def best_so_far(trace: Sequence[float | None], budget: int, fill: float) -> np.ndarray:
    """Best value after 1..budget evaluations; ``fill`` before the first success; flat after the run."""
    out = np.empty(budget)
    best = math.inf
    for i in range(budget):
        if i < len(trace) and trace[i] is not None and trace[i] < best:
            best = float(trace[i])
        out[i] = best
    out[np.isinf(out)] = fill
    return out


def evaluations_to(trace: Sequence[float | None], target: float) -> int | None:
    for i, value in enumerate(trace, 1):
        if value is not None and value <= target:
            return i
    return None


def random_expected_best(rec: Recording, budget: int) -> np.ndarray:
    """Expected best-so-far of uniform random search without replacement after 1..budget draws.

    Over the N valid configurations sorted best first (failures last, worth the worst success),
    the best of M draws is rank i with probability S_i(M) - S_{i+1}(M), S_i(M) = C(N-i+1, M) / C(N, M)."""
    ok = rec.ok_values
    n = len(rec.valid)
    w = np.concatenate([ok, np.full(n - len(ok), ok[-1])])
    survive = np.ones(n + 1)  # S_i for i = 1..N+1 (0-based: survive[i-1])
    ranks = np.arange(1, n + 2)
    out = np.empty(budget)
    for m in range(1, budget + 1):
        # S_i(m) = S_i(m-1) * (N - i + 1 - (m - 1)) / (N - (m - 1))
        survive = survive * np.clip(n - ranks + 1 - (m - 1), 0, None) / (n - (m - 1))
        p = survive[:-1] - survive[1:]
        out[m - 1] = float(np.dot(p, w))
    return out


def random_expected_evaluations(n: int, k: int) -> float:
    """Expected draws without replacement from ``n`` until one of ``k`` marked items: (n + 1) / (k + 1)."""
    return (n + 1) / (k + 1)


def score_range(rec: Recording) -> tuple[int, int]:
    """Willemsen et al.'s budget range: random search's expected evaluations to the cutoffs."""
    ok = rec.ok_values
    median = float(np.median(ok))

    def fevals(cutoff: float) -> int:
        target = rec.optimum + (median - rec.optimum) * (1 - cutoff)
        k = int(np.sum(ok <= target))
        return math.ceil(random_expected_evaluations(len(rec.valid), k))

    start, end = fevals(CUTOFF_START), fevals(CUTOFF_END)
    return start, max(start, end)


def quantiles(runs: Sequence[int | None]) -> tuple[float, float, float]:
    """Quartiles of evaluation counts, a miss (None) counting as infinitely many."""
    if not runs:
        return (math.nan,) * 3
    big = 1e15
    arr = np.array([big if r is None else r for r in runs], dtype=float)
    q = np.quantile(arr, [0.25, 0.5, 0.75])
    return tuple(math.inf if v > big / 2 else float(v) for v in q)  # type: ignore[return-value]


def summarise(rec: Recording, traces: list[list[float | None]], budget: int, random_curve: np.ndarray) -> dict[str, Any]:
    reach: dict[str, Any] = {}
    for fraction in THRESHOLDS:
        runs = [evaluations_to(t, rec.optimum * (1 + fraction)) for t in traces]
        q1, med, q3 = quantiles(runs)
        reach[f"{fraction:.0%}"] = {"median": med, "q1": q1, "q3": q3, "missed": sum(r is None for r in runs), "runs": runs}
    curves = np.array([best_so_far(t, budget, rec.worst) for t in traces])
    q1, med, q3 = np.quantile(curves, [0.25, 0.5, 0.75], axis=0)
    start, end = score_range(rec)
    b = np.arange(start, min(end, budget) + 1) - 1
    denom = random_curve[b] - rec.optimum
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(denom > 0, (random_curve[b] - med[b]) / denom, 0.0)
    return {
        "seeds": len(traces),
        "reach": reach,
        "score": float(np.mean(p)) if len(p) else math.nan,
        "curve": {"median": med.tolist(), "q1": q1.tolist(), "q3": q3.tolist()},
        "evaluations": [len(t) for t in traces],
    }


# -- the benchmark --------------------------------------------------------------------------


def available_strategies(names: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """The strategies to run and notes on those left out."""
    notes = []
    kt = [f"kt-{s}" for s in ktr.STRATEGIES]
    if names is None:
        names = [*OURS, *OPTUNA, *kt]
        notes.append(f"left out: {', '.join(OPTUNA_OPT_IN)} (minutes per run; name it with --strategies to run it)")
        notes += [f"left out: kt-{k} ({why})" for k, why in ktr.EXCLUDED.items()]
    known = {*OURS, *OPTUNA, *OPTUNA_OPT_IN}
    out = []
    for name in names:
        if name.startswith("kt-"):
            if not ktr.available():
                continue
            out.append(name)
        elif name in known:
            out.append(name)
        else:
            raise UsageError(f"--strategies: unknown strategy {name!r}; expected one of "
                             f"{', '.join([*OURS, *OPTUNA, *OPTUNA_OPT_IN])} or kt-NAME")
    if any(n.startswith("kt-") for n in names) and not ktr.available():
        notes.append("Kernel Tuner is not installed (pip install -e '.[bench]'): its strategies are skipped")
    return out, notes


def benchmark(
    recordings: Sequence[Path],
    strategies: Sequence[str] | None = None,
    seeds: int = 25,
    budget: int | None = None,
    workers: int = 1,
    keep_seeds: bool = False,
    progress: Callable[[str], None] | None = None,
    batches: Sequence[int] = (1,),
    stop_within: float = 0.0,
) -> dict[str, Any]:
    """Replay every strategy ``seeds`` times on every recording; the statistics as a JSON-able dict.
    ``batches``: batch sizes our strategies propose in (a row per size beyond 1: ``evo k=8``)."""
    names, notes = available_strategies(strategies)
    results: dict[str, Any] = {"seeds": seeds, "keep_seeds": keep_seeds, "stop_within": stop_within, "default": DEFAULT_STRATEGY, "notes": notes,
                               "kernel_tuner": ktr.version() if ktr.available() else None, "optuna": optuna.__version__,
                               "recordings": {}}
    with tempfile.TemporaryDirectory(prefix="kt-cache-") as tmp:
        tasks: list[Task] = []
        recs: dict[str, Recording] = {}
        for path in recordings:
            rec = load_recording(str(path), keep_seeds)
            recs[str(path)] = rec
            n = len(rec.valid)
            runs = min(budget or n, n)
            cache = None
            if any(s.startswith("kt-") for s in names):
                cache = str(ktr.write_cache(rec.replay, rec.space, Path(tmp) / f"{len(recs)}-{rec.name}.json"))
            for name in names:
                for batch in (batches if name in OURS else (1,)):
                    for seed in range(1 if name in DETERMINISTIC else seeds):
                        tasks.append(Task(str(path), keep_seeds, name, seed, runs, cache if name.startswith("kt-") else None,
                                          batch, stop_within))
        traces: dict[tuple[str, str], list[list[float | None]]] = {}
        seconds: dict[tuple[str, str], float] = {}
        labels: list[str] = []
        for task, trace, took in _map(tasks, workers, progress):
            traces.setdefault((task.recording, task.label), []).append(trace)
            seconds[(task.recording, task.label)] = seconds.get((task.recording, task.label), 0.0) + took
        for task in tasks:
            if task.label not in labels:
                labels.append(task.label)

    for path, rec in recs.items():
        n = len(rec.valid)
        runs = min(budget or n, n)
        random_curve = random_expected_best(rec, runs)
        entry: dict[str, Any] = {
            "path": path, "space": rec.space.name, "gpu": rec.replay.header.get("gpu"), "valid": n,
            "ok": int(len(rec.ok_values)), "optimum_us": rec.optimum, "budget": runs,
            "within": {f"{f:.0%}": rec.within(f) for f in THRESHOLDS},
            "random_expected": {f"{f:.0%}": random_expected_evaluations(n, rec.within(f)) for f in THRESHOLDS},
            "score_range": list(score_range(rec)),
            "random_curve": random_curve.tolist(),
            "strategies": {},
        }
        for name in labels:
            if (path, name) not in traces:
                continue
            stats = summarise(rec, traces[(path, name)], runs, random_curve)
            stats["cpu_s"] = round(seconds[(path, name)], 2)
            entry["strategies"][name] = stats
        entry["verdict"] = verdict(entry)
        results["recordings"][rec.name] = entry
    scores: dict[str, list[float]] = {}
    for entry in results["recordings"].values():
        for name, stats in entry["strategies"].items():
            scores.setdefault(name, []).append(stats["score"])
    results["score"] = {name: float(np.mean(v)) for name, v in scores.items()}
    return results


def _map(tasks: list[Task], workers: int, progress: Callable[[str], None] | None) -> Iterable[tuple[Task, list, float]]:
    done, total, started = 0, len(tasks), time.perf_counter()

    def tick() -> None:
        if progress and (done % 50 == 0 or done == total):
            progress(f"{done}/{total} runs, {time.perf_counter() - started:.0f} s")

    if workers <= 1:
        for task in tasks:
            yield run_task(task)
            done += 1
            tick()
        return
    ctx = multiprocessing.get_context("fork")
    # slow strategies first, so the pool does not end waiting on one of them
    order = sorted(tasks, key=lambda t: t.strategy not in {"kt-bayes_opt", "optuna-gp", "optuna-tpe", "tpe"})
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for item in pool.map(run_task, order, chunksize=4):
            yield item
            done += 1
            tick()


def verdict(entry: dict[str, Any]) -> dict[str, Any]:
    """The target: the default strategy within 2% in <= 0.5x random's evaluations and in fewer
    than Kernel Tuner's best strategy (lowest median to 2%)."""
    strategies = entry["strategies"]
    key = "2%"
    out: dict[str, Any] = {"default": DEFAULT_STRATEGY}
    if DEFAULT_STRATEGY not in strategies:
        return out
    ours = strategies[DEFAULT_STRATEGY]["reach"][key]["median"]
    out["default_median"] = ours
    if "random" in strategies:
        rnd = strategies["random"]["reach"][key]["median"]
        out.update(random_median=rnd, ratio_to_random=ours / rnd if rnd else math.nan, beats_half_random=ours <= 0.5 * rnd)
    kt = {n: s["reach"][key]["median"] for n, s in strategies.items() if n.startswith("kt-")}
    if kt:
        best = min(kt, key=lambda n: (kt[n], -strategies[n]["score"]))
        out.update(kt_best=best, kt_best_median=kt[best], beats_kt_best=ours < kt[best])
    overall = min(strategies, key=lambda n: (strategies[n]["reach"][key]["median"], -strategies[n]["score"]))
    out["fastest_to_2%"] = overall
    out["best_score"] = max(strategies, key=lambda n: strategies[n]["score"])
    return out


# -- output --------------------------------------------------------------------------------


def _num(x: float) -> str:
    """An evaluation count as the table shows it: rounded, ``inf`` for never."""
    return "inf" if math.isinf(x) else f"{x:.0f}"


def table(results: dict[str, Any]) -> str:
    """The 80-column report."""
    lines = []
    for name, entry in results["recordings"].items():
        budget = entry["budget"]
        within = entry["within"]
        lines.append(f"{name}: {entry['space']} on {entry['gpu'] or '?'}")
        lines.append(f"  {entry['valid']} valid, {entry['ok']} ok, optimum {entry['optimum_us']:.2f} us; within 1/2/5%: "
                     f"{within['1%']}/{within['2%']}/{within['5%']}; budget {budget}; {results['seeds']} seeds")
        lines.append(f"  {'':22}{'evaluations to within 1%, 2%, 5% of the optimum':^48}")
        lines.append(f"  {'strategy':<22}" + "".join(f"{h:^16}" for h in ("1%", "2%", "5%")) + f"{'score':>7}")
        lines.append(f"  {'':<22}" + "".join(f"{'med':>4} {'q1-q3':<8}{'':3}" for _ in range(3)))
        rnd = entry["random_expected"]
        lines.append(f"  {'random, calculated':<22}" + "".join(f"{_num(rnd[k]):>4}{'':12}" for k in ("1%", "2%", "5%"))
                     + f"{0.0:>7.2f}")
        for sname, stats in entry["strategies"].items():
            label = sname + (" *" if sname == results["default"] else "")
            cells = ""
            for k in ("1%", "2%", "5%"):
                r = stats["reach"][k]
                iqr = f"{_num(r['q1'])}-{_num(r['q3'])}"
                miss = f"+{r['missed']}" if r["missed"] else ""
                cells += f"{_num(r['median']):>4} {iqr:<8}{miss:>3}"
            lines.append(f"  {label[:22]:<22}{cells}{stats['score']:>7.2f}")
        v = entry["verdict"]
        if "default_median" in v:
            text = f"  target ({v['default']}, to 2%): {_num(v['default_median'])} evaluations"
            if "random_median" in v:
                text += (f" = {v['ratio_to_random']:.2f}x random's {_num(v['random_median'])}"
                         f" ({'met' if v['beats_half_random'] else 'MISSED'}: <= 0.5x)")
            lines.append(text)
            if "kt_best" in v:
                lines.append(f"    Kernel Tuner's best to 2%: {v['kt_best']} {_num(v['kt_best_median'])} "
                             f"({'beaten' if v['beats_kt_best'] else 'NOT beaten'})")
            lines.append(f"    fastest to 2%: {v['fastest_to_2%']}; best score: {v['best_score']}")
        lines.append("")
    if len(results["recordings"]) > 1:
        lines.append("score over all recordings (Willemsen et al. 2024; 0 random, 1 optimum):")
        ranked = sorted(results["score"].items(), key=lambda kv: -kv[1])
        for i in range(0, len(ranked), 2):
            lines.append("  " + "".join(f"{n[:26]:<26}{s:>7.2f}    " for n, s in ranked[i:i + 2]).rstrip())
    for note in results["notes"]:
        lines.append(f"note: {note}")
    lines.append("* the default strategy; +n: runs that never got there within the budget (inf)")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path, top_kt: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(results["recordings"].items())
    fig, axes = plt.subplots(1, len(entries), figsize=(7 * len(entries), 5), squeeze=False)
    for ax, (name, entry) in zip(axes[0], entries):
        opt = entry["optimum_us"]
        strategies = entry["strategies"]
        kt = sorted((n for n in strategies if n.startswith("kt-")), key=lambda n: -strategies[n]["score"])[:top_kt]
        shown = [n for n in strategies if not n.startswith("kt-")] + kt
        x = np.arange(1, entry["budget"] + 1)

        def gap(values: Sequence[float]) -> np.ndarray:  # percent above the optimum
            return 100.0 * (np.asarray(values) / opt - 1.0)

        ax.plot(x, gap(entry["random_curve"]), color="black", ls=":", label="random, calculated")
        for n in shown:
            c = strategies[n]["curve"]
            default = n == results["default"]
            (line,) = ax.plot(x, gap(c["median"]), label=n + (" (default)" if default else ""), lw=2.4 if default else 1.1,
                              zorder=3 if default else 2)
            ax.fill_between(x, gap(c["q1"]), gap(c["q3"]), color=line.get_color(), alpha=0.10)
        for f in THRESHOLDS:
            ax.axhline(100 * f, color="grey", lw=0.5, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("evaluations (distinct valid configurations)")
        ax.set_ylabel("best so far, % above the optimum (median, IQR)")
        ax.set_title(f"{name} ({entry['valid']} configs, {results['seeds']} seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recording", action="append", type=Path,
                        help="recording to replay (repeatable; default: tests/data/replay_*.jsonl, recordings/* and benchmarks/recordings/*)")
    parser.add_argument("--strategies", help="comma-separated (default: ours, Optuna's, Kernel Tuner's)")
    parser.add_argument("--seeds", type=int, default=25, help="runs per strategy (default 25)")
    parser.add_argument("--budget", type=int, help="evaluations per run (default: the recording's valid size)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    parser.add_argument("--keep-seeds", action="store_true", help="let evo start from the space's seed configurations")
    parser.add_argument("--stop-within", type=float, default=0.0, metavar="F",
                        help="end a run of ours or Optuna's once within F of the optimum (e.g. 0.01; default 0: at the "
                             "optimum); the counts to 1/2/5%% stay exact for F <= 0.01, the curves stay flat after")
    parser.add_argument("--batch", default="1",
                        help="comma-separated batch sizes our strategies propose in (default 1; e.g. 1,4,8,16: a row each)")
    parser.add_argument("--plot", type=Path, help="write the best-so-far curves to this PNG")
    parser.add_argument("--json", type=Path, help="write every statistic to this JSON file")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        recordings = args.recording or default_recordings()
        if not recordings:
            raise UsageError("no recordings found; give --recording FILE")
        for path in recordings:
            if not path.exists():
                raise UsageError(f"--recording: {path} does not exist")
        if args.seeds < 1 or (args.budget is not None and args.budget < 1):
            raise UsageError("--seeds and --budget must be at least 1")
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies else None
        try:
            batches = [int(b) for b in args.batch.split(",") if b.strip()]
        except ValueError:
            raise UsageError(f"--batch: expected comma-separated integers, got {args.batch!r}") from None
        if not batches or min(batches) < 1:
            raise UsageError(f"--batch: batch sizes must be at least 1, got {args.batch!r}")
        try:
            results = benchmark(recordings, strategies, args.seeds, args.budget, args.workers, args.keep_seeds,
                                progress=None if args.quiet else lambda m: print(m, file=sys.stderr, flush=True),
                                batches=batches, stop_within=args.stop_within)
        except (ValueError, KeyError) as exc:
            raise UsageError(str(exc)) from None
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results))
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
