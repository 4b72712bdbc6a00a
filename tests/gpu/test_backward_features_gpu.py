"""The backward with a sliding window and soft-capping on the GPU (SOFTCAP=1 / WINDOW=1; mma path, and on sm_90
every configuration of the wgmma path).

Gradients dq, dk, dv (and the output) of our LSE forward and backward with the call's features
against autograd of the attention written out in fp32 (``gpu.backward.reference_gradients``:
s = q k^T * scale, s = cap * tanh(s / cap), the window and causal mask, softmax, times v) under
flash-attn's rule ``max|g - g32| <= 2 max|g_lowp - g32| + eps`` (g_lowp: the same reference in the
inputs' dtype), into NaN-poisoned outputs and workspaces. Windows several (left, right), with and
without causal, narrower than a tile, and with queries that see no key (their output, dQ and LSE
-inf as the forward writes it, checked apart); soft caps 30 and 50; both together; fp16 and bf16;
grouped-query heads; S = 1, 17, 257, 1000 and seq_q != seq_k. Every dK/dV layout (strips, tiles,
halves) and both dQ modes. Then an exported module: ``attention(..., window_size=, softcap=)`` with
requires_grad and ``.backward()`` (eager, deterministic bit for bit, torch.compile), for the mma
export and, on sm_90, the export of a wgmma forward (whose backward fallback is the wgmma path, its
feature kernels too).

Run: ``python -m pytest -q -m gpu tests/gpu/test_backward_features_gpu.py``
"""
from __future__ import annotations

import itertools

import pytest

from evoengineer.kernels.backward_rules import BACKWARD_CONFIGS, WGMMA_CONFIGS, backward_config
from evoengineer.runtime.features import CallFeatures, allowed_keys
from evoengineer.space import Config

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                       reason="needs a CUDA GPU with sm_80 or newer"),
]

HALVES = backward_config(64, 128, dkdv="halves", dq_mode="separate", dq_block_m=128, dq_block_n=32)
CONFIGS = [  # (head dim, name, configuration): strips and tiles, atomic and separate dQ, every dQ tile width
    (64, "m64n64", BACKWARD_CONFIGS[64]["m64n64"]),
    (64, "m64n64-sep", BACKWARD_CONFIGS[64]["m64n64-sep"]),
    (64, "t128n128", BACKWARD_CONFIGS[64]["t128n128"]),
    (128, "m32n128-sep", BACKWARD_CONFIGS[128]["m32n128-sep"]),
    (128, "t64n128-sep", BACKWARD_CONFIGS[128]["t64n128-sep"]),
    (128, "halves", HALVES),
]
SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (1, 2, 2, 1, 1),
    (2, 2, 2, 17, 17),
    (1, 4, 2, 257, 257),     # grouped-query heads
    (1, 2, 2, 1000, 1000),
    (1, 2, 2, 77, 257),
    (1, 2, 2, 257, 77),      # with a window, queries past S_k + left see no key
]
FEATURES = [  # (causal, window_size or None, softcap or None)
    (False, (0, 0), None),       # each query sees only its own position: narrower than any tile
    (False, (3, 5), None),
    (False, (16, -1), None),
    (False, (-1, 8), None),
    (True, (5, -1), None),
    (True, (0, 0), None),
    (True, (100, 0), None),
    (False, None, 30.0),
    (True, None, 50.0),
    (False, (32, 8), 30.0),
    (True, (20, 0), 50.0),
]
DTYPES = ("fp16", "bf16")


def _dtype(name: str):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _features(window, softcap) -> CallFeatures:
    left, right = window if window is not None else (-1, -1)
    return CallFeatures(left, right, 0.0 if softcap is None else softcap)


def _inputs(shape, head_dim: int, dtype: str, seed: int = 0):
    B, H, H_kv, S_q, S_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads: int, seq: int):
        return torch.randn(B, heads, seq, head_dim, device="cuda", dtype=_dtype(dtype), generator=gen)

    return make(H, S_q), make(H_kv, S_k), make(H_kv, S_k), make(H, S_q)


