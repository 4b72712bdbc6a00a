"""The backward with per-batch key ranges and query lengths on the GPU (SEQLENS=1; mma path, and on sm_90
every configuration of the wgmma path): padded batches train.

Gradients dq, dk, dv (and the output) of our LSE forward and backward with ``seqlens_k``,
``leftpad_k``, ``seqlens_q`` against autograd of the attention written out in fp32 with the
equivalent explicit boolean mask (``gpu.backward.reference_gradients``, whose mask is
``features.allowed_keys``: the forward's semantics, top-left causal) under flash-attn's rule
``max|g - g32| <= 2 max|g_lowp - g32| + eps``, into NaN-poisoned outputs and workspaces. Right
padding (seqlens_k and seqlens_q), left padding (leftpad_k), both sides, key ranges alone, query
lengths alone; lengths 1 and 0 (a batch with no key), S = 333, seq_q != seq_k, grouped-query heads,
causal or not, with and without a window; fp16 and bf16; every dK/dV layout and both dQ modes.
Rows that see no key (past seqlens_q, or before leftpad_k under causal) get exactly zero dQ and
output and an LSE of -inf, keys no row sees exactly zero dK and dV. Then an exported module:
``attention(..., seqlens_k=, leftpad_k=, seqlens_q=)`` with requires_grad (eager, deterministic bit
for bit, torch.compile), and a small Llama trained through ``register_hf`` on left- and
right-padded batches against SDPA.

Run: ``python -m pytest -q -m gpu tests/gpu/test_backward_seqlens_gpu.py``
"""
from __future__ import annotations

import itertools

import pytest

from evoengineer.kernels.backward_rules import WGMMA_CONFIGS, backward_config
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

DTYPES = ("fp16", "bf16")
RANGES = [  # (name, (B, H, H_kv, S_q, S_k), seqlens_k, leftpad_k, seqlens_q); None: not passed
    ("right", (4, 4, 2, 333, 333), [333, 1, 0, 200], None, [333, 1, 0, 200]),     # right padding, one batch keyless
    ("left", (4, 4, 2, 333, 333), None, [0, 332, 333, 133], None),                # left padding, one batch keyless
    ("keys", (3, 2, 2, 77, 257), [257, 100, 5], None, None),                       # key ranges alone, S_q != S_k
    ("both", (3, 4, 4, 257, 257), [200, 257, 64], [10, 100, 63], [150, 257, 1]),   # both sides, one key left
    ("queries", (2, 2, 1, 300, 300), None, None, [17, 300]),                       # query lengths alone
    ("short-q", (2, 4, 2, 200, 77), [77, 40], [0, 3], [200, 150]),                 # S_q > S_k
    ("tiny", (2, 2, 2, 1, 1), [1, 0], None, [1, 1]),
]
WINDOWS = [None, (32, 8)]


def _dtype(name: str):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _ranges(case) -> dict:
    _, (B, *_), seqlens_k, leftpad_k, seqlens_q = case
    as_tensor = (lambda x: None if x is None else torch.tensor(x, dtype=torch.int32, device="cuda"))
    return {"seqlens_k": as_tensor(seqlens_k), "leftpad_k": as_tensor(leftpad_k), "seqlens_q": as_tensor(seqlens_q)}


def _inputs(shape, head_dim: int, dtype: str, seed: int = 0):
    B, H, H_kv, S_q, S_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads: int, seq: int):
        return torch.randn(B, heads, seq, head_dim, device="cuda", dtype=_dtype(dtype), generator=gen)

    return make(H, S_q), make(H_kv, S_k), make(H_kv, S_k), make(H, S_q)


def _nan(t):
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def _features(window) -> CallFeatures:
    left, right = window if window is not None else (-1, -1)
    return CallFeatures(left, right, 0.0, seqlens=True)


