"""evoengineer.bench's protocol on fake timers (no GPU): the order of interleaved rounds, paired
ratios against a drifting clock, verdicts within noise, tables at 80 columns, the re-timing of
finalists through an evaluator that answers from a table of times."""
from __future__ import annotations

import math

import pytest

from evoengineer.bench import (
    Summary,
    TextColumn,
    attention_set_bytes,
    cold_set_count,
    geomean,
    half_range,
    interleaved_times,
    paired_ratio,
    paired_verdict,
    ratio_verdict,
    relation,
    retime,
    round_order,
    run_rounds,
    schedule,
    text_table,
)
from evoengineer.space import Case, Config


class DriftingClock:
    """A fake timer: a name's time is its true time times the GPU's clock factor, which holds
    within a round and changes between rounds (``factors``); every call is recorded."""

    def __init__(self, true_us: dict[str, float], factors: list[float], per_round: int) -> None:
        self.true_us, self.factors, self.per_round = true_us, factors, per_round
        self.calls: list[str] = []

    def __call__(self, name: str) -> float | None:
        factor = self.factors[len(self.calls) // self.per_round]
        self.calls.append(name)
        return None if self.true_us[name] is None else self.true_us[name] * factor


def test_rounds_reverse_their_order_every_other_round() -> None:
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert schedule(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert schedule([], 2) == []


def test_paired_ratios_survive_a_clock_that_drifts_between_rounds() -> None:
    """B is 0.9 of A. The clock runs at 1.0, 1.5, then 1.0 (a slow round): paired per round the
    ratio is 0.9 exactly; the ratio of each side's median would read 0.9 only by luck, and a
    side measured in the slow round alone would look 50 % slower."""
    clock = DriftingClock({"A": 10.0, "B": 9.0}, [1.0, 1.5, 1.0], per_round=2)
    figures = run_rounds(["A", "B"], 3, clock)
    assert clock.calls == ["A", "B", "B", "A", "A", "B"]
    assert figures == {"A": [10.0, 15.0, 10.0], "B": [9.0, 13.5, 9.0]}
    assert paired_ratio(figures["B"], figures["A"]) == pytest.approx(0.9)
    # unpaired, a skewed pairing (B's slow round against A's fast one) is what medians of lists hide
    assert paired_ratio([13.5, 9.0, 9.0], [10.0, 15.0, 10.0]) == pytest.approx(0.9)
    assert paired_ratio([13.5, 13.5, 9.0], [10.0, 10.0, 15.0]) == pytest.approx(1.35)


def test_a_failed_measurement_is_not_repeated() -> None:
    clock = DriftingClock({"A": 10.0, "B": None}, [1.0] * 3, per_round=2)
    figures = run_rounds(["A", "B"], 3, clock)
    assert clock.calls == ["A", "B", "A", "A"] and figures == {"A": [10.0, 10.0, 10.0], "B": []}
    assert math.isnan(paired_ratio([], [1.0]))


def test_summaries_and_spreads() -> None:
    assert Summary.of([3.0, 1.0, 2.0]).to_json() == {"median_us": 2.0, "min_us": 1.0, "max_us": 3.0, "rounds": 3}
    assert half_range([10.0, 12.0, 11.0]) == 1.0 and half_range([]) == 0.0
    assert geomean([1.0, 4.0]) == pytest.approx(2.0) and math.isnan(geomean([]))


def test_verdicts_take_the_rounds_noise_into_account() -> None:
    # 1.004 with rounds that spread by ±1.5 %: equal to 1, so "ratio <= 1 within noise" holds
    noisy = ratio_verdict([0.99, 1.004, 1.02])
    assert noisy.relation == "equal" and noisy.at_most and noisy.at_least
    assert noisy.noise == pytest.approx(0.015) and (noisy.low, noisy.high, noisy.rounds) == (0.99, 1.02, 3)
    # 1.03 whose rounds agree to 0.2 %: the floor (1 %) is the noise, and it is higher
    steady = ratio_verdict([1.029, 1.03, 1.031])
    assert steady.relation == "higher" and not steady.at_most and steady.noise == pytest.approx(0.01)
    assert ratio_verdict([0.95, 0.96]).relation == "lower"
    assert ratio_verdict([1.004], floor=0.0).relation == "higher"     # one round, no floor: no noise at all
    # against another target, and from paired lists
    assert paired_verdict([9.0, 9.1], [10.0, 10.0], target=0.9).relation == "equal"
    assert paired_verdict([9.0, 9.1], [10.0, 10.0]).relation == "lower"
    empty = ratio_verdict([])
    assert empty.rounds == 0 and math.isnan(empty.ratio)
    assert [relation(d, 0.5) for d in (-1.0, -0.5, 0.0, 0.5, 0.6)] == ["lower", "equal", "equal", "equal", "higher"]


def test_tables_fit_80_columns_by_cutting_labels_only() -> None:
    columns = [TextColumn("case", left=True), TextColumn("A µs"), TextColumn("B µs"), TextColumn("verdict", left=True)]
    rows = [["B4 H16 S2048 D128 causal fp16 " + "x" * 60, "1234.5", "99.0", "same"], ["B1 H8 S512 D64", "1.0", "2.0", "B faster"]]
    lines = text_table(columns, rows)
    assert max(len(line) for line in lines) == 80
    assert lines[1].split()[-3:] == ["1234.5", "99.0", "same"]               # the figures whole
    assert "…" in lines[1] and lines[2].startswith("B1 H8 S512 D64 ")
    assert lines[0].split() == ["case", "A", "µs", "B", "µs", "verdict"]
    short = text_table(columns, [["a", "1.0", "2.0", "same"]])
    assert short == ["case A µs B µs verdict", "a     1.0  2.0 same"]
    with pytest.raises(ValueError, match="3 cells for 4 columns"):
        text_table(columns, [["a", "1", "2"]])


def test_l2_rotation_outgrows_twice_the_l2() -> None:
    one = attention_set_bytes(4, 16, 16, 2048, 2048, 128)               # q, out, k, v: 4 x 32 MiB
    assert one == 4 * 2 * 4 * 16 * 2048 * 128
    assert cold_set_count(one, l2_bytes=50 * 2**20) == 1                 # 128 MiB > 2 x 50 MiB
    small = attention_set_bytes(1, 8, 8, 512, 512, 64)                   # 2 MiB
    assert cold_set_count(small, l2_bytes=50 * 2**20) == 50
    assert cold_set_count(one, at_least=2, l2_bytes=50 * 2**20) == 2
    assert attention_set_bytes(8, 32, 8, 1, 4096, 128) == 2 * 2 * 8 * 128 * (32 * 1 + 8 * 4096)


class TableEvaluator:
    """Answers ``time_case`` and ``time_references`` from ``times[name]`` (one figure per call, in
    call order) and records the calls; a name whose next figure is None fails."""

    def __init__(self, times: dict[str, list[float | None]], cases: list[Case]) -> None:
        self.times = {k: list(v) for k, v in times.items()}
        self.calls: list[tuple[str, str]] = []
        self.timings: list[dict] = []
        self.timing = {"repetitions": 10, "precision": 0.05, "warmup": 3, "flush_l2": True}
        self.space = type("S", (), {"cases": tuple(cases)})()

    def _answer(self, name: str) -> dict:
        us = self.times[name].pop(0)
        if us is None:
            return {"status": "incorrect", "reason": f"{name} wrote NaN"}
        return {"status": "ok", "time": {"median_us": us}, "tflops": 1.0}

    def time_case(self, report, case, timing):
        self.calls.append((case.label(), report.config["PATH"]))
        self.timings.append(timing)
        return self._answer(report.config["PATH"])

    def default_backends(self):
        return ("flash", "cudnn", "efficient", "math")

    def time_references(self, case, references, timing):
        self.calls.append((case.label(), "references"))
        self.timings.append(timing)
        return {b: self._answer(b) for b in references}


class Report:
    def __init__(self, path: str) -> None:
        self.config = Config.parse(f"PATH={path}")


def test_winners_and_references_interleave_and_reverse() -> None:
    case = Case(1, 2, 128, 64, False)
    ev = TableEvaluator({"wgmma": [10.0, 20.0, 30.0], "mma": [1.0, 2.0, 3.0], "cudnn": [11.0, 19.0, 33.0],
                         "fa4": [12.0, 18.0, 36.0]}, [case])
    winners = {case.label(): {"wgmma": (ev, Report("wgmma")), "mma": (ev, Report("mma"))}}
    samples, failures = interleaved_times(ev, [case], winners, ("cudnn", "fa4"), 3, {"precision": 0.0})
    assert [who for _, who in ev.calls] == ["references", "wgmma", "mma", "mma", "wgmma", "references",
                                            "references", "wgmma", "mma"]
    us = {who: [x["us"] for x in xs] for who, xs in samples[case.label()].items()}
    assert us == {"wgmma": [10.0, 20.0, 30.0], "mma": [1.0, 2.0, 3.0], "cudnn": [11.0, 19.0, 33.0],
                  "fa4": [12.0, 18.0, 36.0]} and failures == {}
    bars = [min(c, f) for c, f in zip(us["cudnn"], us["fa4"])]             # 11, 18, 33
    assert paired_ratio(us["wgmma"], bars) == pytest.approx(30.0 / 33.0)


def test_retime_takes_every_repetition_and_drops_a_finalist_that_fails() -> None:
    cases = [Case(1, 2, 128, 64, False), Case(1, 2, 128, 64, True)]
    ev = TableEvaluator({"mma": [5.0, 6.0, 5.5, 6.5], "wmma": [7.0, None],
                         **{b: [9.0, 9.5, 9.2, 9.7] for b in ("flash", "cudnn", "efficient", "math")}}, cases)
    out = retime(ev, [Report("mma"), Report("wmma")], rounds=2)
    assert all(t["precision"] == 0.0 and t["repetitions"] == 20 for t in ev.timings)   # twice the space's, no early stop
    # round 1: references, mma, wmma per case; round 2 reversed; wmma, failed on case 2, is not timed again
    assert [who for _, who in ev.calls] == ["references", "mma", "wmma", "references", "mma", "wmma",
                                            "mma", "references", "mma", "references"]
    key = Config.parse("PATH=mma").key()
    assert set(out["candidates"]) == {key} and out["failures"] == {Config.parse("PATH=wmma").key(): "wmma wrote NaN"}
    full, causal = (c.label() for c in cases)
    assert out["candidates"][key][full] == {"median_us": 5.25, "min_us": 5.0, "max_us": 5.5, "rounds": 2}
    assert out["candidates"][key][causal]["median_us"] == 6.25
    assert out["sdpa"][full]["cudnn"] == {"median_us": 9.1, "min_us": 9.0, "max_us": 9.2, "rounds": 2}