def _nan(t):
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def _check(config: Config, shape, head_dim: int, dtype: str, causal: bool, features: CallFeatures) -> None:
    from evoengineer.gpu.backward import attention_backward, attention_forward_lse, reference_gradients, rule_check

    q, k, v, do = _inputs(shape, head_dim, dtype)
    B, H, S_q, D = q.shape
    o, lse = attention_forward_lse(q, k, v, causal=causal, out=_nan(q),
                                   lse=torch.full((B, H, S_q), float("nan"), device="cuda"), features=features)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=causal, config=config, features=features,
                                    dq=_nan(q), dk=_nan(k), dv=_nan(v),
                                    dsum=torch.full((B * H * S_q,), float("nan"), device="cuda"),
                                    dq_accum=torch.full((B * H * S_q * D,), float("nan"), device="cuda"))
    o32, *g32 = reference_gradients(q, k, v, do, causal, None, features, torch.float32)
    olp, *glp = reference_gradients(q, k, v, do, causal, None, features)
    checks = [rule_check("o", o, o32, olp)] + [rule_check(n, ours, ref, lowp) for n, ours, ref, lowp
                                               in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, glp)]
    failed = [str(c) for c in checks if not c.ok]
    assert not failed, f"{config.short_label()} {shape} D{head_dim} {dtype} causal={causal} {features}: {failed}"
    # a query that sees no key: out 0, LSE -inf (as the forward writes it), dQ 0, no NaN anywhere
    blind = ~allowed_keys(1, S_q, k.shape[2], causal, features, device="cuda")[0, 0].any(dim=-1)
    if bool(blind.any()):
        assert bool((o[:, :, blind] == 0).all()) and bool((dq[:, :, blind] == 0).all())
        assert bool(torch.isneginf(lse[:, :, blind]).all())
    assert all(bool(torch.isfinite(t).all()) for t in (o, dq, dk, dv))


