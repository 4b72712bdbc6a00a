"""Sliding windows, soft-capping, padding and the SDPA fallback without a GPU: the mma template's
switches (render, NVRTC compiles for sm_80 and sm_90 without spills, the unchanged render with
them off), masks as transformers builds them read as the kernels' terms (exactly, or refused),
the fallback's accounting on CPU tensors, the space's feature cases and an export that ships
kernels with features."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from run_fixtures import MMA, SMALL, SMALL_C, SPLIT, WMMA, load_module, make_run, space_doc

from evoengineer.kernels import build_config, render
from evoengineer.results import export_runs
from evoengineer.runtime import features as F
from evoengineer.runtime import hf
from evoengineer.space import Case, Config, SpaceError, Variant, load_space

BASE = {"PATH": "mma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8}

# sha256 (first 16 hex digits) of renders made before the feature switches existed: with the
# switches off the inference kernels must stay exactly these
UNCHANGED = {
    ((), 64, True, "fp16"): "a745489f9e2b105f",
    ((), 128, False, "bf16"): "7a868fe98cbe35f3",
    ((("SPLITS", 4),), 64, True, "fp16"): "790b6e38c5310601",
    ((("SPLITS", 4),), 128, False, "bf16"): "ea0b90eaf87e4f9d",
    ((("PACK_GQA", 1),), 64, True, "fp16"): "0f8018f6007ea8cc",
    ((("WRITE_LSE", 1),), 128, False, "bf16"): "a1d6407d816bcc44",
    ((("P_IN_REGS", 0), ("Q_IN_REGS", 0), ("SMEM_LAYOUT", "pad"), ("STAGES", 1)), 64, True, "fp16"): "79957d50267d2a5d",
}


@pytest.mark.parametrize("key", list(UNCHANGED), ids=lambda k: f"{dict(k[0])}-D{k[1]}-{'causal' if k[2] else 'full'}-{k[3]}")
def test_with_the_switches_off_the_mma_kernel_renders_as_before(key) -> None:
    params, head_dim, causal, dtype = key
    source = render("flash_attention", Config({**BASE, **dict(params)}), Variant(head_dim, causal, dtype)).source
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == UNCHANGED[key]
    assert "softcap" not in source and "window" not in source and "// FEATURES" not in source


def test_each_switch_adds_its_arguments_and_its_feature_name() -> None:
    source = render("flash_attention", Config(BASE), Variant(64, True, "bf16", ("seqlens", "softcap", "window"))).source
    assert "// FEATURES seqlens softcap window" in source
    signature = next(line for line in source.splitlines() if "attn_fwd(" in line)
    assert signature.rstrip(") {").endswith("float scale_log2, const int* seqlens_k, const int* leftpad_k, const int* seqlens_q, float softcap, "
                                            "int window_left, int window_right")
    rendered = render("flash_attention", Config(BASE), Variant(64, False, "fp16", ("window",)))
    assert rendered.features == ("window",) and rendered.arguments[-2:] == [("window_left", "i32"), ("window_right", "i32")]
    assert "softcap" not in rendered.source and "seqlens_k" not in rendered.source


def test_the_switches_are_refused_on_the_other_paths() -> None:
    with pytest.raises(ValueError, match="THE_PATH_DOES_NOT_HOLD_A_FEATURE_ASKED"):
        render("flash_attention", Config({**BASE, "PATH": "wmma"}), Variant(64, False, "fp16", ("softcap",)))


ALL = ("seqlens", "softcap", "window")
COMPILED = [
    (Config({**BASE, "BLOCK_M": 128, "WARPS": 8}), Variant(128, True, "bf16", ALL)),
    (Config({**BASE, "BLOCK_N": 128, "STAGES": 2, "SPLITS": 2, "PACK_GQA": 1}), Variant(128, False, "fp16", ALL)),
    (Config({**BASE, "BLOCK_M": 32, "WARPS": 8, "KV_GROUPS": 4, "STAGES": 1}), Variant(64, True, "fp16", ALL)),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("config, variant", COMPILED, ids=lambda x: x.label() if hasattr(x, "label") else str(x))
def test_kernels_with_every_switch_compile_without_spills(arch: str, config: Config, variant: Variant) -> None:
    report = build_config("flash_attention", config, [variant], arch)
    assert not report.error, report.error
    assert report.spill_bytes == 0, report.builds[0].compiled.kernels
    assert report.smem == build_config("flash_attention", config, [Variant(variant.head_dim, variant.causal, variant.dtype)],
                                       arch).smem  # no shared memory added


# -- masks as transformers builds them ---------------------------------------------------------------


def hf_mask(padding: torch.Tensor, q_len: int, causal: bool = True, window: int | None = None,
            additive: bool = False) -> torch.Tensor:
    """What transformers' sdpa mask builder makes of a (batch, kv_len) padding mask: queries at the
    cache positions kv_len - q_len .. kv_len - 1, key kv_idx attended where padding[b, kv_idx],
    kv_idx <= q_idx (causal) and kv_idx > q_idx - window (sliding window); (batch, 1, q_len,
    kv_len) booleans, or 0 / the dtype's minimum."""
    batch, kv_len = padding.shape
    q_idx = torch.arange(kv_len - q_len, kv_len).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len).view(1, 1, 1, kv_len)
    mask = padding.bool().view(batch, 1, 1, kv_len).expand(batch, 1, q_len, kv_len)
    if causal:
        mask = mask & (kv_idx <= q_idx)
    if window is not None:
        mask = mask & (kv_idx > q_idx - window)
    if additive:
        return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask


