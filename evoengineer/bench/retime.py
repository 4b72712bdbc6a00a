"""Candidates re-timed interleaved with SDPA's backends (and peers), in rounds, through the
search's own evaluator: the finalists of a search (``retime``) and the per-shape winners of a
comparison (``interleaved_times``) alike."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..gpu import Evaluator
from ..kernels import StaticReport
from ..space import Case
from .protocol import Summary, round_order

REFERENCES = ""
"""The step of a round that times the references (every one of them in one worker job)."""


def interleaved_times(evaluator: Evaluator, cases: Sequence[Case],
                      candidates: Mapping[str, Mapping[str, tuple[Evaluator, StaticReport]]],
                      references: Sequence[str], rounds: int, timing: dict) -> tuple[dict[str, dict[str, list[dict]]], dict[str, str]]:
    """Per round, per case: the references (``evaluator.time_references``) and the case's
    candidates (label -> name -> (evaluator, report)), the references first in even rounds and
    last in odd ones (``round_order``), each with ``timing``.

    Returns (label -> name -> one {"us", "tflops"} per round, name -> reason of a candidate whose
    timing failed; it is not timed again)."""
    samples: dict[str, dict[str, list[dict]]] = {}
    failures: dict[str, str] = {}
    for r in range(rounds):
        for case in cases:
            label = case.label()
            got = samples.setdefault(label, {})
            steps = [REFERENCES, *candidates.get(label, {})] if references else list(candidates.get(label, {}))
            for name in round_order(steps, r):
                if name in failures:
                    continue
                if name == REFERENCES:
                    answers = evaluator.time_references(case, references, timing)
                else:
                    ev, report = candidates[label][name]
                    answer = ev.time_case(report, case, timing)
                    if answer.get("status") != "ok":
                        failures[name] = answer.get("reason") or answer.get("status", "failed")
                        continue
                    answers = {name: answer}
                for who, answer in answers.items():
                    if answer.get("status") == "ok":
                        got.setdefault(who, []).append({"us": answer["time"]["median_us"], "tflops": answer.get("tflops")})
    return samples, failures


def retime(evaluator: Evaluator, reports: Sequence[StaticReport], rounds: int = 3, repetitions: int | None = None,
           backends: Sequence[str] | None = None) -> dict[str, Any]:
    """Re-time finalists interleaved with each other and with SDPA's backends, ``rounds``
    rounds (``interleaved_times``), with more repetitions and every one of them taken (no early
    stop); per case the median of the rounds' medians.

    Returns ``{"candidates": {key: {label: summary}}, "failures": {key: reason},
    "sdpa": {label: {backend: summary}}}``, a summary being ``Summary.to_json()``. ``backends``:
    the evaluator's (``Evaluator.default_backends``) when None.
    """
    backends = evaluator.default_backends() if backends is None else backends
    timing = {**evaluator.timing, "repetitions": repetitions or evaluator.timing["repetitions"] * 2, "precision": 0.0}
    keys = {report.config.key(): (evaluator, report) for report in reports}
    cases = list(evaluator.space.cases)
    samples, failures = interleaved_times(evaluator, cases, {c.label(): keys for c in cases}, tuple(backends), rounds, timing)

    def summary(values: list[dict]) -> dict:
        return Summary.of([v["us"] for v in values]).to_json()

    return {
        "candidates": {key: {label: summary(per[key]) for label, per in samples.items() if per.get(key)}
                       for key in keys if key not in failures},
        "failures": failures,
        "sdpa": {label: {b: summary(per[b]) for b in backends if per.get(b)}
                 for label, per in samples.items() if any(per.get(b) for b in backends)},
    }
