"""The backward's wgmma path (Hopper warpgroup MMA, sm_90a) on the GPU.

Gradients dq, dk, dv against autograd of fp32 SDPA under flash-attn's rule, NaN-poisoned outputs and
workspaces (``test_backward_gpu._check``): every named wgmma configuration on short shapes, the h100-backward
space's wgmma seeds on S = 1, 5, 77, 257, 1000, seq_q != seq_k both ways and grouped-query heads, fp16 and
bf16, head dims 64 and 128, full and causal; repeated runs (atomic dQ; dK and dV bit-identical), strided
inputs, and the search's gate job on a wgmma configuration compiled for sm_90a. The TMA variant (LOAD tma: K,
V, Q, dO by tensor maps, LSE and D by cp.async) runs every one of these beside its cp.async twin; DQ_MODE bulk (dQ by a
producer warp's bulk reductions) runs as the named configurations and as the Hopper default of the LSE-forward test.
"""
from __future__ import annotations

import pytest
from test_backward_gpu import DTYPES, SHORT_SHAPES, _check

from evoengineer.kernels.backward_rules import WGMMA_CONFIGS, default_config
from evoengineer.space import Case, Config, Variant, load_space

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sm90,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 GPU (H100 or H200)"),
]

SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (1, 2, 2, 1, 1),
    (2, 3, 3, 5, 5),
    (2, 2, 2, 77, 77),
    (1, 2, 2, 257, 257),
    (1, 2, 2, 1000, 1000),
    (1, 2, 2, 77, 257),
    (1, 2, 2, 257, 77),
    (1, 8, 2, 257, 257),
    (2, 8, 2, 77, 130),
]
SEEDS = [c for c in load_space("h100-backward").search.listed_seeds if c["PATH"] == "wgmma"]
SEED_CASES = [(d, SEEDS[0]) for d in (64, 128)]   # the first seed builds for both head dims (a producer)
SEED_CASES += [(d, next(s for s in SEEDS if not s["PRODUCER"])) for d in (64, 128)]   # every thread loads
SEED_CASES += [(d, next(s for s in SEEDS if s["LOAD"] == "tma")) for d in (64, 128)]   # one thread loads by TMA
TWINS = {64: ("w128n128-pr", "w128n128-tma"), 128: ("w64n128-pr", "w64n128-tma")}
"""Per head dim the default backward and its TMA twin."""
CONFIG_CASES = [(d, name, c) for d, named in WGMMA_CONFIGS.items() for name, c in named.items()]


@pytest.mark.parametrize("head_dim,config", SEED_CASES, ids=[f"D{d}-{c.short_label().replace(' ', '_')}" for d, c in SEED_CASES])
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wgmma_seed_matches_fp32_autograd(shape, dtype: str, causal: bool, head_dim: int, config: Config) -> None:
    _check(config, shape, head_dim, causal, dtype)


@pytest.mark.parametrize("head_dim,name,config", CONFIG_CASES, ids=[f"D{d}-{n}" for d, n, _ in CONFIG_CASES])
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_named_wgmma_config_matches_fp32_autograd(head_dim: int, name: str, config: Config, causal: bool,
                                                        dtype: str) -> None:
    for shape in SHORT_SHAPES:
        _check(config, shape, head_dim, causal, dtype)


@pytest.mark.parametrize("load", (0, 1), ids=("cpasync", "tma"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_wgmma_atomic_dq_passes_on_repeated_runs(head_dim: int, causal: bool, load: int) -> None:
    config = WGMMA_CONFIGS[head_dim][TWINS[head_dim][load]]
    results = _check(config, (1, 8, 2, 1024, 1024), head_dim, causal, "bf16", runs=3)
    for dq, dk, dv in results[1:]:   # dK and dV never race: identical run to run
        assert torch.equal(dk, results[0][1]) and torch.equal(dv, results[0][2])


LSE_FORWARDS = {
    "ptmao": Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=128, CONSUMER_WGS=2, INTRA_WG_OVERLAP=1, LOAD="tma", O_TMA=1,
                    PERSISTENT=1, PINGPONG=0, PRODUCER=1, Q_IN_REGS=1, REG_CONSUMER=240, REG_PRODUCER=24,
                    SOFTMAX_PIN=3, SPLIT_TAIL=0, STAGES=2),
    "wgmma-64x128": Config(PATH="wgmma", BLOCK_M=64, BLOCK_N=128, CONSUMER_WGS=1, STAGES=2),
}


@pytest.mark.parametrize("forward", LSE_FORWARDS, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wgmma_forward_writes_the_lse_the_backward_needs(forward: str, head_dim: int, causal: bool, dtype: str) -> None:
    """WRITE_LSE=1 on wgmma forwards (persistent with TMA loads and stores; one CTA a tile with
    cp.async): o and the LSE against fp32 SDPA, and the default backward's gradients from them
    under flash-attn's rule, on every shape (odd lengths, seq_q != seq_k, grouped heads)."""
    for shape in SHAPES:
        _check(default_config(head_dim, hopper=True), shape, head_dim, causal, dtype, forward=LSE_FORWARDS[forward])


@pytest.mark.parametrize("name", ("w64n128-pr", "w64n128-tma"))
def test_wgmma_strided_inputs(name: str) -> None:
    """(B, S, H, D) storage: head and sequence strides differ from the dense layout (TMA: the maps' strides)."""
    _check(WGMMA_CONFIGS[128][name], (2, 4, 2, 200, 300), 128, True, "fp16", transposed=True)


@pytest.mark.parametrize("load", (0, 1), ids=("cpasync", "tma"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_gate_job_runs_a_wgmma_configuration(head_dim: int, load: int) -> None:
    """The search's gradient gate (``gpu.backward_jobs``) on a wgmma kernel built for sm_90a."""
    from evoengineer.gpu.backward import load_backward
    from evoengineer.gpu.backward_jobs import gate_backward, gate_case

    config = WGMMA_CONFIGS[head_dim][TWINS[head_dim][load]]
    case = gate_case(Case(2, 16, 700, head_dim, True, heads_kv=4, dtype="bf16", seq_kv=900))
    kernel = load_backward(config, Variant(head_dim, True, "bf16"), "cuda")
    assert kernel.atomic_dq and "sm_90a" in kernel.rendered.source
    result = gate_backward(kernel, kernel.atomic_dq, case, None, seed=11, trials=2)
    assert result.status == "ok", result.reason


@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_time_job_captures_the_tma_backward_in_a_graph(head_dim: int) -> None:
    """The search's timed job (``gpu.backward_jobs.time_job``) on the TMA variant: its maps, encoded per
    call on the host, captured with each input set's launches in a CUDA graph, every gradient written."""
    from evoengineer.gpu.backward import _build
    from evoengineer.gpu.backward_jobs import time_job

    config = WGMMA_CONFIGS[head_dim][TWINS[head_dim][1]]
    rendered, cubin = _build("flash_attention_bwd", config, Variant(head_dim, True, "fp16"), "cuda")
    case = Case(1, 4, 1000, head_dim, True, heads_kv=2, dtype="fp16", seq_kv=1000)
    job = {"rendered": rendered, "cubin_path": cubin, "case": case, "scale": None, "seed": 3, "key": config.key(),
           "timing": {"warmup": 2, "repetitions": 5, "flush_l2": True, "timeout_s": 30}, "atol": 0.02, "rtol": 0.02}
    result = time_job(job)
    assert result["status"] == "ok", result
