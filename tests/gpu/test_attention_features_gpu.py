"""Sliding windows, soft-capping and padding on the GPU, against fp32 with the equivalent explicit
mask, under flash-attn's rule: max|out - ref_fp32| <= 2 * max|ref_lowp - ref_fp32| + eps, where
ref_lowp is the same computation in the inputs' dtype. The mma kernels directly (odd shapes, GQA,
fp16 and bf16, every technique switch), an exported module's attention(window_size=, softcap=,
seqlens_k=, leftpad_k=, seqlens_q=, fallback=) and hf_attention on left- and right-padded batches."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run_fixtures import MMA, SMALL, SMALL_C, SPLIT, WMMA, load_module, make_run, space_doc  # noqa: E402

from evoengineer.kernels import render  # noqa: E402
from evoengineer.runtime import features as F  # noqa: E402
from evoengineer.space import Config, Variant  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EPS = 1e-3
ALL = ("seqlens", "softcap", "window")


def mma(BM: int, BN: int, warps: int, **extra) -> Config:
    return Config({"PATH": "mma", "BLOCK_M": BM, "BLOCK_N": BN, "WARPS": warps, "VEC": 8, **extra})


CONFIGS = {
    "m64n64": mma(64, 64, 4),
    "m128n64-w8-st3": mma(128, 64, 8, STAGES=3),
    "m64n128-st1": mma(64, 128, 4, STAGES=1),
    "m128n64-w4-q0": mma(128, 64, 4, Q_IN_REGS=0),
    "m64n64-split3-pack": mma(64, 64, 4, SPLITS=3, PACK_GQA=1),
    "m32n64-g4": mma(32, 64, 8, STAGES=1, KV_GROUPS=4),
    "m64n64-pad-p0": mma(64, 64, 4, SMEM_LAYOUT="pad", P_IN_REGS=0),
}

SHAPES = [  # (B, H, H_kv, S_q, S_k, D)
    (2, 4, 2, 77, 77, 64),
    (1, 6, 3, 333, 333, 128),
    (3, 4, 1, 130, 301, 64),
    (2, 8, 2, 1, 1000, 128),   # decode
]


def lowp_reference(q, k, v, causal: bool, features: F.CallFeatures, seqlens_k=None, leftpad_k=None, scale=None,
                   seqlens_q=None):
    """The computation in the inputs' dtype (flash-attn's ``attention_ref(upcast=False)``)."""
    k, v = F.repeat_kv(k, q.shape[1]), F.repeat_kv(v, q.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q * scale) @ k.transpose(-1, -2)
    if features.softcap > 0:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    mask = F.allowed_keys(q.shape[0], q.shape[2], k.shape[2], causal, features, seqlens_k, leftpad_k, q.device,
                          seqlens_q=seqlens_q)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return (probs @ v).masked_fill(~mask.any(-1, keepdim=True), 0)


def check_rule(out, q, k, v, causal: bool, features: F.CallFeatures, seqlens_k=None, leftpad_k=None,
               seqlens_q=None) -> None:
    ref = F.reference_attention(q.float(), k.float(), v.float(), causal, None, True, features, seqlens_k, leftpad_k,
                                seqlens_q)
    low = lowp_reference(q, k, v, causal, features, seqlens_k, leftpad_k, seqlens_q=seqlens_q)
    assert torch.isfinite(out).all(), "output not finite or never written"
    err, bound = (out.float() - ref).abs().max().item(), 2 * (low.float() - ref).abs().max().item() + EPS
    assert err <= bound, f"max|out - ref| {err:.3g} > 2 max|ref_lowp - ref| + eps = {bound:.3g}"


def inputs(shape, dtype, seed: int, spread: float = 1.0):
    b, h, hkv, sq, sk, d = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, h, sq, d, generator=gen, device="cuda") * spread).to(dtype)
    k = (torch.randn(b, hkv, sk, d, generator=gen, device="cuda") * spread).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=gen, device="cuda").to(dtype)
    return q, k, v


_BUILT: dict = {}


def kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel
    from evoengineer.kernels import compile_source

    key = (config.key(), variant)
    if key not in _BUILT:
        rendered = render("flash_attention", config, variant)
        arch = "sm_90a" if config["PATH"] == "wgmma" else "sm_%d%d" % torch.cuda.get_device_capability()
        res = compile_source(rendered.source, arch)
        assert res.ok, res.error
        _BUILT[key] = AttentionKernel(rendered, res.cubin_path)
    return _BUILT[key]


def ranges(batch: int, seq_k: int, seed: int):
    """Key lengths (one batch with none) and left pads, int32 on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq_k + 1, (batch,), generator=gen)
    lengths[0] = seq_k
    if batch > 2:
        lengths[2] = 0
    pads = (torch.rand(batch, generator=gen) * lengths).long()
    return lengths.int().cuda(), pads.int().cuda()