def _check_zeros(q, k, o, dq, dk, dv, causal: bool, features: CallFeatures, ranges: dict, lse=None) -> None:
    """Rows that see no key: output 0, dQ 0, LSE -inf (where given); keys no row sees: dK and dV 0
    (exactly); nothing NaN or infinite."""
    B, H, S_q, _ = q.shape
    S_k = k.shape[2]
    allowed = allowed_keys(B, S_q, S_k, causal, features, ranges["seqlens_k"], ranges["leftpad_k"], "cuda",
                           seqlens_q=ranges["seqlens_q"])[:, 0]   # (B, S_q, S_k)
    blind = ~allowed.any(dim=-1)      # (B, S_q)
    unseen = ~allowed.any(dim=-2)     # (B, S_k)
    for b in range(B):
        rows, keys = blind[b], unseen[b]
        if bool(rows.any()):
            assert bool((o[b][:, rows] == 0).all()) and bool((dq[b][:, rows] == 0).all()), f"batch {b}: rows that see no key"
            assert lse is None or bool(torch.isneginf(lse[b][:, rows]).all()), f"batch {b}: their LSE"
        if bool(keys.any()):
            assert bool((dk[b][:, keys] == 0).all()) and bool((dv[b][:, keys] == 0).all()), f"batch {b}: keys no row sees"
    assert all(bool(torch.isfinite(t).all()) for t in (o, dq, dk, dv))


def _check(config: Config, case, head_dim: int, dtype: str, causal: bool, window) -> None:
    from evoengineer.gpu.backward import attention_backward, attention_forward_lse, reference_gradients, rule_check

    name, shape, *_ = case
    ranges = _ranges(case)
    features = _features(window)
    q, k, v, do = _inputs(shape, head_dim, dtype)
    B, H, S_q, D = q.shape
    o, lse = attention_forward_lse(q, k, v, causal=causal, out=_nan(q),
                                   lse=torch.full((B, H, S_q), float("nan"), device="cuda"), features=features, **ranges)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=causal, config=config, features=features,
                                    dq=_nan(q), dk=_nan(k), dv=_nan(v),
                                    dsum=torch.full((B * H * S_q,), float("nan"), device="cuda"),
                                    dq_accum=torch.full((B * H * S_q * D,), float("nan"), device="cuda"), **ranges)
    o32, *g32 = reference_gradients(q, k, v, do, causal, None, features, torch.float32, **ranges)
    olp, *glp = reference_gradients(q, k, v, do, causal, None, features, **ranges)
    checks = [rule_check("o", o, o32, olp)] + [rule_check(n, ours, ref, lowp) for n, ours, ref, lowp
                                               in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, glp)]
    failed = [str(c) for c in checks if not c.ok]
    assert not failed, f"{config.short_label()} {name} {shape} D{head_dim} {dtype} causal={causal} window={window}: {failed}"
    _check_zeros(q, k, o, dq, dk, dv, causal, features, ranges, lse)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", RANGES, ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_configs_match_fp32_autograd_on_padded_batches(case, dtype: str, causal: bool, window) -> None:
    from evoengineer.kernels.backward_rules import default_config

    for head_dim in (64, 128):
        for deterministic in (False, True):
            _check(default_config(head_dim, deterministic_dq=deterministic), case, head_dim, dtype, causal, window)


HALVES = backward_config(64, 128, dkdv="halves", dq_mode="separate", dq_block_m=128, dq_block_n=32)
CONFIGS = [  # (head dim, name, configuration): strips and tiles, atomic and separate dQ, every dQ tile width
    (64, "m64n64", backward_config(64, 64)),
    (64, "m32n128", backward_config(32, 128)),
    (64, "m64n64-st1", backward_config(64, 64, stages=1)),
    (64, "m64n64-sep", backward_config(64, 64, dq_mode="separate")),
    (64, "t128n128", backward_config(128, 128, dkdv="tiles")),
    (128, "m16n64", backward_config(16, 64)),
    (128, "m32n128-sep", backward_config(32, 128, dq_mode="separate", dq_block_n=32)),
    (128, "t64n128-sep", backward_config(64, 128, dkdv="tiles", dq_mode="separate")),
    (128, "halves", HALVES),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,name,config", CONFIGS, ids=lambda x: x if isinstance(x, str) else None)
def test_every_layout_and_dq_mode_matches_fp32_autograd_on_padded_batches(head_dim: int, name: str, config: Config,
                                                                          causal: bool) -> None:
    for case, dtype, window in itertools.product(RANGES[:4] + RANGES[5:6], DTYPES, WINDOWS):
        _check(config, case, head_dim, dtype, causal, window)


WGMMA = [(d, name, config) for d, named in WGMMA_CONFIGS.items() for name, config in named.items()]


@pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the wgmma backward needs an sm_90 GPU (H100, H200)")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,name,config", WGMMA, ids=lambda x: x if isinstance(x, str) else None)
def test_every_wgmma_configuration_matches_fp32_autograd_on_padded_batches(head_dim: int, name: str, config: Config,
                                                                           causal: bool) -> None:
    for case, dtype, window in itertools.product(RANGES, DTYPES, WINDOWS):
        _check(config, case, head_dim, dtype, causal, window)


