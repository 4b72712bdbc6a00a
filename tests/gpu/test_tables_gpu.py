"""The GPU commands' tables as a log sees them (80 columns): nothing cut, every figure there;
the report of a GPU run has a winner per shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.space import Config

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent.parent
SPACE = """
name: tiny
target: {name: any, arch: sm_90, sms: 132, smem_per_block: 232448}
problem:
  shapes:
    - {B: 1, H: 2, S: 256, D: 64, causal: [false, true]}
    - {B: 2, H: 16, S: 1024, D: 128, causal: false}
template: flash_attention
params:
  PATH: [wmma, mma]
  BLOCK_M: [64]
  BLOCK_N: [64]
  WARPS: [4]
  VEC: [8]
  STAGES: [1, 2]
  Q_IN_REGS: [0, 1]
  P_IN_REGS: [0, 1]
constraints:
  - "(PATH == 'mma' and P_IN_REGS == 1) or (PATH == 'wmma' and STAGES == 1 and Q_IN_REGS == 0 and P_IN_REGS == 0)"
timing: {warmup: 3, repetitions: 20, flush_l2: true, timeout_s: 20}
search: {strategy: grid, budget: 10, top_k: 3}
"""
CONFIG = "PATH=mma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8,STAGES=2,Q_IN_REGS=1,P_IN_REGS=1"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


def fits(text: str) -> None:
    assert "…" not in text, text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80, text


def test_baseline_bench_and_search_tables_fit_80_columns(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(SPACE)
    baseline = cli("baseline", "--space", "tiny.yaml", cwd=tmp_path)
    assert baseline.returncode == 0, baseline.stdout + baseline.stderr
    fits(baseline.stdout)
    rows = json.loads(cli("baseline", "--space", "tiny.yaml", "--json", cwd=tmp_path).stdout)["baseline"]
    for label in rows:  # every shape on one line with its fastest backend
        assert any(line.startswith(label + " ") and any(f" {b} " in line for b in rows[label]) for line in baseline.stdout.splitlines())

    bench = cli("bench", "--space", "tiny.yaml", "--config", CONFIG, cwd=tmp_path)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    table = bench.stdout[bench.stdout.index("gate and device time"):]
    fits(table)
    assert all(h in table for h in ("µs", "× SDPA", "TF/s", "max err"))
    wide = cli("bench", "--space", "tiny.yaml", "--config", CONFIG, "--wide", cwd=tmp_path)
    assert "× cudnn" in wide.stdout and "rel L2 err" in wide.stdout and "…" not in wide.stdout

    run = tmp_path / "run"
    done = cli("search", "--space", "tiny.yaml", "--run-dir", str(run), "--retime-rounds", "2", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    fits(done.stdout[done.stdout.index("search summary"):done.stdout.index("run directory:")])
    board = json.loads((run / "leaderboard.json").read_text())
    assert board["retimed"] and board["entries"]
    for e in board["entries"]:
        assert any(Config(e["config"]).short_label() in line and f"{e['geomean_us']:.2f}" in line and f"{e['tflops']:.1f}" in line
                   for line in done.stdout.splitlines())

    # the report of the same run: per-shape winners against the SDPA backends timed on this GPU
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'evoengineer[plot]')")
    made = cli("report", str(run), cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    text = (run / "report.html").read_text()
    shapes = text[text.index('<section id="shapes">'):]
    shapes = shapes[:shapes.index("</section>")]
    baseline = json.loads((run / "baseline.json").read_text())
    assert "no per-shape timings" not in shapes
    for label in baseline:
        assert f'<td class="l">{label}</td>' in shapes