def query_lengths(batch: int, seq_q: int, seed: int):
    """Query lengths (one batch with all its queries, one with none), int32 on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq_q + 1, (batch,), generator=gen)
    lengths[0] = seq_q
    if batch > 1:
        lengths[-1] = 0 if batch > 2 else min(seq_q, 1 + seq_q // 3)
    return lengths.int().cuda()


def call_ranges(kind: str, shape, seed: int):
    """(seqlens_k, leftpad_k, seqlens_q) of a setting's kind: '' none, 'keys' key ranges,
    'queries' query lengths, 'both'."""
    keys = ranges(shape[0], shape[4], seed=seed) if kind in ("keys", "both") else (None, None)
    return (*keys, query_lengths(shape[0], shape[3], seed=seed + 1) if kind in ("queries", "both") else None)


SETTINGS = {  # name -> (causal, window, softcap, ranges: '', 'keys', 'queries' or 'both')
    "window-causal": (True, (17, 0), 0.0, ""),
    "window-both": (False, (31, 9), 0.0, ""),
    "window-right": (False, (-1, 5), 0.0, ""),
    "softcap": (False, (-1, -1), 2.0, ""),
    "softcap-causal-window": (True, (40, -1), 2.0, ""),
    "ranges": (False, (-1, -1), 0.0, "keys"),
    "ranges-causal": (True, (-1, -1), 0.0, "keys"),
    "queries-causal": (True, (-1, -1), 0.0, "queries"),
    "everything": (True, (23, 0), 3.0, "both"),
    "off": (True, (-1, -1), 0.0, ""),   # a kernel with every switch serves a plain call
}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}/{}S{}/{}D{}".format(*s))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_kernel_with_every_switch_matches_the_masked_reference(name: str, shape, setting: str, dtype: str) -> None:
    causal, window, softcap, kind = SETTINGS[setting]
    torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    q, k, v = inputs(shape, torch_dtype, seed=hash((name, shape, setting)) % 10_000, spread=2.0 if softcap else 1.0)
    seqlens, leftpad, seqlens_q = call_ranges(kind, shape, seed=shape[4])
    features = F.CallFeatures(window[0], window[1], softcap, bool(kind))
    out = torch.full_like(q, float("nan"))
    values = {"window_left": window[0], "window_right": window[1], "softcap": softcap, "seqlens_k": seqlens,
              "leftpad_k": leftpad, "seqlens_q": seqlens_q}
    kernel(CONFIGS[name], Variant(shape[-1], causal, dtype, ALL))(q, k, v, out, features=values)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, causal, features, seqlens, leftpad, seqlens_q)


@pytest.mark.parametrize("feature, setting", [("window", "window-causal"), ("window", "window-both"),
                                              ("softcap", "softcap"), ("seqlens", "ranges-causal"),
                                              ("seqlens", "queries-causal")])
@pytest.mark.parametrize("name", ["m64n64", "m64n64-split3-pack"])
def test_a_kernel_with_one_switch_matches_the_masked_reference(name: str, feature: str, setting: str) -> None:
    causal, window, softcap, kind = SETTINGS[setting]
    shape = (2, 4, 2, 200, 257, 64)
    q, k, v = inputs(shape, torch.float16, seed=7, spread=2.0 if softcap else 1.0)
    seqlens, leftpad, seqlens_q = call_ranges(kind, shape, seed=3)
    values = {"window_left": window[0], "window_right": window[1], "softcap": softcap, "seqlens_k": seqlens,
              "leftpad_k": leftpad, "seqlens_q": seqlens_q}
    out = torch.full_like(q, float("nan"))
    kernel(CONFIGS[name], Variant(64, causal, "fp16", (feature,)))(q, k, v, out, features=values)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, causal, F.CallFeatures(window[0], window[1], softcap, bool(kind)), seqlens, leftpad,
               seqlens_q)


# -- through an exported module ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    from evoengineer.results import export_runs

    root = tmp_path_factory.mktemp("features_gpu")
    doc = space_doc()
    doc["problem"]["shapes"].append({"B": 1, "H": 8, "S": 512, "D": 64, "causal": True, "softcap": 30.0, "window": [128, 0]})
    capped = "B1 H8 S512 D64 causal softcap30 window128,0"
    times = {SMALL: {WMMA: 20.0, MMA: 26.0}, SMALL_C: {WMMA: 15.0, MMA: 18.0}, capped: {MMA: 30.0, SPLIT: 25.0}}
    export_runs([make_run(root / "run", times, space=doc, sdpa={SMALL: 18.0, SMALL_C: 16.0})], root / "out")
    return load_module(root / "out")


def test_the_module_serves_windows_soft_caps_and_padding(module) -> None:
    dtype = torch.float16   # the export's dtype (bf16 kernels: test_a_kernel_with_every_switch_...)
    module.fallback_counts(reset=True)
    shape = (3, 8, 2, 150, 150, 64)
    q, k, v = inputs(shape, dtype, seed=11, spread=2.0)
    lengths, pads = ranges(3, 150, seed=5)
    for kwargs in ({"window_size": (31, 0)}, {"softcap": 5.0}, {"seqlens_k": lengths}, {"leftpad_k": pads},
                   {"seqlens_k": lengths, "seqlens_q": lengths},
                   {"window_size": (31, 0), "softcap": 5.0, "seqlens_k": lengths, "leftpad_k": pads}):
        out = module.attention(q, k, v, is_causal=True, enable_gqa=True, **kwargs)
        features = F.call_features(kwargs.get("window_size"), kwargs.get("softcap"), kwargs.get("seqlens_k"),
                                   kwargs.get("leftpad_k"), kwargs.get("seqlens_q"))
        check_rule(out, q, k, v, True, features, kwargs.get("seqlens_k"), kwargs.get("leftpad_k"),
                   kwargs.get("seqlens_q"))
        if "seqlens_q" in kwargs:   # the padded rows: 0
            assert all((out[b, :, int(n):] == 0).all() for b, n in enumerate(lengths.tolist()))
        plan = module.explain(q, k, v, is_causal=True, enable_gqa=True, **kwargs)
        assert set(features.needed(True)) <= set(plan["features"]), plan
    assert module.fallback_counts() == {}
    small = inputs((1, 8, 8, 512, 512, 64), dtype, seed=1)
    windowed = module.explain(*small, is_causal=True, window_size=(128, 0), softcap=30.0)   # the measured case
    assert windowed["kernel"][:3] == ("fp16", 64, True) and set(windowed["kernel"][4]) >= {"softcap", "window"}


def test_calls_no_kernel_covers_run_sdpa_with_the_fallback_counted(module) -> None:
    module.fallback_counts(reset=True)
    q, k, v = inputs((2, 4, 4, 33, 33, 96), torch.float16, seed=2)
    with pytest.raises(ValueError, match="head_dim 96"):
        module.attention(q, k, v, is_causal=True)
    out = module.attention(q, k, v, is_causal=True, fallback="sdpa")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert module.fallback_counts() == {"no exported kernel for fp16 head_dim 96 causal; this module covers "
                                        + module._export.coverage.covered(): 1}


def test_padded_batches_through_hf_attention_match_sdpa_with_the_mask(module) -> None:
    from test_attention_features_cpu import hf_mask, left_padded, right_padded

    hf_attention = module.hf_attention
    q, k, v = inputs((3, 8, 2, 97, 97, 64), torch.float16, seed=4)
    for padding in (left_padded([97, 40, 1], 97), right_padded([97, 40, 3], 97)):
        for causal in (True, False):
            mask = hf_mask(padding, 97, causal=causal).cuda()
            out, _ = hf_attention(type("M", (), {"is_causal": causal})(), q, k, v, mask, scaling=0.125)
            ref = F.attend(q.float(), k.float(), v.float(), mask, 0.125).transpose(1, 2)
            low = F.attend(q, k, v, mask, 0.125).transpose(1, 2)
            err, bound = (out.float() - ref).abs().max().item(), 2 * (low.float() - ref).abs().max().item() + EPS
            assert err <= bound, (causal, err, bound)
    decode_mask = hf_mask(left_padded([97, 40, 5], 97), 1).cuda()
    qd = q[:, :, :1]
    out, _ = hf_attention(type("M", (), {"is_causal": True})(), qd, k, v, decode_mask, scaling=0.125)
    ref = F.attend(qd.float(), k.float(), v.float(), decode_mask, 0.125).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_generation_over_prompts_of_different_lengths_matches_sdpa(module) -> None:
    pytest.importorskip("transformers")
    from test_export_module_gpu import _tiny_llama

    module.register_hf("evo")
    model = _tiny_llama()
    ids = torch.randint(3, 512, (3, 40), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0   # left padding, as generate pads prompts of different lengths
    mask[2, :31] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        model.set_attn_implementation("evo")
        module.fallback_counts(reset=True)
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, ref)
    assert module.fallback_counts() == {}