def test_full_ranges_give_the_plain_gradients() -> None:
    """seqlens_k = seqlens_q = S and leftpad_k = 0 take the seqlens kernels' branches with nothing
    masked: the output, LSE and gradients are the plain kernels' (to rounding)."""
    from evoengineer.gpu.backward import attention_backward, attention_forward_lse
    from evoengineer.kernels.backward_rules import default_config

    q, k, v, do = _inputs((2, 4, 2, 300, 300), 64, "bf16", seed=3)
    full = torch.full((2,), 300, dtype=torch.int32, device="cuda")
    zero = torch.zeros(2, dtype=torch.int32, device="cuda")
    ranges = {"seqlens_k": full, "leftpad_k": zero, "seqlens_q": full}
    for causal in (False, True):
        config = default_config(64, deterministic_dq=True)
        o, lse = attention_forward_lse(q, k, v, causal=causal)
        plain = attention_backward(q, k, v, o, lse, do, causal=causal, config=config)
        o2, lse2 = attention_forward_lse(q, k, v, causal=causal, **ranges)
        torch.testing.assert_close(o2, o)
        torch.testing.assert_close(lse2, lse)
        for a, b in zip(plain, attention_backward(q, k, v, o2, lse2, do, causal=causal, config=config, **ranges)):
            torch.testing.assert_close(b, a)


# -- through an exported module ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    from test_export_backward_gpu import FORWARD, _export

    return _export(tmp_path_factory.mktemp("export_bwd_seqlens_gpu"), FORWARD, "sm_90", "evo_attention_train_seqlens")


@pytest.fixture(scope="module")
def wgmma_module(tmp_path_factory: pytest.TempPathFactory):
    from test_export_backward_gpu import WGMMA_FORWARD, _export

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward needs an sm_90 GPU (H100, H200)")
    return _export(tmp_path_factory.mktemp("export_bwd_seqlens_wgmma"), WGMMA_FORWARD, "sm_90a",
                   "evo_attention_train_seqlens_wgmma")


@pytest.fixture(params=["mma", "wgmma"])
def either_module(request):
    return request.getfixturevalue({"mma": "module", "wgmma": "wgmma_module"}[request.param])


def _module_grads(module, q, k, v, do, causal: bool, window, ranges: dict, deterministic: bool = False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    given = {name: t for name, t in ranges.items() if t is not None}
    out = module.attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], deterministic=deterministic,
                           window_size=window, **given)
    out.backward(do)
    return out.detach(), *(t.grad for t in leaves)


EXPORT_CASES = [  # (range case, D, dtype, causal, window)
    (RANGES[0], 64, "fp16", True, None),
    (RANGES[1], 128, "bf16", True, None),
    (RANGES[1], 64, "bf16", False, None),
    (RANGES[3], 64, "fp16", False, (32, 8)),
    (RANGES[4], 128, "fp16", True, None),
    (RANGES[5], 64, "bf16", False, None),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda c: f"{c[0][0]}-D{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}"
                                                             f"{'-window' if c[4] else ''}")
