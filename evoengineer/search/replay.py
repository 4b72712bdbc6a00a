"""Replay recorded evaluations instead of running kernels: strategy tests and benchmarks.

A recording is JSONL, one result per line::

    {"config": {...}, "key": "...", "status": "ok", "reason": "", "objective_us": 41.2}

with an optional first line ``{"header": {"space": "l4", "gpu": ...}}`` naming a built-in
space, or ``{"header": {"space_inline": {...}}}`` carrying the space itself; a header's
``gpu`` and ``sdpa_fastest_us`` (per case, the fastest SDPA backend and its time) are what a
replayed run reports as its GPU and its SDPA baseline. A record's ``cases`` (case label ->
median µs, or a run's list of case records) are its per-case times; a path ending in ``.gz``
is read through gzip.
"""
from __future__ import annotations

import gzip
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import optuna
from optuna.trial import TrialState

from ..gpu import EvalResult
from ..kernels import StaticReport
from ..space import Config, Space, load_space, parse_space

NOT_RECORDED = "not in the recording"


@dataclass(frozen=True)
class ReplayResult:
    """The recorded outcome of one configuration."""

    status: str
    reason: str = ""
    objective_us: float | None = None
    cases: dict[str, float] = field(default_factory=dict, compare=False)
    """Case label -> median µs, where the recording has them."""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.objective_us is not None