def left_padded(lengths: list[int], total: int) -> torch.Tensor:
    return torch.stack([torch.arange(total) >= total - n for n in lengths]).long()


def right_padded(lengths: list[int], total: int) -> torch.Tensor:
    return torch.stack([torch.arange(total) < n for n in lengths]).long()


def _attends_like_the_mask(mask: torch.Tensor, q_len: int, kv_len: int, heads: int = 4, heads_kv: int = 2) -> hf.MaskPlan:
    """The plan of ``mask``, and the proof it is exact: the kernels' terms computed by torch equal
    SDPA with the mask, fp32 on the CPU (rows the mask empties: 0)."""
    batch = mask.shape[0]
    plan = hf.mask_plan(mask, batch, q_len, kv_len)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, 32, generator=gen)
    k, v = (torch.randn(batch, heads_kv, kv_len, 32, generator=gen) for _ in range(2))
    ours = F.reference_attention(q, k, v, plan.causal, None, True, plan.features, plan.seqlens_k, plan.leftpad_k)
    expected = F.attend(q, k, v, mask if mask.dtype == torch.bool else mask == 0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    return plan


def test_left_padding_is_a_key_start_per_batch() -> None:
    plan = _attends_like_the_mask(hf_mask(left_padded([7, 3, 9], 9), 9), 9, 9)
    assert plan.causal and plan.leftpad_k.tolist() == [2, 6, 0] and plan.seqlens_k is None
    assert plan.leftpad_k.dtype == torch.int32 and plan.features == F.PLAIN
    decode = _attends_like_the_mask(hf_mask(left_padded([7, 3, 10], 10), 1, additive=True), 1, 10)
    assert not decode.causal and decode.leftpad_k.tolist() == [3, 7, 0]


def test_right_padding_is_a_key_length_per_batch() -> None:
    plan = _attends_like_the_mask(hf_mask(right_padded([5, 9, 1], 9), 9), 9, 9)
    assert plan.causal and plan.seqlens_k.tolist() == [5, 9, 1] and plan.leftpad_k is None
    full = _attends_like_the_mask(hf_mask(right_padded([5, 9], 9), 9, causal=False), 9, 9)
    assert not full.causal and full.seqlens_k.tolist() == [5, 9]


def test_a_sliding_window_is_its_left_side_and_padding_still_applies() -> None:
    plan = _attends_like_the_mask(hf_mask(left_padded([12, 5], 12), 12, window=4), 12, 12)
    assert plan.causal and plan.features == F.CallFeatures(window_left=3) and plan.leftpad_k.tolist() == [0, 7]
    decode = _attends_like_the_mask(hf_mask(left_padded([12, 10], 12), 1, window=4), 1, 12)
    assert decode.leftpad_k.tolist() == [8, 8] and decode.features == F.PLAIN  # the last four keys


def test_a_mask_that_masks_nothing_or_only_the_diagonal_needs_no_feature() -> None:
    assert _attends_like_the_mask(hf_mask(left_padded([6, 6], 6), 6), 6, 6) == hf.MaskPlan(True)
    assert _attends_like_the_mask(hf_mask(left_padded([6, 6], 6), 6, causal=False), 6, 6) == hf.MaskPlan(False)


@pytest.mark.parametrize("what", ["packed", "holes", "heads differ", "bias"])
def test_masks_the_kernels_cannot_express_are_refused_in_one_line(what: str) -> None:
    mask = hf_mask(left_padded([6, 4], 6), 6)
    if what == "packed":  # two sequences in one row
        mask = mask & torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    elif what == "holes":
        mask = mask.clone()
        mask[0, 0, 5, 2] = False
    elif what == "heads differ":
        mask = torch.cat([mask, mask.tril(-1)], dim=1)
    else:
        mask = torch.zeros(2, 1, 6, 6).masked_fill(~mask, -1e4) + 0.25
    with pytest.raises(hf.MaskError) as err:
        hf.mask_plan(mask, 2, 6, 6)
    assert str(err.value).startswith("hf_attention: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_rebuilds_its_mask_exactly_or_the_mask_is_refused(seed: int) -> None:
    """Random padding, causal or not, windows, queries after a cache, and one flipped element: every
    plan's rebuild (``allowed_keys``) is the mask itself, and a mask with no exact plan is refused."""
    gen = torch.Generator().manual_seed(seed)
    refused = 0
    for trial in range(60):
        batch, kv_len = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        q_len = kv_len if trial % 3 else int(torch.randint(1, kv_len + 1, (1,), generator=gen))
        lengths = torch.randint(0, kv_len + 1, (batch,), generator=gen).tolist()
        padding = (left_padded if trial % 2 else right_padded)(lengths, kv_len)
        window = int(torch.randint(1, kv_len + 2, (1,), generator=gen)) if trial % 4 == 1 else None
        mask = hf_mask(padding, q_len, causal=trial % 5 != 0, window=window)
        if trial % 7 == 3:   # a hole or an extra key somewhere
            mask = mask.clone()
            b, r, c = (int(torch.randint(0, n, (1,), generator=gen)) for n in (batch, q_len, kv_len))
            mask[b, 0, r, c] = ~mask[b, 0, r, c]
        try:
            plan = hf.mask_plan(mask, batch, q_len, kv_len)
        except hf.MaskError:
            refused += 1
            continue
        rebuilt = F.allowed_keys(batch, q_len, kv_len, plan.causal, plan.features, plan.seqlens_k, plan.leftpad_k)
        assert torch.equal(rebuilt[:, 0], mask[:, 0].expand(batch, q_len, kv_len)), (trial, plan)
    assert refused < 60


def test_the_plan_of_a_mask_is_read_once_per_mask_tensor() -> None:
    mask = hf_mask(left_padded([6, 4], 6), 6)
    first = hf.mask_plan(mask, 2, 6, 6)
    assert hf.mask_plan(mask, 2, 6, 6) is first
    mask[1, 0, 5, 2] = False  # changed in place: read again
    with pytest.raises(hf.MaskError):
        hf.mask_plan(mask, 2, 6, 6)


def test_the_layers_of_a_model_read_their_one_mask_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """hf_attention keeps the mask it is given (cut to the keys only inside the plan), so every layer's
    call with it finds its plan held: one read a forward, also where the mask is longer than the keys."""
    reads = []
    plan_of = hf._mask_plan
    monkeypatch.setattr(hf, "_mask_plan", lambda *args: reads.append(args[1:]) or plan_of(*args))
    calls = []
    attention = hf.make_hf_attention(lambda q, k, v, **kw: calls.append(kw) or q, gqa=True)
    q, k = torch.zeros(2, 4, 6, 8), torch.zeros(2, 2, 6, 8)
    padding = hf_mask(left_padded([6, 4], 6), 6)
    static = torch.cat([padding, torch.zeros(2, 1, 6, 4, dtype=torch.bool)], dim=-1)   # a static cache's: 10 slots
    for mask in (padding, static):
        reads.clear()
        for _ in range(4):   # four layers
            attention(None, q, k, k, mask)
        assert len(reads) == 1 and calls[-1]["leftpad_k"].tolist() == [0, 2] and calls[-1]["is_causal"]


def test_under_torch_compile_the_mask_plan_runs_outside_the_graph_without_graph_break_warnings() -> None:
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(lambda m: hf.mask_plan(m, 2, 6, 6), backend="eager")
        plan = compiled(hf_mask(right_padded([6, 4], 6), 6))
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert plan.causal and plan.seqlens_k.tolist() == [6, 4] and plan.leftpad_k is None
    assert not [m for m in messages if "Graph break" in m]


def test_a_mask_made_under_inference_mode_is_read_on_every_call() -> None:
    with torch.inference_mode():  # inference tensors keep no version counter
        mask = hf_mask(left_padded([6, 4], 6), 6)
        first = hf.mask_plan(mask, 2, 6, 6)
        again = hf.mask_plan(mask, 2, 6, 6)
        assert again is not first and again.causal and torch.equal(again.leftpad_k, first.leftpad_k)
        mask[1, 0, 5, 2] = False
        with pytest.raises(hf.MaskError):
            hf.mask_plan(mask, 2, 6, 6)


def test_without_a_mask_the_sliding_window_kwarg_is_read_as_flash_attention_does() -> None:
    device = torch.device("cpu")
    assert hf._call_plan(None, None, 2, 8, 8, {"sliding_window": 8}, device) == hf.MaskPlan(True)   # keys fit
    plan = hf._call_plan(None, None, 2, 9, 9, {"sliding_window": 4}, device)
    assert plan == hf.MaskPlan(True, F.CallFeatures(window_left=3))
    decode = hf._call_plan(None, None, 2, 1, 9, {"sliding_window": 4}, device)
    assert decode.leftpad_k.tolist() == [5, 5] and not decode.causal


# -- the features of a call and the reference -----------------------------------------------------------


def test_call_features_and_what_they_need() -> None:
    assert F.call_features() == F.PLAIN and F.PLAIN.needed(True) == ()
    assert F.call_features((-1, 0)).needed(True) == ()          # causal: the right side is 0 anyway
    assert F.call_features((-1, 0)).needed(False) == ("window",)
    assert F.call_features((3, -1), 30.0).needed(True) == ("softcap", "window")
    assert F.call_features(seqlens_k=torch.zeros(2, dtype=torch.int32)).needed(False) == ("seqlens",)
    assert F.call_features(seqlens_q=torch.zeros(2, dtype=torch.int32)).needed(True) == ("seqlens",)
    for bad, message in (((-2, 0), "sides are -1"), ((1,), r"\(left, right\)")):
        with pytest.raises(ValueError, match=message):
            F.call_features(bad)
    with pytest.raises(ValueError, match="softcap must be"):
        F.call_features(softcap=-1.0)
    q = torch.zeros(3, 2, 4, 8)
    with pytest.raises(ValueError, match=r"seqlens_k must be an int32 tensor of shape \(batch,\) = \(3,\)"):
        F.check_ranges(q, torch.zeros(3, dtype=torch.int64), None)
    with pytest.raises(ValueError, match=r"seqlens_q must be an int32 tensor of shape \(batch,\) = \(3,\)"):
        F.check_ranges(q, None, None, torch.zeros(2, dtype=torch.int32))


def test_the_reference_soft_caps_windows_and_zeroes_rows_that_see_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 16, generator=gen) * 4 for _ in range(3))
    out = F.reference_attention(q, k, v, True, 0.5, False, F.CallFeatures(window_left=1, softcap=2.0),
                                leftpad_k=torch.tensor([0, 3], dtype=torch.int32))
    scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 2.0) * 2.0
    i, j = torch.arange(5).view(5, 1), torch.arange(5).view(1, 5)
    allowed = ((j <= i) & (j >= i - 1)).expand(2, 1, 5, 5).clone()
    allowed[1, :, :, :3] = False
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0) @ v
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[1, :, :3], torch.zeros(2, 3, 16))  # queries 0..2 of batch 1 see no key
    lengths = torch.tensor([5, 2], dtype=torch.int32)
    padded = F.reference_attention(q, k, v, True, 0.5, False, F.CallFeatures(seqlens=True), lengths, seqlens_q=lengths)
    full = F.reference_attention(q, k, v, True, 0.5, False, F.CallFeatures(seqlens=True), lengths)
    assert torch.equal(padded[1, :, 2:], torch.zeros(2, 3, 16))   # batch 1's queries past its length: 0
    torch.testing.assert_close(padded[1, :, :2], full[1, :, :2])
    torch.testing.assert_close(padded[0], full[0])
    assert full[1, :, 2:].abs().sum() > 0   # without seqlens_q those rows see batch 1's two keys


