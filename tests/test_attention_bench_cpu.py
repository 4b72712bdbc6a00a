"""benchmarks/attention_vs_sdpa.py's re-timing: the order of the interleaved rounds and the paired
ratios, on an evaluator that answers from a table of times (no GPU)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from evoengineer.space import Case, Config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("attention_vs_sdpa", REPO / "benchmarks" / "attention_vs_sdpa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_vs_sdpa"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("attention_vs_sdpa", None)


class TableEvaluator:
    """Answers the two timing calls from ``times[name]`` (one figure per round, in call order)
    and records the calls."""

    timing = {"repetitions": 10, "precision": 0.05}

    def __init__(self, times: dict[str, list[float]]) -> None:
        self.times = {k: list(v) for k, v in times.items()}
        self.calls: list[tuple[str, str]] = []
        self.timings: list[dict] = []

    def _answer(self, name: str) -> dict:
        return {"status": "ok", "time": {"median_us": self.times[name].pop(0)}, "tflops": 1.0}

    def time_case(self, report, case, timing):
        self.calls.append((case.label(), report.config["PATH"]))
        self.timings.append(timing)
        return self._answer(report.config["PATH"])

    def time_references(self, case, references, timing):
        self.calls.append((case.label(), "references"))
        self.timings.append(timing)
        return {b: self._answer(b) for b in references}


class Report:
    def __init__(self, path: str) -> None:
        self.config = Config.parse(f"PATH={path}")


def test_rounds_interleave_and_reverse(bench) -> None:
    case = Case(1, 2, 128, 64, False)
    ev = TableEvaluator({"wgmma": [10.0, 20.0, 30.0], "mma": [1.0, 2.0, 3.0], "cudnn": [11.0, 19.0, 33.0],
                         "fa4": [12.0, 18.0, 36.0]})
    winners = {case.label(): {"wgmma": (ev, Report("wgmma")), "mma": (ev, Report("mma"))}}
    samples = bench.retime_winners(winners, [case], ("cudnn", "fa4"), 3, ev)
    label = case.label()
    assert [who for _, who in ev.calls] == ["references", "wgmma", "mma", "mma", "wgmma", "references",
                                            "references", "wgmma", "mma"]
    assert all(t["precision"] == 0.0 and t["repetitions"] == 10 for t in ev.timings)   # every repetition taken
    us = {who: [x["us"] for x in xs] for who, xs in samples[label].items()}
    assert us == {"wgmma": [10.0, 20.0, 30.0], "mma": [1.0, 2.0, 3.0], "cudnn": [11.0, 19.0, 33.0],
                  "fa4": [12.0, 18.0, 36.0]}
    # paired per round: 10/11, 20/18, 30/33 against the bar min(cuDNN, fa4) = 11, 18, 33
    bars = [min(c, f) for c, f in zip(us["cudnn"], us["fa4"])]
    assert bench.paired_median(us["wgmma"], bars) == pytest.approx(30.0 / 33.0)
    assert bench.paired_median([1.0, 2.0], [2.0, 1.0]) == pytest.approx(1.25)


def test_the_rounds_pick_the_reported_candidate_of_a_path(bench) -> None:
    """Two re-timed wgmma candidates: the one with the lower median over the rounds is reported,
    whichever the first pass put first."""
    us = {"wgmma#1": [10.0, 12.0, 11.0], "wgmma#2": [9.0, 13.0, 10.5], "mma#1": [5.0], "cudnn": [1.0]}
    assert bench.rounds_winner(us, "wgmma") == "wgmma#2"
    assert bench.rounds_winner(us, "mma") == "mma#1"
    assert bench.rounds_winner(us, "wmma") is None
    assert [bench.candidate_name("wgmma", i) for i in range(3)] == ["wgmma#1", "wgmma#2", "wgmma#3"]


def test_leaderboards_give_the_top_configurations_per_shape_and_path(bench, tmp_path) -> None:
    def line(block_n: int, us: dict[str, float], path: str = "wgmma") -> str:
        config = {"PATH": path, "BLOCK_M": 128, "BLOCK_N": block_n}
        cases = [{"label": label, "time": {"median_us": t}} for label, t in us.items()]
        return json.dumps({"status": "ok", "config": config, "cases": cases})

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.jsonl").write_text("\n".join([
        line(64, {"A": 3.0, "B": 1.0}), line(128, {"A": 1.0, "B": 5.0}), line(192, {"A": 2.0, "B": 4.0}),
        line(176, {"A": 9.0, "B": 9.0}), line(64, {"A": 4.0, "B": 2.0}, path="mma"),
        json.dumps({"status": "wrong", "config": {"PATH": "wgmma", "BLOCK_N": 16}, "cases": []})]))
    one = [c["BLOCK_N"] for c in bench.configs_from_leaderboards([run])]
    two = [(c["PATH"], c["BLOCK_N"]) for c in bench.configs_from_leaderboards([run], top=2)]
    assert sorted(one) == [64, 64, 128]          # A: wgmma 128, B: wgmma 64; mma 64 on both
    assert sorted(two) == [("mma", 64), ("wgmma", 64), ("wgmma", 128), ("wgmma", 192)]


def test_only_shapes_needs_a_shape(bench, capsys) -> None:
    assert bench.main(["--only-shapes"]) == 2
    assert capsys.readouterr().err.strip() == "error: --only-shapes: give at least one --shape"
