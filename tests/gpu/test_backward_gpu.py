"""The mma backward (templates/flash_attention_bwd.cu.j2) and the LSE forward on the GPU.

Gradients dq, dk, dv against autograd of fp32 SDPA (math backend) under flash-attn's rule
``max|g - g32| <= 2 max|g_lowp - g32| + eps`` (g_lowp: the same autograd in the input dtype,
eps = 1e-3 max|g32| + 1e-5), with NaN-poisoned outputs and workspaces; the forward's row
log-sum-exp against torch.logsumexp in fp32. Shapes: S = 1, 5, 77, 257, 1024, seq_q != seq_k
both ways, grouped-query heads, causal and full, fp16 and bf16, head dims 64 and 128.
The atomic dQ mode must pass on repeated runs, the separate mode must repeat bit for bit.
DKDV=halves passes the same checks on every shape and gives DKDV=tiles' dK and dV bit for bit.
"""
from __future__ import annotations

import itertools

import pytest

from evoengineer.kernels.backward_rules import BACKWARD_CONFIGS, backward_config, default_config
from evoengineer.space import Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                       reason="needs a CUDA GPU with sm_80 or newer"),
]

SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (1, 2, 2, 1, 1),
    (2, 3, 3, 5, 5),
    (2, 2, 2, 77, 77),
    (1, 2, 2, 257, 257),
    (1, 2, 2, 1024, 1024),
    (1, 2, 2, 77, 257),
    (1, 2, 2, 257, 77),
    (1, 8, 2, 257, 257),
    (2, 8, 2, 77, 130),
]
SHORT_SHAPES = [(2, 2, 2, 77, 77), (1, 2, 2, 77, 257), (1, 2, 2, 257, 77), (1, 8, 2, 257, 257)]
DTYPES = ("fp16", "bf16")
LSE_ATOL = 1e-3


def _inputs(shape: tuple[int, int, int, int, int], head_dim: int, dtype: str, seed: int, transposed: bool = False):
    B, H, H_kv, S_q, S_k = shape
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads: int, seq: int):
        if transposed:  # (B, S, H, D) storage seen as (B, H, S, D)
            return torch.randn(B, seq, heads, head_dim, device="cuda", dtype=dt, generator=gen).transpose(1, 2)
        return torch.randn(B, heads, seq, head_dim, device="cuda", dtype=dt, generator=gen)

    return make(H, S_q), make(H_kv, S_k), make(H_kv, S_k), make(H, S_q)


def _poisoned(*like) -> list:
    return [torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in like]


def _run_backward(config: Config, q, k, v, do, causal: bool, *, runs: int = 1, forward: Config | None = None):
    """Our forward (o, lse; ``forward``: that WRITE_LSE forward, else the mma one), then ``runs``
    backward passes into NaN-poisoned outputs and workspaces."""
    from evoengineer.gpu.backward import attention_forward_lse, load_backward

    variant = Variant(q.shape[-1], causal, {torch.float16: "fp16", torch.bfloat16: "bf16"}[q.dtype])
    o_nan, = _poisoned(q)
    lse_nan = torch.full(q.shape[:3], float("nan"), device="cuda")
    o_lse = attention_forward_lse(q, k, v, causal=causal, config=forward, out=o_nan, lse=lse_nan)
    kernel = load_backward(config, variant, q.device)
    B, H, S_q, D = q.shape
    results = []
    for _ in range(runs):
        dq, dk, dv = _poisoned(q, k, v)
        dsum = torch.full((B * H * S_q,), float("nan"), device="cuda")
        acc = torch.full((B * H * S_q * D,), float("nan"), device="cuda")
        results.append(kernel(q, k, v, *o_lse, do, dq=dq, dk=dk, dv=dv, dsum=dsum, dq_accum=acc))
    torch.cuda.synchronize()
    return o_lse, results


def _check(config: Config, shape, head_dim: int, causal: bool, dtype: str, *, runs: int = 1, transposed: bool = False,
           forward: Config | None = None):
    from evoengineer.gpu.backward import reference_lse, rule_check, sdpa_gradients

    seed = sum(shape) * 7 + head_dim + int(causal) + (dtype == "bf16")
    q, k, v, do = _inputs(shape, head_dim, dtype, seed, transposed)
    (o, lse), results = _run_backward(config, q, k, v, do, causal, runs=runs, forward=forward)
    o32, *g32 = sdpa_gradients(q, k, v, do, causal, None, torch.float32)
    olp, *glp = sdpa_gradients(q, k, v, do, causal, None)
    label = f"{config.label()} {shape} D{head_dim} causal={causal} {dtype}"
    lse_err = (lse - reference_lse(q, k, causal, None)).abs().max().item()
    assert lse_err <= LSE_ATOL, f"{label}: lse max err {lse_err:.3g}"
    out = rule_check("o", o, o32, olp)
    assert out.ok, f"{label}: {out}"
    for r, grads in enumerate(results):
        for name, ours, ref, lowp in zip(("dq", "dk", "dv"), grads, g32, glp):
            check = rule_check(name, ours, ref, lowp)
            assert check.ok, f"{label} run {r}: {check}"
    return results