# -- the kernel a call runs -------------------------------------------------------------------------------


def _spec(config: str, features: tuple[str, ...]) -> SimpleNamespace:
    return SimpleNamespace(config=config, features=("gqa", *features))


def test_a_call_runs_a_kernel_with_its_features_preferring_the_dispatched_configuration() -> None:
    kernels = {("fp16", 64, True, "a"): _spec("a", ()), ("fp16", 64, True, "b"): _spec("b", ()),
               ("fp16", 64, True, "a", ("softcap", "window")): _spec("a", ("softcap", "window")),
               ("fp16", 64, True, "b", ("window",)): _spec("b", ("window",)),
               ("fp16", 64, False, "c", ("seqlens",)): _spec("c", ("seqlens",))}
    variant = ("fp16", 64, True)
    assert F.select_kernel(kernels, variant, "a", "b", ("window",)).features == ("gqa", "softcap", "window")
    assert F.select_kernel(kernels, variant, "b", "a", ("window",)).features == ("gqa", "window")
    assert F.select_kernel(kernels, variant, "z", "b", ("softcap",)).config == "a"   # the only one with it
    with pytest.raises(F.Uncovered, match="no exported kernel for fp16 head_dim 64 causal with seqlens"):
        F.select_kernel(kernels, variant, "a", "b", ("seqlens",))