@pytest.mark.parametrize("causal,window,softcap", FEATURES, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_configs_match_fp32_autograd_with_features(shape, dtype: str, causal: bool, window, softcap) -> None:
    from evoengineer.kernels.backward_rules import default_config

    features = _features(window, softcap)
    for head_dim in (64, 128):
        for deterministic in (False, True):
            _check(default_config(head_dim, deterministic_dq=deterministic), shape, head_dim, dtype, causal, features)


@pytest.mark.parametrize("causal,window,softcap", FEATURES, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim,name,config", CONFIGS, ids=lambda x: x if isinstance(x, str) else None)
def test_every_layout_and_dq_mode_matches_fp32_autograd_with_features(head_dim: int, name: str, config: Config,
                                                                      causal: bool, window, softcap) -> None:
    features = _features(window, softcap)
    for shape, dtype in itertools.product(((1, 4, 2, 257, 257), (1, 2, 2, 257, 77), (2, 2, 2, 17, 17)), DTYPES):
        _check(config, shape, head_dim, dtype, causal, features)


WGMMA = [(d, name, config) for d, named in WGMMA_CONFIGS.items() for name, config in named.items()]
HOPPER = pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="the wgmma backward needs an sm_90 GPU (H100, H200)")


@HOPPER
@pytest.mark.parametrize("causal,window,softcap", FEATURES, ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim,name,config", WGMMA, ids=lambda x: x if isinstance(x, str) else None)
def test_every_wgmma_configuration_matches_fp32_autograd_with_features(head_dim: int, name: str, config: Config,
                                                                       causal: bool, window, softcap) -> None:
    features = _features(window, softcap)
    for shape, dtype in itertools.product(SHAPES[1:], DTYPES):
        _check(config, shape, head_dim, dtype, causal, features)


def test_a_window_that_covers_everything_gives_the_plain_gradients() -> None:
    """window (S, S) and a cap of 0 take the feature kernels' branches with nothing masked or capped:
    the output, LSE and gradients are the plain kernels' (to rounding)."""
    from evoengineer.gpu.backward import attention_backward, attention_forward_lse
    from evoengineer.kernels.backward_rules import default_config

    q, k, v, do = _inputs((1, 4, 2, 300, 300), 64, "bf16", seed=3)
    config = default_config(64, deterministic_dq=True)
    o, lse = attention_forward_lse(q, k, v, causal=False)
    plain = attention_backward(q, k, v, o, lse, do, config=config)
    wide = CallFeatures(300, 300, 0.0)
    o2, lse2 = attention_forward_lse(q, k, v, causal=False, features=wide)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(lse2, lse)
    for a, b in zip(plain, attention_backward(q, k, v, o2, lse2, do, config=config, features=wide)):
        torch.testing.assert_close(b, a)


# -- through an exported module ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    from test_export_backward_gpu import FORWARD, _export

    return _export(tmp_path_factory.mktemp("export_bwd_features_gpu"), FORWARD, "sm_90", "evo_attention_train_features")


@pytest.fixture(scope="module")
def wgmma_module(tmp_path_factory: pytest.TempPathFactory):
    from test_export_backward_gpu import WGMMA_FORWARD, _export

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward needs an sm_90 GPU (H100, H200)")
    return _export(tmp_path_factory.mktemp("export_bwd_features_wgmma"), WGMMA_FORWARD, "sm_90a",
                   "evo_attention_train_features_wgmma")


@pytest.fixture(params=["mma", "wgmma"])
def either_module(request):
    return request.getfixturevalue({"mma": "module", "wgmma": "wgmma_module"}[request.param])


def _module_grads(module, q, k, v, do, causal: bool, window, softcap, deterministic: bool = False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], deterministic=deterministic,
                           window_size=window, softcap=softcap)
    out.backward(do)
    return out.detach(), *(t.grad for t in leaves)


EXPORT_CASES = [  # (B, H, H_kv, S_q, S_k, D, dtype, causal, window, softcap)
    (2, 8, 2, 257, 257, 64, "fp16", True, (64, 0), None),
    (1, 8, 8, 1000, 1000, 128, "bf16", False, (100, 30), 30.0),
    (1, 4, 2, 300, 77, 64, "bf16", False, (10, 10), None),        # queries past 87 see no key
    (2, 4, 4, 17, 17, 128, "fp16", True, None, 50.0),
    (1, 8, 2, 1, 1, 64, "fp16", False, (0, 0), 30.0),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_an_exported_module_trains_with_a_window_and_a_soft_cap(either_module, case) -> None:
    from evoengineer.gpu.backward import reference_gradients, rule_check

    b, h, hkv, sq, sk, d, dtype, causal, window, softcap = case
    q, k, v, do = _inputs((b, h, hkv, sq, sk), d, dtype, seed=1)
    features = _features(window, softcap)
    o32, *g32 = reference_gradients(q, k, v, do, causal, None, features, torch.float32)
    olp, *glp = reference_gradients(q, k, v, do, causal, None, features)
    for deterministic in (False, True):
        out, dq, dk, dv = _module_grads(either_module, q, k, v, do, causal, window, softcap, deterministic)
        checks = [rule_check("o", out, o32, olp)] + [rule_check(n, ours, ref, lowp) for n, ours, ref, lowp
                                                     in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, glp)]
        failed = [str(c) for c in checks if not c.ok]
        assert not failed, f"{case} deterministic={deterministic}: {failed}"
    again = _module_grads(either_module, q, k, v, do, causal, window, softcap, True)
    for a, b2 in zip(_module_grads(either_module, q, k, v, do, causal, window, softcap, True), again):
        assert torch.equal(a, b2)   # the deterministic feature backward, bit for bit
    assert either_module.fallback_counts() == {}
    plan = either_module.explain_backward(q, k, v, is_causal=causal, enable_gqa=h != hkv, window_size=window,
                                          softcap=softcap)
    assert set(plan["features"]) == {"seqlens", "softcap", "window"}   # the feature kernels hold every switch


def test_torch_compile_trains_with_a_window_and_a_soft_cap(module) -> None:
    from evoengineer.gpu.backward import reference_gradients, rule_check

    q, k, v, do = _inputs((1, 8, 2, 257, 257), 64, "bf16", seed=2)
    features = CallFeatures(48, 0, 30.0)
    step = torch.compile(lambda q, k, v: module.attention(q, k, v, True, None, True, window_size=(48, 0), softcap=30.0),
                         fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward(do)
    _, *g32 = reference_gradients(q, k, v, do, True, None, features, torch.float32)
    _, *glp = reference_gradients(q, k, v, do, True, None, features)
    for name, leaf, ref, lowp in zip(("dq", "dk", "dv"), leaves, g32, glp):
        check = rule_check(name, leaf.grad, ref, lowp)
        assert check.ok, str(check)


def test_per_batch_key_ranges_with_a_gradient_run_the_kernels_not_the_fallback(module) -> None:
    """Padded batches train through the seqlens backward (tests/gpu/test_backward_seqlens_gpu.py checks
    their gradients): with fallback='sdpa' nothing falls back."""
    q, k, v, do = _inputs((2, 4, 4, 64, 64), 64, "fp16")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lengths = torch.tensor([40, 64], dtype=torch.int32, device="cuda")
    module.fallback_counts(reset=True)
    module.attention(*leaves, seqlens_k=lengths, window_size=(8, 8), fallback="sdpa").backward(do)
    assert all(t.grad is not None for t in leaves) and module.fallback_counts() == {}
    assert bool((leaves[1].grad[0, :, 40:] == 0).all()) and bool((leaves[2].grad[0, :, 40:] == 0).all())
