"""The search loop: ask, compile ahead, evaluate, tell, record; budget, resume, finalists.

Only this module knows the order of the stages. Strategies are Optuna samplers over
the study; the evaluator is anything with ``evaluate(config, report) -> EvalResult``
(the GPU ``Evaluator`` or a replay of recorded results).
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import secrets
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Protocol

import optuna
import sqlalchemy.exc

from ..gpu import STATUSES, EvalResult
from ..kernels import StaticReport, build_config_job
from ..space import Config, Space
from .strategies import make_sampler, suggest_config

RESULTS = "results.jsonl"
RUN_META = "run.json"


class CandidateEvaluator(Protocol):
    def evaluate(self, config: Config, report: StaticReport | None = None) -> EvalResult: ...


@dataclass
class RunDir:
    """``runs/<date>-<space>-<id>/``: everything a search leaves behind."""

    path: Path

    @classmethod
    def create(cls, root: Path, space: Space) -> "RunDir":
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = root / f"{stamp}-{space.name}-{secrets.token_hex(3)}"
        (path / "sources").mkdir(parents=True)
        shutil.copyfile(space.path, path / "space.yaml")
        return cls(path)

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS

    def default_storage(self) -> str:
        return f"sqlite:///{(self.path / 'study.db').resolve()}"

    def meta(self) -> dict:
        return json.loads((self.path / RUN_META).read_text())

    def write_meta(self, meta: dict) -> None:
        tmp = self.path / (RUN_META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(self.path / RUN_META)

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path / name)

    def append_result(self, result: EvalResult) -> None:
        with self.results_path.open("ab+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line cut by a kill stays alone on its line
                    fh.write(b"\n")
            fh.write((json.dumps(result.to_json()) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())

    def results(self) -> list[dict]:
        if not self.results_path.exists():
            return []
        out = []
        for line in self.results_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
        return out

    def save_sources(self, report: StaticReport) -> None:
        for build in report.builds:
            if build.rendered is not None:
                (self.path / "sources" / f"{report.config.key()}-{build.variant.label()}.cu").write_text(build.rendered.source)


PHASES = ("strategy", "compile", "load", "gate", "timing", "ipc", "storage")
"""Where an evaluation's time goes: asking the strategy, waiting for its ahead-compiled
build, loading the module in the worker, the gate, the timing, the worker round trips'
remainder, and telling the study plus writing the record."""


@dataclass
class SearchStats:
    started: float = field(default_factory=time.perf_counter)
    evaluated: int = 0
    gpu_busy_s: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STATUSES})
    best: EvalResult | None = None
    phases: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def add(self, result: EvalResult) -> None:
        self.evaluated += 1
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        self.gpu_busy_s += result.eval_s
        if result.ok and (self.best is None or result.objective_us < self.best.objective_us):
            self.best = result

    def add_phases(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def profile(self) -> dict[str, dict[str, float]]:
        """Per phase: total seconds, mean milliseconds per evaluation, share of the wall time."""
        wall, n = self.elapsed_s, max(1, self.evaluated)
        return {name: {"total_s": round(total, 3), "mean_ms": round(1000 * total / n, 2),
                       "share": round(total / wall, 4) if wall else 0.0}
                for name, total in self.phases.items()}

    def summary(self) -> dict:
        minutes = self.elapsed_s / 60
        return {
            "evaluated": self.evaluated,
            "elapsed_s": round(self.elapsed_s, 1),
            "evaluations_per_minute": round(self.evaluated / minutes, 2) if minutes else None,
            "gpu_busy_share": round(self.gpu_busy_s / self.elapsed_s, 3) if self.elapsed_s else None,
            "counts": self.counts,
            "best": self.best.to_json() if self.best else None,
            "phases": self.profile(),
        }


def tell(study: optuna.Study, trial: optuna.Trial, result: EvalResult) -> None:
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("config_key", result.key)
    trial.set_user_attr("reason", result.reason[:500])
    if result.ok:
        study.tell(trial, result.objective_us)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def open_study(space: Space, run: RunDir, *, strategy: str, seed: int | None, storage: str | None,
               study_name: str | None, resume: bool) -> optuna.Study:
    sampler = make_sampler(strategy, space, seed=seed)
    storage = storage or run.default_storage()
    name = study_name or run.path.name
    for attempt in range(6):
        try:
            return optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                       load_if_exists=resume)
        except sqlalchemy.exc.SQLAlchemyError:  # workers that start together race to create the storage's tables
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def recover_interrupted(study: optuna.Study, run: RunDir, space: Space) -> int:
    """Trials left RUNNING by a killed search: tell those whose result was recorded, and
    fail-and-requeue the others so their configuration is evaluated exactly once."""
    recorded = {r["key"]: r for r in run.results()}
    recovered = 0
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if frozen.user_attrs.get("run", run.path.name) != run.path.name:
            continue  # another search sharing the study is evaluating it
        config = Config({k: frozen.params[k] for k in space.param_names if k in frozen.params})
        trial = optuna.Trial(study, frozen._trial_id)
        record = recorded.get(config.key()) if len(config) == len(space.param_names) else None
        if record:
            tell(study, trial, EvalResult(**{k: record[k] for k in EvalResult.__dataclass_fields__ if k in record}))
        else:
            trial.set_user_attr("status", "interrupted")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            if len(config) == len(space.param_names):
                study.enqueue_trial(config.to_dict(), skip_if_exists=False)
        recovered += 1
    return recovered


_COUNTED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING)


def counted_trials(study: optuna.Study) -> int:
    """Evaluations that count against the budget: done or under way in any worker sharing
    the study (interrupted ones and skipped duplicates do not)."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=_COUNTED) if t.user_attrs.get("status") != "interrupted")


