"""One search over every GPU of the host (--devices all): each GPU evaluates, the budget is
met exactly and no configuration is evaluated twice. Needs two GPUs or more."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SPACE = """
name: tiny_devices
target: {name: any, arch: sm_90, sms: 132, smem_per_block: 232448}
problem:
  shapes:
    - {B: 1, H: 4, S: 512, D: 64, causal: [false, true]}
template: flash_attention
params:
  PATH: [scalar, wmma]
  BLOCK_M: [32, 64]
  BLOCK_N: [32, 64]
  WARPS: [2, 4]
  VEC: [4, 8]
constraints:
  - "WARPS <= BLOCK_M // 16 or (PATH == 'scalar' and WARPS <= BLOCK_M)"
timing: {warmup: 3, repetitions: 20, flush_l2: true, timeout_s: 20}
search: {strategy: random, budget: 16, top_k: 2}
"""


def test_search_over_all_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs or more")
    (tmp_path / "tiny.yaml").write_text(SPACE)
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "evoengineer", "search", "--space", "tiny.yaml", "--devices", "all",
                           "--run-dir", str(run), "--retime-rounds", "1", "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)["summary"]
    gpus = torch.cuda.device_count()
    assert summary["devices"] == gpus and summary["evaluated"] == 16
    assert len(summary["per_device"]) == gpus, summary["per_device"]
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)) == 16
    assert {r["device"] for r in records} == set(range(gpus))
    assert all(r["phases"]["timing"] > 0 for r in records if r["status"] == "ok")
