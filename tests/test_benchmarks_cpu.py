"""The throughput benchmarks run without a GPU on replayed evaluations."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
RECORDING = REPO / "tests" / "data" / "replay_synthetic.jsonl"


def _space(tmp_path: Path) -> Path:
    header = json.loads(RECORDING.read_text().splitlines()[0])["header"]
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(header["space_inline"], sort_keys=False))
    return path


def test_scaling_benchmark_on_simulated_devices(tmp_path: Path) -> None:
    space = _space(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--space", str(space), "--replay", str(RECORDING),
                           "--replay-delay", "0.25", "--trials", "24", "--gpus", "1,4", "--processes", "--devices-per-process",
                           "2", "--out", str(tmp_path / "runs"), "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert [(r["mode"], r["gpus"]) for r in rows] == [("--devices", 1), ("--devices", 4), ("2x2", 4)]
    for r in rows:
        assert r["evaluations"] == 24 and r["duplicates"] == 0 and sum(r["split"].values()) == 24
        assert len(r["split"]) == r["gpus"]
        assert 240 <= r["phases_ms_per_evaluation"]["timing"] < 400   # each replayed evaluation sleeps 0.25 s
    # 4 simulated devices, 24 evaluations of 0.25 s: ~3.9x on idle cores, above 1.8x beside other test processes
    assert rows[1]["speedup"] > 1.8 and rows[2]["speedup"] > 1.6   # two searches of two devices on one study


def test_overhead_benchmark(tmp_path: Path) -> None:
    space = _space(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "search_overhead.py"), "--space", str(space),
                           "--trials", "10", "--delay", "0.05", "--devices", "2", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)[0]
    assert row["evaluations"] == 10 and row["devices"] == 2
    assert 0 < row["gpu_busy_share"] <= 1 and row["overhead_ms_per_evaluation"] >= 0
    assert row["phases_mean_ms"]["timing"] >= 50
