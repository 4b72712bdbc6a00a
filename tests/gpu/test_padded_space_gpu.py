"""Padded batches as search cases on the GPU: the gate passes the mma and wgmma kernels built with
per-batch lengths on padded inputs and fails a launch that computes the padding; a small real
search over a padded case records ok evaluations and a time against SDPA's masked call."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evoengineer.kernels import compile_source, render  # noqa: E402
from evoengineer.space import Case, Config, Variant  # noqa: E402

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
WGMMA = Config({"PATH": "wgmma", "CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PRODUCER": 1,
                "REG_PRODUCER": 24, "REG_CONSUMER": 232, "INTRA_WG_OVERLAP": 1, "PINGPONG": 1, "LOAD": "tma",
                "PERSISTENT": 1, "O_TMA": 1, "Q_IN_REGS": 1, "SOFTMAX_PIN": 3, "SPLIT_TAIL": 0})   # ptmao ovq3 pp
LENGTHS = (1, 77, 300, 1024, 5)


def _kernel(config: Config, causal: bool, head_dim: int = 64):
    from evoengineer.gpu import AttentionKernel
    from evoengineer.gpu.backward import device_arch

    rendered = render("flash_attention", config, Variant(head_dim, causal, "fp16", ("seqlens",)))
    result = compile_source(rendered.source, "sm_90a" if config["PATH"] == "wgmma" else device_arch(0))
    assert result.ok, result.log
    return AttentionKernel(rendered, result.cubin_path)


def _gate(launcher, case: Case):
    from evoengineer.gpu.evaluate import gate_launcher

    return gate_launcher(launcher, case, None, 2e-2, 2e-2, seed=77, trials=2)


CASES = [Case(len(LENGTHS), 4, 1030, 64, True, heads_kv=2, lengths=LENGTHS, padded=True),
         Case(2, 3, 140, 64, False, lengths=(130, 64), padded=True),
         Case(3, 4, 700, 128, True, heads_kv=1, lengths=(700, 129, 1), padded=True)]


@pytest.mark.parametrize("path", ["mma", "wgmma"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_the_gate_passes_a_seqlens_kernel_on_padded_inputs(path: str, case: Case) -> None:
    if path == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90a GPU (H100, H200)")
    kernel = _kernel(MMA if path == "mma" else WGMMA, case.causal, case.head_dim)
    result = _gate(kernel, case)
    assert result.status == "ok", result.reason
    assert result.max_abs_err is not None and result.max_abs_err < 2e-2


def test_the_gate_fails_a_launch_that_computes_the_padded_rows() -> None:
    kernel = _kernel(MMA, True)

    def keys_only(q, k, v, out, scale, features, **kw):   # seqlens_q dropped: padded rows see their batch's keys
        return kernel(q, k, v, out, scale, features={**features, "seqlens_q": None}, **kw)

    result = _gate(keys_only, CASES[0])
    assert result.status == "incorrect" and "exceeds atol" in result.reason, result.reason


def test_a_small_search_over_a_padded_case_times_it_against_sdpa_with_the_mask(tmp_path: Path) -> None:
    from test_varlen_space_gpu import small_search

    shape = {"H": 8, "H_KV": 2, "D": 64, "causal": True, "lengths": list(LENGTHS), "padded": True}
    small_search(tmp_path, shape, {"B5 H8/2 padded 1..1024 T1407 S1024 D64 causal"})