class ReplayEvaluator:
    """Looks configurations up in a recording of real (or synthetic) evaluations."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header: dict[str, Any] = {}
        self.records: dict[Config, ReplayResult] = {}
        opener = gzip.open if self.path.suffix == ".gz" else open
        with opener(self.path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.path}:{lineno}: not JSON: {exc.msg}") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{self.path}:{lineno}: expected an object")
                if "header" in obj:
                    if self.records or self.header:
                        raise ValueError(f"{self.path}:{lineno}: a header may only be the first line")
                    self.header = dict(obj["header"] or {})
                    continue
                self.records[Config(obj["config"])] = _result(obj, f"{self.path}:{lineno}")

    def __len__(self) -> int:
        return len(self.records)

    @property
    def space_name(self) -> str | None:
        """The space the recording covers, as its header names it."""
        if "space" in self.header:
            return str(self.header["space"])
        inline = self.header.get("space_inline")
        if isinstance(inline, Mapping):
            return str(inline.get("name", self.path.stem))
        return None

    def space(self) -> Space:
        """The recording's space: the inline one from the header, or the built-in it names. A
        recorded space (``problem.kind: recorded``) is narrowed to the recording's configurations."""
        inline = self.header.get("space_inline")
        if isinstance(inline, Mapping):
            return self.narrow(parse_space(dict(inline), f"{self.path.name}#header"))
        if "space" in self.header:
            return self.narrow(load_space(str(self.header["space"])))
        raise ValueError(f"{self.path}: no header naming a space")

    def narrow(self, space: Space) -> Space:
        """A recorded space's valid configurations are those of this recording; others unchanged."""
        return space.with_domain(self.records) if space.recorded else space

    def evaluate(self, config: Mapping[str, Any]) -> ReplayResult:
        return self.records.get(Config(config), ReplayResult("invalid", NOT_RECORDED, None))

    @property
    def gpu(self) -> str | None:
        """The GPU the recording was made on, as its header names it."""
        gpu = self.header.get("gpu") or (self.header.get("env") or {}).get("gpu")
        return str(gpu) if gpu else None

    def case_labels(self) -> list[str]:
        """The cases the recording has per-case times for (empty: none)."""
        labels: dict[str, None] = {}
        for result in self.records.values():
            labels.update(dict.fromkeys(result.cases))
        return list(labels)

    def baseline(self) -> dict[str, dict[str, dict]]:
        """The header's fastest SDPA backend per case, as a run's ``baseline.json`` holds it
        (label -> backend -> row); empty when the header has none."""
        out: dict[str, dict[str, dict]] = {}
        for label, row in (self.header.get("sdpa_fastest_us") or {}).items():
            if isinstance(row, Mapping) and row.get("backend") and _finite(row.get("us")):
                out[str(label)] = {str(row["backend"]): {"status": "ok", "time": {"median_us": float(row["us"])}}}
        return out

    def mismatch(self, space: Space, sample: int = 200) -> str | None:
        """Why the recording cannot answer for ``space`` (one line), or None when it can: other
        parameters, cases it has no times for, or none of the space's first ``sample`` valid
        configurations recorded."""
        made_on = f" (recorded on space {self.space_name})" if self.space_name else ""
        first = next(iter(self.records), None)
        if first is None:
            return f"{self.path.name} holds no evaluations"
        recorded = set(first)
        own = space.path_space(first.to_dict().get("PATH")) if space.paths else None
        wanted = {"PATH", *own.param_names} if own is not None else set(space.param_names)  # a path's own
        if recorded != wanted:
            extra, lacking = sorted(wanted - recorded), sorted(recorded - wanted)
            detail = (f"space {space.name} has parameter(s) {', '.join(extra)} that it does not record" if extra else
                      f"it records parameter(s) {', '.join(lacking)} that space {space.name} does not have")
            return f"{self.path.name}{made_on} does not match space {space.name}: {detail}"
        labels = self.case_labels()
        if labels:
            missing = [c.label() for c in space.cases if c.label() not in labels]
            if missing:
                return (f"{self.path.name}{made_on} has no times for case {missing[0]!r} of space {space.name}; "
                        f"it timed {', '.join(labels)}")
        head = list(itertools.islice(space.valid_configs(), sample))
        if head and not any(c in self.records for c in head):
            return (f"{self.path.name}{made_on} records none of the first {len(head)} valid configurations of "
                    f"space {space.name}, e.g. {head[0].label()}")
        return None

    def optimum(self) -> tuple[Config, float]:
        """The best ``ok`` record (lowest objective)."""
        ok = [(r.objective_us, c) for c, r in self.records.items() if r.ok]
        if not ok:
            raise ValueError(f"{self.path}: no ok record")
        value, config = min(ok, key=lambda item: (item[0], item[1].key()))
        return config, float(value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _result(obj: Mapping[str, Any], where: str) -> ReplayResult:
    status = str(obj.get("status", ""))
    value = obj.get("objective_us")
    if value is not None:
        value = float(value)
        if not math.isfinite(value):
            value = None
    if status == "ok" and value is None:
        raise ValueError(f"{where}: an ok record needs a finite objective_us")
    return ReplayResult(status, str(obj.get("reason") or ""), value, _case_times(obj.get("cases")) if status == "ok" else {})


def _case_times(cases: Any) -> dict[str, float]:
    """Case label -> median µs from a recording's ``{label: µs}`` or a run's case records."""
    if isinstance(cases, Mapping):
        return {str(label): float(us) for label, us in cases.items() if _finite(us)}
    out: dict[str, float] = {}
    for case in cases if isinstance(cases, list) else ():
        median = (case.get("time") or {}).get("median_us") if isinstance(case, Mapping) else None
        if _finite(median):
            out[str(case.get("label"))] = float(median)
    return out


class ReplayCandidates:
    """Answers from a recording instead of a GPU (tests, demos, strategy comparisons)."""

    def __init__(self, path: Path, delay_s: float = 0.0, device: int | None = None,
                 replay: ReplayEvaluator | None = None, labels: Sequence[str] | None = None) -> None:
        self.replay = replay or ReplayEvaluator(path)
        self.delay_s = delay_s
        self.device = device
        self.labels = list(labels) if labels is not None else None
        """The cases a result reports (the space's); None: every recorded one."""

    def on_devices(self, devices: Sequence[int]) -> list["ReplayCandidates"]:
        """One evaluator per simulated device, sharing this recording (evaluated in parallel,
        one lane each, like GPUs)."""
        return [ReplayCandidates(self.replay.path, self.delay_s, device=d, replay=self.replay, labels=self.labels)
                for d in devices]

    def evaluate(self, config: Config, report: StaticReport | None = None) -> EvalResult:
        """The recorded result after ``delay_s`` (standing for the GPU's time, counted as
        ``timing``), with the recorded per-case times of the space's cases; where those are a
        subset of the recorded ones, the objective is their geometric mean."""
        started = time.perf_counter()
        time.sleep(self.delay_s)
        answer = self.replay.evaluate(config)
        objective, cases = answer.objective_us, []
        if answer.ok and answer.cases:
            labels = self.labels if self.labels is not None else list(answer.cases)
            if all(label in answer.cases for label in labels) and labels:
                cases = [{"label": label, "status": "ok", "time": {"median_us": answer.cases[label]}} for label in labels]
                if set(labels) != set(answer.cases):
                    objective = math.exp(sum(math.log(answer.cases[label]) for label in labels) / len(labels))
        spent = time.perf_counter() - started
        return EvalResult(config=config.to_dict(), key=config.key(), status=answer.status, reason=answer.reason,
                          cases=cases, objective_us=objective, eval_s=round(spent, 3), phases={"timing": round(spent, 4)})



def run_replay(
    space: Space,
    sampler: optuna.samplers.BaseSampler,
    evaluator: ReplayEvaluator,
    n_trials: int,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
) -> optuna.Study:
    """Drive a study for ``n_trials`` with the search loop's ask/tell protocol, replaying results."""

    study = optuna.create_study(
        storage=storage, sampler=sampler, study_name=study_name, direction="minimize", load_if_exists=True
    )
    for _ in range(n_trials):
        replay_trial(study, space, evaluator)
    return study


def replay_trial(study: optuna.Study, space: Space, evaluator: ReplayEvaluator) -> tuple[Config, ReplayResult]:
    """One ask/suggest/evaluate/tell round on ``study``."""
    from .strategies import suggest_config

    trial = study.ask()
    config = suggest_config(trial, space)
    result = evaluator.evaluate(config)
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("config_key", config.key())
    if result.ok:
        study.tell(trial, result.objective_us)
    else:
        study.tell(trial, state=TrialState.FAIL)
    return config, result


def evaluations_to_reach(study: optuna.Study, threshold: float) -> int | None:
    """1-based count of trials until the first completed one with value <= ``threshold``."""
    for i, t in enumerate(sorted(study.get_trials(deepcopy=False), key=lambda t: t.number), 1):
        if t.state == TrialState.COMPLETE and t.value is not None and t.value <= threshold:
            return i
    return None