def run_search(
    space: Space,
    evaluator: CandidateEvaluator,
    run: RunDir,
    study: optuna.Study,
    *,
    arch: str,
    trials: int,
    time_s: float | None = None,
    prefetch: int | None = None,
    on_result: Callable[[EvalResult, SearchStats], None] | None = None,
    compile_workers: int | None = None,
    build: bool = True,
) -> SearchStats:
    """Evaluate until ``trials`` evaluations are recorded in the study (or time runs out).

    The next ``prefetch`` candidates compile in parallel processes while the current one
    is on the GPU. A configuration already recorded (same hash) is never timed again.
    """
    stats = SearchStats()
    prefetch = prefetch or max(2, os.cpu_count() or 2)
    valid_total = space.valid_size()
    seen = {t.user_attrs.get("config_key") for t in study.get_trials(deepcopy=False)
            if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) and t.user_attrs.get("status") != "interrupted"}
    pending: deque[tuple[optuna.Trial, Config, Future | None, float]] = deque()
    budget = min(trials, valid_total)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=compile_workers or max(1, (os.cpu_count() or 2) - 1), mp_context=ctx) as pool:
        while True:
            out_of_time = time_s is not None and stats.elapsed_s >= time_s
            while not out_of_time and len(pending) < prefetch and counted_trials(study) < budget:
                asked = time.perf_counter()
                trial = study.ask()
                trial.set_user_attr("run", run.path.name)
                config = suggest_config(trial, space)
                if config.key() in seen:  # every valid configuration is taken; record the repeat, never re-time it
                    trial.set_user_attr("status", "duplicate")
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    continue
                seen.add(config.key())
                job = (space.template, config, space.variants, arch, space.target.smem_per_block)
                pending.append((trial, config, pool.submit(build_config_job, job) if build else None,
                                time.perf_counter() - asked))
            if not pending:
                break
            trial, config, future, strategy_s = pending.popleft()
            waited = time.perf_counter()
            report = future.result() if future is not None else None
            compile_s = time.perf_counter() - waited
            result = evaluator.evaluate(config, report)
            stored = time.perf_counter()
            if report is not None:
                run.save_sources(report)
            result.phases = {**result.phases, "strategy": round(strategy_s, 4), "compile": round(compile_s, 4),
                             "storage": round(time.perf_counter() - stored, 4)}
            run.append_result(result)
            tell(study, trial, result)
            stats.add(result)
            stats.add_phases({**result.phases, "storage": time.perf_counter() - stored})
            if on_result:
                on_result(result, stats)
    return stats


def best_results(run: RunDir, top_k: int) -> list[dict]:
    """The ``top_k`` fastest ok records of a run, one per configuration."""
    best: dict[str, dict] = {}
    for r in run.results():
        if r["status"] == "ok" and (r["key"] not in best or r["objective_us"] < best[r["key"]]["objective_us"]):
            best[r["key"]] = r
    return sorted(best.values(), key=lambda r: r["objective_us"])[:top_k]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan
