"""Packed variable-length cases of a space on the GPU: the gate passes the mma path's varlen kernel
on packed inputs and fails it where the offsets it reads are wrong; a kernel without the switch
cannot launch packed sequences; a small real search over a packed case records ok evaluations and
a time against SDPA per sequence."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoengineer.kernels import compile_source, render
from evoengineer.space import Case, Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MMA = Config({"PATH": "mma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8, "STAGES": 2, "SMEM_LAYOUT": "swizzle",
              "Q_IN_REGS": 0, "P_IN_REGS": 1, "SPLITS": 1, "KV_GROUPS": 1})
LENGTHS = (1, 77, 300, 1024, 5)


def _kernel(causal: bool, features: tuple[str, ...] = ("varlen",), head_dim: int = 64):
    from evoengineer.gpu import AttentionKernel
    from evoengineer.gpu.backward import device_arch

    rendered = render("flash_attention", MMA, Variant(head_dim, causal, "fp16", features))
    result = compile_source(rendered.source, device_arch(0))
    assert result.ok, result.log
    return AttentionKernel(rendered, result.cubin_path)


def _gate(launcher, case: Case):
    from evoengineer.gpu.evaluate import gate_launcher

    return gate_launcher(launcher, case, None, 2e-2, 2e-2, seed=77, trials=2)


@pytest.mark.parametrize("causal", [False, True])
def test_the_gate_passes_the_mma_varlen_kernel_on_packed_inputs(causal: bool) -> None:
    kernel = _kernel(causal)
    for case in (Case(len(LENGTHS), 4, max(LENGTHS), 64, causal, heads_kv=2, lengths=LENGTHS),
                 Case(2, 3, 130, 64, causal, lengths=(130, 64))):
        result = _gate(kernel, case)
        assert result.status == "ok", result.reason
        assert result.max_abs_err is not None and result.max_abs_err < 2e-2


def test_the_gate_fails_a_launch_that_reads_wrong_offsets() -> None:
    from evoengineer.gpu.launch import Packed

    kernel = _kernel(True)
    case = Case(len(LENGTHS), 4, max(LENGTHS), 64, True, heads_kv=2, lengths=LENGTHS)

    def shifted(q, k, v, out, scale, packed: Packed, **kw):   # each inner boundary one token late
        offsets = packed.cu_seqlens_q.clone()
        offsets[1:-1] += 1
        return kernel(q, k, v, out, scale, packed=Packed(offsets, offsets, packed.max_seqlen_q + 1,
                                                          packed.max_seqlen_k + 1), **kw)

    result = _gate(shifted, case)
    assert result.status == "incorrect" and "exceeds atol" in result.reason, result.reason


def test_a_kernel_without_the_switch_cannot_launch_packed_sequences() -> None:
    from evoengineer.gpu.harness import _KernelFault

    kernel = _kernel(False, features=())
    with pytest.raises(_KernelFault, match="takes no packed sequences"):
        _gate(kernel, Case(2, 2, 77, 64, False, lengths=(77, 5)))


def small_search(tmp_path: Path, shape: dict, labels: set[str]) -> None:
    """A real three-trial search of a dense shape and ``shape`` (``--shape`` selecting the latter's
    B, H, longest length, D) records ok evaluations timing the cases ``labels``, an SDPA baseline
    for each and a leaderboard with speed-ups."""
    space = {
        "name": "lengths-gpu",
        "target": {"name": "NVIDIA H100 / H200", "arch": "sm_90a", "sms": 132, "smem_per_block": 232448},
        "problem": {"dtype": "fp16", "shapes": [{"B": 2, "H": 8, "S": 512, "D": 64, "causal": True}, shape]},
        "template": "flash_attention",
        "params": {"BLOCK_M": [64], "BLOCK_N": [32, 64]},
        "paths": {"mma": {"params": {"WARPS": [4], "VEC": [8], "STAGES": [1, 2]}}},
        "timing": {"warmup": 3, "repetitions": 20, "min_repetitions": 5},
        "search": {"strategy": "random", "budget": 3, "top_k": 2},
    }
    (tmp_path / "lengths.yaml").write_text(yaml.safe_dump(space, sort_keys=False))
    lengths = shape["lengths"]
    selected = f"{len(lengths)},{shape['H']},{max(lengths)},{shape['D']}"
    done = subprocess.run([sys.executable, "-m", "evoengineer", "search", "--space", "lengths.yaml", "--shape", selected,
                           "--trials", "3", "--run-dir", "run", "--quiet"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr + done.stdout
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    ok = [r for r in records if r["status"] == "ok"]
    assert ok, [(r["status"], r["reason"]) for r in records]
    assert all(labels <= {c["label"] for c in r["cases"] if c.get("time")} for r in ok)
    baseline = json.loads((run / "baseline.json").read_text())
    assert all(any(row.get("status") == "ok" for row in baseline[label].values()) for label in labels)
    board = json.loads((run / "leaderboard.json").read_text())
    assert board["entries"] and all(e["speedup"] for e in board["entries"])


def test_a_small_search_over_a_packed_case_times_it_against_sdpa_per_sequence(tmp_path: Path) -> None:
    shape = {"H": 8, "H_KV": 2, "D": 64, "causal": [False, True], "lengths": list(LENGTHS)}
    small_search(tmp_path, shape, {"B5 H8/2 varlen 1..1024 T1407 D64", "B5 H8/2 varlen 1..1024 T1407 D64 causal"})