# -- the fallback -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("features")
    doc = space_doc()
    doc["problem"]["shapes"].append({"B": 1, "H": 8, "S": 512, "D": 64, "causal": True, "softcap": 30.0, "window": [128, 0]})
    capped = "B1 H8 S512 D64 causal softcap30 window128,0"
    times = {SMALL: {WMMA: 20.0, MMA: 26.0}, SMALL_C: {WMMA: 15.0, MMA: 18.0}, capped: {MMA: 30.0, SPLIT: 25.0}}
    run = make_run(root / "run", times, space=doc, sdpa={SMALL: 18.0, SMALL_C: 16.0})
    export_runs([run], root / "out")
    return load_module(root / "out")


def test_an_export_ships_the_winner_of_a_case_with_features_with_those_features(module) -> None:
    keys = set(module.KERNELS)
    assert ("fp16", 64, True, SPLIT.key(), ("softcap", "window")) in keys
    assert ("fp16", 64, True, SPLIT.key()) in keys   # and the plain kernel of that configuration
    spec = module.KERNELS[("fp16", 64, True, SPLIT.key(), ("softcap", "window"))]
    assert {"softcap", "window"} <= set(spec["features"])
    assert [tuple(a) for a in spec["args"][-3:]] == [("softcap", "f32"), ("window_left", "i32"), ("window_right", "i32")]
    assert all(not set(s["features"]) & set(F.SWITCHES) for key, s in module.KERNELS.items() if len(key) == 4)
    data = module._export.data
    chosen = F.select_kernel(data.kernels, ("fp16", 64, True), MMA.key(), data.fallback, ("softcap",))
    assert chosen.config == SPLIT.key() and chosen.switches == ("softcap", "window")