def _default_cases():
    for head_dim, dtype, causal, deterministic in itertools.product((64, 128), DTYPES, (False, True), (False, True)):
        yield head_dim, dtype, causal, deterministic


@pytest.mark.parametrize("head_dim,dtype,causal,deterministic", list(_default_cases()),
                         ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_configs_match_fp32_autograd(shape, head_dim: int, dtype: str, causal: bool, deterministic: bool) -> None:
    _check(default_config(head_dim, deterministic_dq=deterministic), shape, head_dim, causal, dtype)


CONFIG_CASES = [(d, name, c) for d, named in BACKWARD_CONFIGS.items() for name, c in named.items()]


@pytest.mark.parametrize("head_dim,name,config", CONFIG_CASES, ids=[f"D{d}-{n}" for d, n, _ in CONFIG_CASES])
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kept_config_matches_fp32_autograd(head_dim: int, name: str, config: Config, causal: bool, dtype: str) -> None:
    for shape in SHORT_SHAPES:
        _check(config, shape, head_dim, causal, dtype)


HALVES_CASES = [(64, "h128n128", backward_config(128, 128, dkdv="halves")),
                (64, "h64n128", backward_config(64, 128, dkdv="halves")),
                (128, "h64n128", backward_config(64, 128, dkdv="halves")),
                (128, "h64n128-sep", backward_config(64, 128, dkdv="halves", dq_mode="separate"))]


@pytest.mark.parametrize("head_dim,name,config", HALVES_CASES, ids=[f"D{d}-{n}" for d, n, _ in HALVES_CASES])
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_halves_match_fp32_autograd(head_dim: int, name: str, config: Config, causal: bool, dtype: str) -> None:
    """DKDV=halves (S and dP by column halves) on every shape: odd lengths, seq_q != seq_k, grouped heads."""
    for shape in SHAPES:
        _check(config, shape, head_dim, causal, dtype)


@pytest.mark.parametrize("head_dim,name,config", HALVES_CASES, ids=[f"D{d}-{n}" for d, n, _ in HALVES_CASES])
@pytest.mark.parametrize("causal", (False, True))
def test_halves_give_the_tiles_kernels_dk_and_dv_bit_for_bit(head_dim: int, name: str, config: Config, causal: bool) -> None:
    """Each S and dP element is the same sum in the same order either way, so P and dS, and with them
    dK and dV (and a separate kernel's dQ), are those of DKDV=tiles bit for bit."""
    shape = (2, 8, 2, 333, 333)
    q, k, v, do = _inputs(shape, head_dim, "bf16", 11)
    _, (ours,) = _run_backward(config, q, k, v, do, causal)
    _, (theirs,) = _run_backward(config.replace(DKDV="tiles"), q, k, v, do, causal)
    exact = ("dq", "dk", "dv") if config["DQ_MODE"] == "separate" else ("dk", "dv")
    for label, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        if label in exact:
            assert torch.equal(a, b), f"{config.label()} causal={causal}: {label} differs from tiles'"


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_atomic_dq_passes_on_repeated_runs(head_dim: int, causal: bool) -> None:
    results = _check(default_config(head_dim), (1, 8, 2, 1024, 1024), head_dim, causal, "bf16", runs=3)
    for dq, dk, dv in results[1:]:   # dK and dV never race: identical run to run
        assert torch.equal(dk, results[0][1]) and torch.equal(dv, results[0][2])


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_separate_dq_is_bit_identical_across_runs(head_dim: int, causal: bool) -> None:
    results = _check(default_config(head_dim, deterministic_dq=True), (2, 8, 2, 1024, 1024), head_dim, causal, "fp16", runs=3)
    for run in results[1:]:
        for ours, first in zip(run, results[0]):
            assert torch.equal(ours, first)


@pytest.mark.parametrize("deterministic", (False, True))
def test_strided_inputs(deterministic: bool) -> None:
    """(B, S, H, D) storage: head and sequence strides differ from the dense layout."""
    _check(default_config(64, deterministic_dq=deterministic), (2, 4, 2, 200, 300), 64, True, "fp16", transposed=True)


def test_attention_backward_entry_point_matches_the_kernel() -> None:
    from evoengineer.gpu.backward import attention_backward, attention_forward_lse

    q, k, v, do = _inputs((1, 4, 2, 333, 333), 128, "bf16", 5)
    o, lse = attention_forward_lse(q, k, v, causal=True)
    a = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True)
    b = attention_backward(q, k, v, o, lse, do, causal=True, config=default_config(128, deterministic_dq=True))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
