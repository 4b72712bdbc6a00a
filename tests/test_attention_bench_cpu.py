"""The comparison against SDPA (evoengineer.bench.versus, benchmarks/attention_vs_sdpa.py): the
candidates recorded runs give, the one the rounds report per path, and its command line (no GPU).
The order of its interleaved rounds is tested with the protocol (tests/test_bench_protocol.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from evoengineer.bench.versus import candidate_name, configs_from_leaderboards, rounds_winner

REPO = Path(__file__).resolve().parent.parent


def test_the_rounds_pick_the_reported_candidate_of_a_path() -> None:
    """Two re-timed wgmma candidates: the one with the lower median over the rounds is reported,
    whichever the first pass put first."""
    us = {"wgmma#1": [10.0, 12.0, 11.0], "wgmma#2": [9.0, 13.0, 10.5], "mma#1": [5.0], "cudnn": [1.0]}
    assert rounds_winner(us, "wgmma") == "wgmma#2"
    assert rounds_winner(us, "mma") == "mma#1"
    assert rounds_winner(us, "wmma") is None
    assert [candidate_name("wgmma", i) for i in range(3)] == ["wgmma#1", "wgmma#2", "wgmma#3"]


def test_leaderboards_give_the_top_configurations_per_shape_and_path(tmp_path: Path) -> None:
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
    one = [c["BLOCK_N"] for c in configs_from_leaderboards([run])]
    two = [(c["PATH"], c["BLOCK_N"]) for c in configs_from_leaderboards([run], top=2)]
    assert sorted(one) == [64, 64, 128]          # A: wgmma 128, B: wgmma 64; mma 64 on both
    assert sorted(two) == [("mma", 64), ("wgmma", 64), ("wgmma", 128), ("wgmma", 192)]


def test_only_shapes_needs_a_shape() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_vs_sdpa.py"), "--only-shapes"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: --only-shapes: give at least one --shape"