def test_an_exported_module_trains_on_padded_batches(either_module, case) -> None:
    from evoengineer.gpu.backward import reference_gradients, rule_check

    ranges_case, d, dtype, causal, window = case
    _, shape, *_ = ranges_case
    ranges = _ranges(ranges_case)
    features = _features(window)
    q, k, v, do = _inputs(shape, d, dtype, seed=1)
    either_module.fallback_counts(reset=True)
    o32, *g32 = reference_gradients(q, k, v, do, causal, None, features, torch.float32, **ranges)
    olp, *glp = reference_gradients(q, k, v, do, causal, None, features, **ranges)
    for deterministic in (False, True):
        out, dq, dk, dv = _module_grads(either_module, q, k, v, do, causal, window, ranges, deterministic)
        checks = [rule_check("o", out, o32, olp)] + [rule_check(n, ours, ref, lowp) for n, ours, ref, lowp
                                                     in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, glp)]
        failed = [str(c) for c in checks if not c.ok]
        assert not failed, f"{ranges_case[0]} D{d} {dtype} causal={causal} deterministic={deterministic}: {failed}"
        _check_zeros(q, k, out, dq, dk, dv, causal, features, ranges)
    again = _module_grads(either_module, q, k, v, do, causal, window, ranges, True)
    for a, b in zip(_module_grads(either_module, q, k, v, do, causal, window, ranges, True), again):
        assert torch.equal(a, b)   # the deterministic seqlens backward, bit for bit
    assert either_module.fallback_counts() == {}
    given = {name: t for name, t in ranges.items() if t is not None}
    plan = either_module.explain_backward(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1],
                                          window_size=window, **given)
    assert "seqlens" in plan["features"]


def test_torch_compile_trains_on_a_padded_batch(module) -> None:
    from evoengineer.gpu.backward import reference_gradients, rule_check

    case = RANGES[3]
    ranges = _ranges(case)
    q, k, v, do = _inputs(case[1], 64, "bf16", seed=2)
    step = torch.compile(lambda q, k, v, hi, lo, n: module.attention(q, k, v, True, None, False, seqlens_k=hi,
                                                                     leftpad_k=lo, seqlens_q=n), fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*leaves, ranges["seqlens_k"], ranges["leftpad_k"], ranges["seqlens_q"]).backward(do)
    features = _features(None)
    _, *g32 = reference_gradients(q, k, v, do, True, None, features, torch.float32, **ranges)
    _, *glp = reference_gradients(q, k, v, do, True, None, features, **ranges)
    for name, leaf, ref, lowp in zip(("dq", "dk", "dv"), leaves, g32, glp):
        check = rule_check(name, leaf.grad, ref, lowp)
        assert check.ok, str(check)
    # other lengths, same shapes: the same compiled graph, the new lengths read per call
    other = {name: t.flip(0).contiguous() for name, t in ranges.items()}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*leaves, other["seqlens_k"], other["leftpad_k"], other["seqlens_q"]).backward(do)
    _, *g32 = reference_gradients(q, k, v, do, True, None, features, torch.float32, **other)
    _, *glp = reference_gradients(q, k, v, do, True, None, features, **other)
    for name, leaf, ref, lowp in zip(("dq", "dk", "dv"), leaves, g32, glp):
        check = rule_check(name, leaf.grad, ref, lowp)
        assert check.ok, str(check)


PACKED = [  # (lengths_q, lengths_k, heads, heads_kv, D, dtype, causal, window, softcap)
    ([1, 17, 1000, 4099], None, 8, 2, 128, "bf16", True, (-1, -1), 0.0),    # the lengths, grouped heads
    ([1, 17, 1000, 4099], None, 4, 4, 64, "fp16", False, (-1, -1), 0.0),
    ([300, 0, 77, 129], [500, 40, 77, 64], 4, 2, 64, "bf16", True, (-1, -1), 0.0),   # L_q != L_k both ways, no query
    ([200, 333, 5], None, 4, 2, 128, "fp16", True, (64, -1), 30.0),                # a window and a soft cap
]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"{len(c[0])}seq-D{c[4]}-{c[5]}{'-causal' if c[6] else ''}"
                                                       f"{'-window' if c[7][0] >= 0 else ''}")