def test_the_fallback_is_off_by_default_and_runs_sdpa_counted_per_reason(module) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 7, 64, generator=gen).half() for _ in range(3))
    with pytest.raises(ValueError, match="^attention: q, k and v must be CUDA tensors"):
        module.attention(q, k, v, window_size=(2, 0))
    module.fallback_counts(reset=True)
    out = module.attention(q, k, v, is_causal=True, fallback="sdpa")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    lengths = torch.tensor([7, 3], dtype=torch.int32)
    windowed = module.attention(q.float(), k.float(), v.float(), True, None, False, window_size=(2, 0), softcap=5.0,
                                seqlens_k=lengths, fallback="sdpa")
    expected = F.reference_attention(q.float(), k.float(), v.float(), True, None, False,
                                     F.CallFeatures(2, 0, 5.0, True), lengths)
    torch.testing.assert_close(windowed, expected)
    padded = module.attention(q.float(), k.float(), v.float(), True, seqlens_k=lengths, seqlens_q=lengths,
                              fallback="sdpa")
    assert torch.equal(padded[1, :, 3:], torch.zeros(4, 4, 64)) and padded[1, :, :3].abs().sum() > 0
    counts = module.fallback_counts()
    assert counts == {"q, k and v must be CUDA tensors, got device cpu": 1,
                      "dtype torch.float32 has no exported kernel; this module covers torch.float16": 2}
    plan = module.explain(q, k, v, is_causal=True, fallback="sdpa")
    assert plan["config"] is None and plan["fallback"] == "sdpa" and "CUDA tensors" in plan["reason"]
    assert plan["fallback_counts"] == counts   # explain runs nothing
    assert module.fallback_counts(reset=True) == counts and module.fallback_counts() == {}
    with pytest.raises(ValueError, match="fallback must be None or 'sdpa'"):
        module.attention(q, k, v, fallback="eager")
    with pytest.raises(ValueError, match="shapes do not match"):   # a malformed call is an error, fallback or not
        module.attention(q, k[:, :, :5], v, fallback="sdpa")


