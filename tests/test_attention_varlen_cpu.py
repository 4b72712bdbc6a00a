"""Packed variable-length sequences without a GPU: the mma template's VARLEN switch (render, NVRTC
compiles for sm_80 and sm_90 without spills, kernels without it render as before), the export's
varlen kernels, the argument checks of ``attention_varlen``, its SDPA-per-sequence fallback
(bottom-right causal and window, empty sequences, gradients), and the op's fake implementation
under FakeTensorMode and torch.compile."""
from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as TF
from run_fixtures import MMA, WMMA, load_module, make_run, space_doc
from torch._subclasses.fake_tensor import FakeTensorMode

from evoengineer.kernels import build_config, render
from evoengineer.results import export_runs
from evoengineer.runtime import features as F
from evoengineer.runtime import varlen as V
from evoengineer.space import Config, Variant

BASE = {"PATH": "mma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8}

# sha256 (first 16 hex digits) of renders with the other switches, made before VARLEN existed
# (seqlens: since it takes seqlens_q): without it those kernels must stay exactly these
BEFORE_VARLEN = {
    ((), 64, True, "fp16", ("seqlens", "softcap", "window")): "6f6255f29b14c8f6",
    ((("SPLITS", 2), ("PACK_GQA", 1)), 128, False, "bf16", ("seqlens", "softcap", "window")): "af5608dd337ef3f8",
    ((("KV_GROUPS", 2), ("WARPS", 8)), 64, True, "fp16", ("seqlens",)): "cf1521745618d641",
    ((), 128, False, "bf16", ("window",)): "0672d3b9fbd9e046",
    ((("STAGES", 1), ("Q_IN_REGS", 0)), 64, True, "fp16", ("softcap",)): "ba453402e0f09fd5",
}


@pytest.mark.parametrize("key", list(BEFORE_VARLEN), ids=lambda k: f"{dict(k[0])}-D{k[1]}-{'-'.join(k[4])}")
def test_without_the_varlen_switch_the_mma_kernel_renders_as_before(key) -> None:
    params, head_dim, causal, dtype, features = key
    source = render("flash_attention", Config({**BASE, **dict(params)}), Variant(head_dim, causal, dtype, features)).source
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == BEFORE_VARLEN[key]
    assert "cu_seqlens" not in source and "len_q" not in source and "shift" not in source


def test_the_varlen_switch_adds_its_offsets_between_softcap_and_window() -> None:
    rendered = render("flash_attention", Config(BASE), Variant(64, True, "fp16", ("varlen",)))
    assert "// FEATURES varlen" in rendered.source and rendered.features == ("varlen",)
    assert rendered.arguments[-2:] == [("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")]
    every = render("flash_attention", Config({**BASE, "SPLITS": 2}), Variant(64, False, "bf16", F.SWITCHES))
    assert "// FEATURES seqlens softcap varlen window" in every.source
    for kernel in ("attn_fwd", "attn_combine"):   # both launches take the same arguments
        signature = next(line for line in every.source.splitlines() if f" {kernel}(" in line)
        assert signature.rstrip(") {").endswith("float scale_log2, const int* seqlens_k, const int* leftpad_k, "
                                                "const int* seqlens_q, float softcap, const int* cu_seqlens_q, "
                                                "const int* cu_seqlens_k, int window_left, int window_right")
    assert [name for name, _ in every.arguments[-8:]] == ["seqlens_k", "leftpad_k", "seqlens_q", "softcap", "cu_seqlens_q",
                                                          "cu_seqlens_k", "window_left", "window_right"]
    with pytest.raises(ValueError, match="THE_PATH_DOES_NOT_HOLD_A_FEATURE_ASKED"):
        render("flash_attention", Config({**BASE, "PATH": "wmma"}), Variant(64, False, "fp16", ("varlen",)))


COMPILED = [
    (Config(BASE), Variant(64, True, "fp16", ("varlen",))),
    (Config(BASE), Variant(128, False, "bf16", ("varlen",))),
    (MMA, Variant(128, True, "fp16", F.SWITCHES)),   # the fixtures' fallback: every export's kernel with every feature
    (Config({**BASE, "BLOCK_N": 128, "SPLITS": 2, "PACK_GQA": 1}), Variant(128, False, "bf16", F.SWITCHES)),
    (Config({**BASE, "BLOCK_M": 32, "WARPS": 8, "KV_GROUPS": 4, "STAGES": 1}), Variant(64, True, "fp16", F.SWITCHES)),
    (Config({**BASE, "BLOCK_M": 128, "WARPS": 8, "STAGES": 3}), Variant(128, True, "bf16", ("varlen", "window"))),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("config, variant", COMPILED, ids=lambda x: x.label() if hasattr(x, "label") else str(x))
def test_varlen_kernels_compile_without_spills(arch: str, config: Config, variant: Variant) -> None:
    report = build_config("flash_attention", config, [variant], arch)
    assert not report.error, report.error
    assert report.spill_bytes == 0, report.builds[0].compiled.kernels
    assert report.smem == build_config("flash_attention", config, [Variant(variant.head_dim, variant.causal, variant.dtype)],
                                       arch).smem  # no shared memory added


# -- an export ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("varlen")
    doc = space_doc()
    doc["problem"]["dtype"] = ["fp16", "bf16"]
    export_runs([make_run(root / "run", space=doc)], root / "out")   # MMA: the fallback, SPLIT: the decode winner
    return load_module(root / "out")


def test_every_variant_of_an_export_has_a_varlen_kernel(module) -> None:
    varlen = {key[:3]: spec for key, spec in module.KERNELS.items() if len(key) == 5 and "varlen" in key[4]}
    assert set(varlen) == {(dtype, d, c) for dtype in ("fp16", "bf16") for d in (64, 128) for c in (False, True)}
    for spec in varlen.values():
        assert [tuple(a) for a in spec["args"][-4:-2]] == [("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")]
        assert "varlen" in spec["features"] and "gqa" in spec["features"]
    data = module._export.data
    chosen = F.select_kernel(data.kernels, ("bf16", 128, True), WMMA.key(), data.fallback, ("varlen",))
    assert chosen.config == MMA.key() and "varlen" in chosen.switches
    assert module.attention_varlen_op is getattr(torch.ops, module.OP_NAMESPACE).attention_varlen.default


# -- the argument checks --------------------------------------------------------------------------------


def packed(lengths_q: list[int], lengths_k: list[int], heads: int = 4, heads_kv: int = 2, head_dim: int = 64,
           dtype: torch.dtype = torch.float16, seed: int = 0, device: str = "cpu"):
    """Packed q, k, v and int32 offsets of sequences with these lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, generator=gen).to(device=device, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def _error(module, *args, exception=ValueError, **kwargs) -> str:
    with pytest.raises(exception) as err:
        module.attention_varlen(*args, **kwargs)
    message = str(err.value)
    assert message.startswith("attention_varlen: ") and "\n" not in message, message
    return message


def test_malformed_calls_are_refused_in_one_line(module) -> None:
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6])
    good = (q, k, v, cu_q, cu_k, 5, 6)
    assert "must be an int32 tensor of shape (batch + 1,), got torch.int64 (3,)" in _error(
        module, q, k, v, cu_q.long(), cu_k, 5, 6)
    assert "cu_seqlens_k must be an int32 tensor of shape (batch + 1,), got torch.int32 (1, 3)" in _error(
        module, q, k, v, cu_q, cu_k.view(1, 3), 5, 6)
    assert "must have one length (batch + 1), got 3 and 4" in _error(
        module, q, k, v, cu_q, torch.tensor([0, 4, 6, 10], dtype=torch.int32), 5, 6)
    assert "cu_seqlens_q must be on q's device cpu, got meta" in _error(module, q, k, v, cu_q.to("meta"), cu_k, 5, 6)
    assert "q must be 3-D (total_tokens, heads, head_dim)" in _error(module, q[None], k, v, cu_q, cu_k, 5, 6)
    assert "must be a multiple of k and v's heads (3)" in _error(
        module, q, k[:, :1].expand(10, 3, 64), v[:, :1].expand(10, 3, 64), cu_q, cu_k, 5, 6)
    assert "k and v must have one shape" in _error(module, q, k, v[:9], cu_q, cu_k, 5, 6)
    assert "max_seqlen_q must be an int, got Tensor" in _error(module, q, k, v, cu_q, cu_k, torch.tensor(5), 6,
                                                               exception=TypeError)
    assert "max_seqlen_k must be >= 0" in _error(module, q, k, v, cu_q, cu_k, 5, -1)
    assert "scale must be positive" in _error(module, *good, scale=0.0)
    assert "cu_seqlens_q must be a torch.Tensor, got list" in _error(module, q, k, v, [0, 3, 8], cu_k, 5, 6,
                                                                     exception=TypeError)
    # well-formed, but no kernel runs on the CPU: what the fallback serves
    assert "q, k and v must be CUDA tensors, got device cpu" in _error(module, *good)


@pytest.mark.parametrize("offsets, maxima, words", [
    (([0, 5, 3], [0, 4, 10]), (5, 6), "cu_seqlens_q must start at 0 and not decrease, got [0, 5, 3]"),
    (([1, 3, 8], [0, 4, 10]), (5, 6), "cu_seqlens_q must start at 0"),
    (([0, 3, 8], [0, 4, 9]), (5, 6), "cu_seqlens_k ends at 9 but k holds 10 tokens"),
    (([0, 3, 7], [0, 4, 10]), (5, 6), "cu_seqlens_q ends at 7 but q holds 8 tokens"),
    (([0, 3, 8], [0, 4, 10]), (4, 6), "sequence 1 has 5 queries, more than max_seqlen_q = 4"),
    (([0, 3, 8], [0, 4, 10]), (5, 5), "sequence 1 has 6 keys, more than max_seqlen_k = 5"),
])
def test_offsets_that_do_not_fit_the_tensors_are_refused_before_anything_runs(module, offsets, maxima, words) -> None:
    q, k, v, _, _ = packed([3, 5], [4, 6])
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32) for o in offsets)
    module.fallback_counts(reset=True)
    assert words in _error(module, q, k, v, cu_q, cu_k, *maxima, fallback="sdpa")
    assert module.fallback_counts() == {}


def test_offsets_written_in_place_after_a_call_are_checked_again(module) -> None:
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6])
    module.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, fallback="sdpa")
    cu_q[1] = 6   # the same tensor written through torch: sequences of 6 and 2 queries now
    module.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, fallback="sdpa")
    cu_q[2] = 7
    assert "cu_seqlens_q ends at 7 but q holds 8 tokens" in _error(module, q, k, v, cu_q, cu_k, 6, 6, fallback="sdpa")
    with torch.inference_mode():
        frozen_q = torch.tensor([0, 6, 8], dtype=torch.int32)
        module.attention_varlen(q, k, v, frozen_q, cu_k, 6, 6, fallback="sdpa")
        frozen_q[2] = 7   # inference tensors keep no version counter: read again on every call
        assert "ends at 7" in _error(module, q, k, v, frozen_q, cu_k, 6, 6, fallback="sdpa")


def test_a_pair_of_offsets_is_read_once_while_torch_sees_neither_written() -> None:
    checked = V.CheckedOffsets()
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    first = checked.get(cu_q, cu_k, 8, 10, 5, 6)
    assert first == ([0, 3, 8], [0, 4, 10])
    assert checked.get(cu_q, cu_k, 8, 10, 5, 6) is first                  # reused, not read again
    assert checked.get(cu_q.clone(), cu_k, 8, 10, 5, 6) is not first      # another tensor: read
    with pytest.raises(ValueError, match="more than max_seqlen_q = 4"):
        checked.get(cu_q, cu_k, 8, 10, 4, 6)                              # other maxima: checked again
    cu_k.add_(0)                                                          # a write through torch
    again = checked.get(cu_q, cu_k, 8, 10, 5, 6)
    assert again == first and again is not first
    pairs = [(torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32))
             for _ in range(V.CheckedOffsets.SIZE)]
    for pair in pairs:
        checked.get(*pair, 8, 10, 8, 10)
    assert checked.get(cu_q, cu_k, 8, 10, 5, 6) is not again              # the oldest pairs make room
    assert checked.get(*pairs[-1], 8, 10, 8, 10) == ([0, 8], [0, 10])


# -- the fallback and the reference ----------------------------------------------------------------------


def bottom_right(lq: int, lk: int, causal: bool, left: int = -1, right: int = -1) -> torch.Tensor:
    """flash-attn's varlen mask, written out: query i sees key j where j <= i + lk - lq (causal)
    and i + lk - lq - left <= j <= i + lk - lq + right (window)."""
    i = torch.arange(lq).view(lq, 1) + (lk - lq)
    j = torch.arange(lk).view(1, lk)
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0 and not causal:
        allowed &= j <= i + right
    return allowed


def per_sequence(q, k, v, lengths_q, lengths_k, causal: bool, window=(-1, -1), softcap: float = 0.0, scale=None):
    """Each sequence by itself: scores, the bottom-right mask, softmax (fp32), rows with no key 0."""
    out, q0, k0 = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k):
        qs = q[q0:q0 + lq].float().transpose(0, 1)
        ks, vs = (t[k0:k0 + lk].float().transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (k, v))
        scores = qs @ ks.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = bottom_right(lq, lk, causal, *window)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out.append((probs @ vs).transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(out)


CASES = {  # name -> (lengths q, lengths k, causal, window, softcap)
    "causal-equal": ([1, 17, 0, 40], [1, 17, 0, 40], True, (-1, -1), 0.0),
    "causal-fewer-queries": ([3, 17, 5], [20, 17, 9], True, (-1, -1), 0.0),   # chunked prefill, decode
    "causal-more-queries": ([9, 4], [5, 4], True, (-1, -1), 0.0),             # early queries see no key
    "full": ([7, 0, 12], [30, 4, 12], False, (-1, -1), 0.0),
    "no-keys": ([4, 6], [0, 6], False, (-1, -1), 0.0),
    "window": ([20, 13], [25, 13], False, (4, 2), 0.0),
    "window-causal-softcap": ([20, 13], [25, 13], True, (5, -1), 3.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_fallback_runs_sdpa_per_sequence_aligned_bottom_right(module, case: str) -> None:
    lengths_q, lengths_k, causal, window, softcap = CASES[case]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=torch.float32, seed=len(case))
    module.fallback_counts(reset=True)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=causal,
                                  window_size=window, softcap=softcap, fallback="sdpa")
    expected = per_sequence(q, k, v, lengths_q, lengths_k, causal, window, softcap)
    assert out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert module.fallback_counts() == {"dtype torch.float32 has no exported kernel; this module covers torch.bfloat16, "
                                        "torch.float16": 1}


def test_the_reference_agrees_with_sdpa_where_the_alignments_agree() -> None:
    q, k, v, cu_q, cu_k = packed([6, 11], [6, 11], heads_kv=4, dtype=torch.float32)
    out = V.reference_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), True, 0.3)
    for lo, hi in ((0, 6), (6, 17)):
        sdpa = TF.scaled_dot_product_attention(*(t[lo:hi].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.3)
        torch.testing.assert_close(out[lo:hi], sdpa.transpose(0, 1))


def test_a_call_that_needs_a_gradient_is_refused_or_runs_the_fallback_with_gradients(module) -> None:
    lengths_q, lengths_k = [5, 0, 9], [8, 3, 9]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="^attention_varlen: a gradient is needed .*fallback='sdpa'"):
        module.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True)
    module.fallback_counts(reset=True)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True, fallback="sdpa")
    out.square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    per_sequence(q2, k2, v2, lengths_q, lengths_k, True).square().sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert module.fallback_counts() == {V.GRAD_REASON: 1}
    with torch.no_grad():   # no gradient: the kernel path's checks
        assert "dtype torch.float32 has no exported kernel" in _error(module, q, k, v, cu_q, cu_k, 9, 9)


def test_a_padded_layout_places_each_sequence_so_top_left_masks_align_bottom_right() -> None:
    cu = lambda *x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    layout = V.padded_layout(cu(0, 2, 2, 7), cu(0, 5, 8, 10), 7, 10, 5, 5)   # L_q 2, 0, 5 over L_k 5, 3, 2
    assert (layout.batch, layout.seq) == (3, 5)
    assert layout.rows_q.tolist() == [3, 4, 10, 11, 12, 13, 14]       # queries after L_k - L_q zero rows
    assert layout.rows_k.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 13, 14]  # keys after L_q - L_k positions
    ranges = [getattr(layout, n).tolist() for n in ("seqlens_q", "leftpad_k", "seqlens_k")]
    assert ranges == [[5, 3, 5], [0, 0, 3], [5, 3, 5]] and layout.seqlens_q.dtype == torch.int32
    assert V.padded_layout(cu(0), cu(0), 0, 0, 0, 0).rows_q.tolist() == []
    assert V.padded_layout(cu(0, 2), cu(0, 2), 2, 2, 9, 9).seq == 9   # the padded length is the longest given


def _dense_reference(q, k, v, is_causal, scale, enable_gqa, window_size, softcap, seqlens_q, leftpad_k, seqlens_k):
    """The dense attention's keywords over ``features.reference_attention`` (fp32, differentiable)."""
    features = F.call_features(window_size, softcap, seqlens_k, leftpad_k, seqlens_q)
    return F.reference_attention(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, seqlens_q)


@pytest.mark.parametrize("lengths_q,lengths_k", [([5, 1, 9], [5, 1, 9]), ([3, 8, 0], [8, 8, 4]), ([8, 2, 4], [3, 2, 0])],
                         ids=["equal", "fewer-queries", "more-queries"])
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 0.0), (True, (3, -1), 0.0),
                                                   (False, (2, 1), 5.0)], ids=["causal", "full", "window", "window-softcap"])