def test_packed_sequences_train_through_the_padded_batch(either_module, case) -> None:
    """attention_varlen with requires_grad: output and gradients against the per-sequence fp32 reference
    (bottom-right alignment) under flash-attn's rule, through the export's padded-batch kernels (no fallback)."""
    from evoengineer.gpu.backward import rule_check
    from evoengineer.runtime.varlen import reference_varlen, varlen_features

    lengths_q, lengths_k, heads, heads_kv, d, dtype, causal, window, softcap = case
    lengths_k = lengths_k or lengths_q
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lengths_q), heads, d, device="cuda", dtype=_dtype(dtype), generator=gen)
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, device="cuda", dtype=_dtype(dtype), generator=gen) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=_dtype(dtype), generator=gen)
    offsets = [[0, *itertools.accumulate(n)] for n in (lengths_q, lengths_k)]
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device="cuda") for o in offsets)
    features = varlen_features(window, softcap)
    either_module.fallback_counts(reset=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = either_module.attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=causal,
                                         window_size=window, softcap=softcap)
    out.backward(do)
    refs = []
    for ref_dtype in (torch.float32, q.dtype):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref = reference_varlen(*ref_leaves, *offsets, causal, None, features)
        ref.backward(do.to(ref_dtype))
        refs.append((ref.detach(), *(t.grad for t in ref_leaves)))
    assert all(bool(torch.isfinite(t).all()) for t in refs[0])
    # SDPA's low-precision backward can leave NaN in the gradient of a row that sees no key (the reference
    # zeroes that row's output after SDPA): the baseline takes the fp32 value there (0)
    lowps = [torch.where(torch.isfinite(lowp), lowp.float(), ref) for lowp, ref in zip(refs[1], refs[0])]
    checks = [rule_check(name, ours, ref, lowp) for name, ours, ref, lowp
              in zip(("o", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in leaves)), refs[0], lowps)]
    failed = [str(c) for c in checks if not c.ok]
    assert not failed, f"{case}: {failed}"
    assert either_module.fallback_counts() == {}


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_small_llama_trains_on_padded_batches_through_register_hf_as_through_sdpa(module, padding: str) -> None:
    pytest.importorskip("transformers")
    from test_attention_features_cpu import left_padded, right_padded
    from transformers import LlamaConfig, LlamaForCausalLM

    module.register_hf("evo_train_padded")
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.05,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randint(3, 512, (4, 128), device="cuda", generator=gen)   # one batch, learnt over 5 steps
    lengths = [128, 100, 37, 1]
    mask = (left_padded if padding == "left" else right_padded)(lengths, 128).cuda()
    data = data.masked_fill(mask == 0, 0)
    labels = data.masked_fill(mask == 0, -100)
    losses, first_grads = {}, {}
    module.fallback_counts(reset=True)
    for implementation in ("sdpa", "evo_train_padded"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        model.set_attn_implementation(implementation)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        losses[implementation] = []
        for _ in range(5):
            loss = model(data, attention_mask=mask, labels=labels).loss
            loss.backward()
            if not losses[implementation]:
                first_grads[implementation] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[implementation].append(loss.item())
    # the same first step (the same model and batch): loss and every parameter's gradient as SDPA's; later
    # steps part by bf16 rounding, amplified by the optimizer, so only the trajectory's end is compared
    ref, ours = losses["sdpa"], losses["evo_train_padded"]
    assert abs(ours[0] - ref[0]) <= 0.005 * ref[0], f"{padding}: first loss {ours[0]:.4f} vs SDPA {ref[0]:.4f}"
    cosine = torch.nn.functional.cosine_similarity(first_grads["sdpa"], first_grads["evo_train_padded"], dim=0).item()
    assert cosine > 0.99, f"{padding}: first gradients' cosine similarity to SDPA's {cosine:.4f}"
    assert abs(ours[-1] - ref[-1]) <= 0.05 * ref[-1] + 0.02, f"{padding}: losses {ours} vs SDPA {ref}"
    assert losses["evo_train_padded"][-1] < 0.9 * losses["evo_train_padded"][0]   # it learns the batch
    assert module.fallback_counts() == {}