def test_a_call_with_features_that_needs_a_gradient_trains_through_the_kernels_or_runs_the_fallback(module) -> None:
    """A window, a soft cap or per-batch key ranges with a gradient go through the LSE op (the
    backward kernels hold them); with the fallback, a call no kernel serves (CPU tensors) runs SDPA
    with its gradients; a plain call keeps the training path."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 7, 64, generator=gen).half().requires_grad_() for _ in range(3))
    with pytest.raises(ValueError, match="^attention: q, k and v must be CUDA tensors"):   # the kernels' path, not a refusal
        module.attention(q, k, v, True, window_size=(2, 0))
    lengths = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="^attention: q, k and v must be CUDA tensors"):   # padding trains too
        module.attention(q, k, v, True, seqlens_k=lengths)
    with pytest.raises(ValueError, match="^attention: seqlens_k must be an int32 tensor of shape"):
        module.attention(q, k, v, True, seqlens_k=lengths.long())
    meta = torch.empty(1, 4, 8, 64, dtype=torch.float16, device="meta", requires_grad=True)
    served = module.attention(meta, meta, meta, softcap=5.0, window_size=(3, 1))   # meta: the LSE op's fake
    assert served.shape == meta.shape and "attention_lse" in type(served.grad_fn).__name__
    assert (served.grad_fn.window_left, served.grad_fn.window_right, served.grad_fn.softcap) == (3, 1, 5.0)
    meta_lengths = torch.empty(1, dtype=torch.int32, device="meta")
    padded = module.attention(meta, meta, meta, True, seqlens_k=meta_lengths, leftpad_k=meta_lengths,
                              seqlens_q=meta_lengths)
    assert padded.shape == meta.shape and "attention_lse" in type(padded.grad_fn).__name__
    with torch.no_grad():   # no gradient: the kernel path's checks as before
        with pytest.raises(ValueError, match="^attention: q, k and v must be CUDA tensors"):
            module.attention(q, k, v, True, window_size=(2, 0))
    module.fallback_counts(reset=True)
    out = module.attention(q, k, v, True, window_size=(2, 0), softcap=5.0, fallback="sdpa")
    out.float().square().sum().backward()
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = F.reference_attention(q2, k2, v2, True, None, False, F.CallFeatures(2, 0, 5.0))
    expected.square().sum().backward()
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert module.fallback_counts() == {"q, k and v must be CUDA tensors, got device cpu": 1}
    module.fallback_counts(reset=True)
    module.attention(q, k, v, True, seqlens_k=lengths, fallback="sdpa").float().sum().backward()
    assert module.fallback_counts() == {"q, k and v must be CUDA tensors, got device cpu": 1}
    module.fallback_counts(reset=True)
    plain = module.attention(q, k, v, is_causal=True, fallback="sdpa")   # the training path's checks: CPU is uncovered
    assert plain.requires_grad
    assert module.fallback_counts() == {"q, k and v must be CUDA tensors, got device cpu": 1}
    served = module.attention(meta, meta, meta, is_causal=True, fallback="sdpa")   # meta: the LSE op's fake
    assert served.shape == meta.shape and "attention_lse" in type(served.grad_fn).__name__
    assert module.fallback_counts() == {"q, k and v must be CUDA tensors, got device cpu": 1}


def test_hf_attention_with_the_fallback_runs_sdpa_for_masks_the_kernels_cannot_express(module) -> None:
    counts = F.FallbackCounts()
    hf_attention = module.hf.make_hf_attention(module.attention, module.GQA, "sdpa", counts)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 64, generator=gen).half()
    k, v = (torch.randn(2, 2, 6, 64, generator=gen).half() for _ in range(2))
    mask = hf_mask(left_padded([6, 4], 6), 6) & torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    out, _ = hf_attention(SimpleNamespace(is_causal=True), q, k, v, mask, scaling=0.125)
    expected = F.attend(q, k, v, mask, 0.125).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert list(counts.snapshot()) == ["the attention mask is not padding (left or right), top-left causal and a "
                                       "sliding window"]
    module.fallback_counts(reset=True)
    padded, _ = hf_attention(SimpleNamespace(is_causal=True), q, k, v, hf_mask(left_padded([6, 4], 6), 6), scaling=0.125)
    assert list(module.fallback_counts()) == ["q, k and v must be CUDA tensors, got device cpu"]   # the kernel path's
    torch.testing.assert_close(padded, F.attend(q, k, v, hf_mask(left_padded([6, 4], 6), 6), 0.125).transpose(1, 2))


# -- the space -----------------------------------------------------------------------------------------------


def test_shapes_with_a_soft_cap_and_a_window_are_cases_of_feature_variants(space_file) -> None:
    path = space_file(lambda d: d["problem"]["shapes"].append(
        {"B": 2, "H": 8, "S": 1000, "D": 64, "causal": [True, False], "softcap": 30.0, "window": [256, 0]}))
    space = load_space(path)
    causal, full = space.cases[-2:]
    assert causal.label() == "B2 H8 S1000 D64 causal softcap30 window256,0"
    assert causal.variant == Variant(64, True, "fp16", ("softcap", "window"))
    assert full.variant.features == ("softcap", "window") and full.variant.label() == "D64-softcap-window"
    assert Case(1, 1, 8, 64, True, window=(-1, 0)).features == ()   # causal already stops at the diagonal


@pytest.mark.parametrize("key, value, words", [("window", [256], "expected [left, right]"), ("window", [-1, -1], "not both -1"),
                                               ("softcap", 0, "expected a positive number")])
def test_bad_feature_values_name_file_and_key(space_file, key: str, value, words: str) -> None:
    path = space_file(lambda d: d["problem"]["shapes"][0].update({key: value}))
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.key == f"problem.shapes[0].{key}" and words in str(err.value)


def test_feature_args_of_the_kernel_file_are_the_runtimes() -> None:
    from evoengineer.runtime.kernel_file import FEATURE_ARGS

    assert set(FEATURE_ARGS) == {name for names in (F.POINTER_ARGS, F.SCALAR_ARGS) for name in names}
    from evoengineer.kernels.render import FEATURE_ARGS as RENDERED

    assert {n for args in RENDERED.values() for n, _ in args} == set(FEATURE_ARGS) and tuple(RENDERED) == F.SWITCHES