def test_packed_sequences_train_through_the_padded_batch_as_sequence_by_sequence(lengths_q, lengths_k, causal, window,
                                                                                  softcap) -> None:
    """``train_packed`` over a reference dense attention: output and q, k, v gradients equal the packed
    call's own reference (bottom-right causal and window, rows without keys 0), fp32."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dtype=torch.float32)
    features = V.varlen_features(window, softcap)
    offsets = (cu_q.tolist(), cu_k.tolist())
    layout = V.padded_layout(cu_q, cu_k, q.shape[0], k.shape[0], max(lengths_q), max(lengths_k))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for run in ("padded", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if run == "padded":
            out = V.train_packed(_dense_reference, *leaves, layout, causal, 0.3, features)
        else:
            out = V.reference_varlen(*leaves, *offsets, causal, 0.3, features)
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_the_op_with_the_fallback_runs_through_the_dispatcher(module) -> None:
    q, k, v, cu_q, cu_k = packed([4, 7], [9, 7], dtype=torch.float32)
    out = module.attention_varlen_op(q, k, v, cu_q, cu_k, 7, 9, True, None, -1, -1, 0.0, "sdpa")
    torch.testing.assert_close(out, per_sequence(q, k, v, [4, 7], [9, 7], True), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(module.attention_varlen_op, (q, k, v, cu_q, cu_k, 7, 9),
                          {"is_causal": True, "window_left": 3, "softcap": 2.0, "fallback": "sdpa"})


# -- fake tensors and torch.compile -----------------------------------------------------------------------


def test_the_fake_implementation_gives_the_output_meta_and_checks_the_call(module) -> None:
    with FakeTensorMode():
        q = torch.empty(1030, 8, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2000, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(5, dtype=torch.int32, device="cuda")
        for out in (module.attention_varlen(q, kv, kv, cu, cu, 1000, 1000, is_causal=True, window_size=(64, 0)),
                    module.attention_varlen_op(q, kv, kv, cu, cu, 1000, 1000)):
            assert (out.shape, out.dtype, out.device.type) == ((1030, 8, 128), torch.bfloat16, "cuda")
        odd = torch.empty(10, 8, 96, dtype=torch.float16, device="cuda")
        with pytest.raises(ValueError, match="^attention_varlen: no exported kernel for fp16 head_dim 96"):
            module.attention_varlen_op(odd, odd, odd, cu, cu, 4, 4)
        assert module.attention_varlen_op(odd, odd, odd, cu, cu, 4, 4, fallback="sdpa").shape == (10, 8, 96)
        with pytest.raises(ValueError, match="cu_seqlens_q must be an int32 tensor"):
            module.attention_varlen_op(q, kv, kv, cu.long(), cu, 4, 4, fallback="sdpa")
        with pytest.raises(ValueError, match="must have one length"):
            module.attention_varlen_op(q, kv, kv, torch.empty(4, dtype=torch.int32, device="cuda"), cu, 4, 4)


def test_torch_compile_fullgraph_traces_a_varlen_call_through_the_op(module) -> None:
    def block(q, k, v, cu_q, cu_k):
        return module.attention_varlen(q * 2, k, v, cu_q, cu_k, 512, 512, is_causal=True).relu().sum()

    graph = torch.compile(block, fullgraph=True, backend="eager")
    with FakeTensorMode():   # traced through the op, never run
        q = torch.empty(700, 8, 64, dtype=torch.float16, device="cuda")
        kv = torch.empty(900, 8, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        assert graph(q, kv, kv, cu, cu).shape == ()
