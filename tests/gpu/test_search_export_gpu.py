"""A real search on the GPU, its leaderboard, and the exported module against SDPA on
shapes that were not in the space."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SPACE = """
name: tiny
target: {name: any, arch: sm_90, sms: 132, smem_per_block: 232448}
problem:
  shapes:
    - {B: 1, H: 2, S: 256, D: 64, causal: [false, true]}
    - {B: 1, H: 2, S: 256, D: 128, causal: false}
template: flash_attention
params:
  PATH: [scalar, wmma]
  BLOCK_M: [64]
  BLOCK_N: [32, 64]
  WARPS: [4]
  VEC: [8]
timing: {warmup: 3, repetitions: 20, flush_l2: true, timeout_s: 20}
search: {strategy: grid, budget: 10, top_k: 2}
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_search_leaderboard_export_on_gpu(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    (tmp_path / "tiny.yaml").write_text(SPACE)
    run = tmp_path / "run"
    done = cli("search", "--space", "tiny.yaml", "--run-dir", str(run), "--retime-rounds", "2", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads(l) for l in (run / "results.jsonl").read_text().splitlines()]
    # a partition per head dim, each every one of its 4 valid configurations, timed on its own cases
    assert len(results) == 8 and all(r["status"] == "ok" for r in results), results
    cases = {"D64": ["B1 H2 S256 D64", "B1 H2 S256 D64 causal"], "D128": ["B1 H2 S256 D128"]}
    assert sorted(r["partition"] for r in results) == ["D128"] * 4 + ["D64"] * 4
    assert all([c["label"] for c in r["cases"] if c.get("time")] == cases[r["partition"]] for r in results)
    for r in results:  # where each evaluation's time went, the worker's phases included
        assert r["phases"]["gate"] > 0 and r["phases"]["timing"] > 0 and r["phases"]["load"] >= 0, r["phases"]
        assert r["phases"]["gate"] + r["phases"]["timing"] + r["phases"]["load"] <= r["eval_s"] + 0.01
    summary = json.loads((run / "run.json").read_text())["summary"]
    assert summary["phases"]["timing"]["total_s"] > 0 and summary["phases"]["storage"]["total_s"] > 0
    env = json.loads((run / "env.json").read_text())
    assert env["gpu"] and env["sms"] > 0 and env["torch"]
    board = json.loads(cli("leaderboard", str(run), "--json", cwd=tmp_path).stdout)
    assert board["retimed"] and len(board["entries"]) == 4 and board["sdpa"]
    assert [(e["rank"], e["partition"]) for e in board["entries"]] == [(1, "D64"), (2, "D64"), (3, "D128"), (4, "D128")]

    out = tmp_path / "best"
    assert cli("export", str(run), "--rank", "1", "--out", str(out), cwd=tmp_path).returncode == 0
    sys.path.insert(0, str(out))
    try:
        from evo_attention import attention
    finally:
        sys.path.remove(str(out))
    for d in (64, 128):
        for causal in (False, True):
            base = torch.randn(2, 333, 3, d, device="cuda", dtype=torch.float16)  # (B, S, H, D): strided views
            q = base.transpose(1, 2)
            k = torch.randn(2, 3, 333, d, device="cuda", dtype=torch.float16)
            v = torch.randn(2, 3, 333, d, device="cuda", dtype=torch.float16)
            out_t = attention(q, k, v, is_causal=causal)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            torch.testing.assert_close(out_t.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(TypeError, match="float16"):
        attention(q.float(), k, v)
    with pytest.raises(ValueError, match="head_dim 96"):
        x = torch.randn(1, 1, 8, 96, device="cuda", dtype=torch.float16)
        attention(x, x, x)
