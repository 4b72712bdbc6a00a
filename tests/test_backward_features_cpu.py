"""Sliding windows, soft-capping and per-batch key ranges (padded batches) in the backward, without a
GPU: the mma backward's switches (SOFTCAP=1, WINDOW=1, SEQLENS=1) render with their arguments and
'// FEATURES' line and leave every feature-off render as it was, compile for sm_80 and sm_90a
(registers and spills as ptxas reports them; every valid configuration of the backward space under
``--slow``), the paths' rules, and an export that trains with them: kernel.json's feature kernels,
their choice per call, the ops on meta tensors, torch.compile, and the one-line refusals."""
from __future__ import annotations

import hashlib
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from run_fixtures import load_module, make_run

from evoengineer.kernels import RenderError, compile_many, render
from evoengineer.kernels.backward_rules import (
    BACKWARD_CONFIGS,
    BACKWARD_TEMPLATE,
    FEATURES,
    SPILLS_ALLOWED,
    WGMMA_CONFIGS,
    backward_arguments,
    backward_config,
    backward_launches,
    default_config,
    forward_lse_config,
    holds_features,
    problems,
)
from evoengineer.paths import mma_backward, wgmma_backward
from evoengineer.results import export_runs
from evoengineer.results.export_backward import feature_configs
from evoengineer.runtime.features import CallFeatures
from evoengineer.space import Config, Variant, load_space

BOTH = ("softcap", "window")
ALL = ("seqlens", "softcap", "window")
"""Every feature the mma backward holds (what an export builds its feature kernels with)."""
ADDED = {"softcap": [("softcap", "f32")], "window": [("window_left", "i32"), ("window_right", "i32")],
         "seqlens": [("seqlens_k", "ptr"), ("leftpad_k", "ptr"), ("seqlens_q", "ptr")]}
"""The arguments each switch adds, in the order the kernels take them (softcap, window, seqlens)."""
ARG_ORDER = ("softcap", "window", "seqlens")
C_TYPES = {"f32": "float", "i32": "int", "ptr": "const int*"}
ARCHS = ("sm_80", "sm_90a")
HALVES = backward_config(64, 128, dkdv="halves", dq_mode="separate", dq_block_m=128, dq_block_n=32)

# sha256 (first 16 hex digits) of backward renders made before the switches existed: with them off
# the kernels must stay exactly these
UNCHANGED = {
    (BACKWARD_CONFIGS[64]["m64n64"], 64, True, "fp16"): "e7050c37e3fe0b17",
    (BACKWARD_CONFIGS[64]["m64n64-sep"], 64, False, "bf16"): "419405823b8baff0",
    (BACKWARD_CONFIGS[64]["t128n128"], 64, True, "bf16"): "0d99c8cdf4d7d241",
    (BACKWARD_CONFIGS[128]["t64n128-sep"], 128, False, "fp16"): "450471bf66089e6e",
    (BACKWARD_CONFIGS[128]["m32n128-sep"], 128, True, "bf16"): "18f8e68acadf9c5b",
    (BACKWARD_CONFIGS[64]["m64n64-st1"], 64, False, "fp16"): "441f24258d128a5f",
    (HALVES, 128, True, "fp16"): "04ea22d273e9026a",
    (WGMMA_CONFIGS[128]["w64n128-bulk"], 128, True, "bf16"): "985647a31888cdca",
}


@pytest.mark.parametrize("key", list(UNCHANGED), ids=lambda k: f"{k[0].short_label()}-D{k[1]}-{'causal' if k[2] else 'full'}-{k[3]}")
def test_with_the_switches_off_the_backward_renders_as_before(key) -> None:
    config, head_dim, causal, dtype = key
    source = render(BACKWARD_TEMPLATE, config, Variant(head_dim, causal, dtype)).source
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == UNCHANGED[key]
    assert "softcap" not in source and "window" not in source and "// FEATURES" not in source
    assert "seqlens" not in source and "rng." not in source and "Ranges" not in source


FEATURE_SETS = [("softcap",), ("window",), ("seqlens",), BOTH, ("seqlens", "window"), ALL]


@pytest.mark.parametrize("features", FEATURE_SETS, ids="-".join)
@pytest.mark.parametrize("name", ["m64n64", "m64n64-sep", "t128n128"])
def test_each_switch_adds_its_arguments_and_its_feature_name(features: tuple[str, ...], name: str) -> None:
    config = BACKWARD_CONFIGS[64][name]
    plain = render(BACKWARD_TEMPLATE, config, Variant(64, True, "bf16"))
    rendered = render(BACKWARD_TEMPLATE, config, Variant(64, True, "bf16", features))
    assert rendered.features == features
    assert f"// FEATURES {' '.join(features)}" in rendered.source
    added = [a for f in ARG_ORDER if f in features for a in ADDED[f]]
    assert backward_arguments(rendered) == backward_arguments(plain) + added
    assert backward_launches(rendered) == backward_launches(plain)   # no launch, thread or byte of shared memory added
    kernels = [launch.kernel for launch in backward_launches(rendered)]
    assert "attn_bwd_pre" in kernels and "attn_bwd_dkdv" in kernels
    for kernel in kernels:
        signature = next(line for line in rendered.source.splitlines() if f" {kernel}(" in line)
        assert signature.rstrip(") {").endswith(", ".join(f"{C_TYPES[k]} {n}" for n, k in added))


def test_the_seqlens_switch_leaves_the_other_switches_renders_as_they_were() -> None:
    """SEQLENS off: the window and soft-cap kernels are those made before it existed (their text)."""
    window = render(BACKWARD_TEMPLATE, BACKWARD_CONFIGS[64]["m64n64-sep"], Variant(64, True, "bf16", BOTH)).source
    assert hashlib.sha256(window.encode()).hexdigest()[:16] == "a80389d2c2875e87"
    tiles = render(BACKWARD_TEMPLATE, BACKWARD_CONFIGS[64]["t128n128"], Variant(64, False, "fp16", ("window",))).source
    assert hashlib.sha256(tiles.encode()).hexdigest()[:16] == "df1dd4026814acd6"
    assert "rng." not in window and "rng." not in tiles


def test_the_seqlens_kernels_mask_by_the_batch_range_and_skip_what_it_masks_whole() -> None:
    """Each kernel reads batch b's range, masks keys outside [rng.lo, rng.hi) (S_k stays the stores'
    bound), takes the rows from rng.q_hi on as seeing no key (LSE +inf) and bounds its tile loops."""
    for name in ("m64n64", "m64n64-sep", "t128n128"):
        source = render(BACKWARD_TEMPLATE, BACKWARD_CONFIGS[64][name], Variant(64, True, "fp16", ("seqlens",))).source
        assert source.count("const Ranges rng(seqlens_k, leftpad_k, seqlens_q, b, S_k, S_q);") == (
            2 if name.endswith("-sep") else 1)
        assert "key >= rng.hi || key < rng.lo" in source and "key >= S_k" not in source
        assert "row_lse2(LSE, lr, row < S_q && row < rng.q_hi)" in source
        assert "const int m_tiles = k_first <= k_last ? (rng.q_hi + BM - 1) / BM : 0;" in source
        assert "if (key < S_k) {" in source   # dK and dV of every key below S_k are written (0 where masked)
        if name.endswith("-sep"):
            assert "const int kv_end = m0 >= rng.q_hi ? 0 : IS_CAUSAL ? min(rng.hi, m0 + BM) : rng.hi;" in source


WGMMA = [(d, name) for d, named in WGMMA_CONFIGS.items() for name in named]


@pytest.mark.parametrize("head_dim,name", WGMMA, ids=lambda x: str(x))
def test_every_wgmma_configuration_compiles_with_the_features_without_spills(head_dim: int, name: str) -> None:
    """The wgmma dK/dV kernel with every switch: the masks of the window and the batch's range, its tile bounds,
    rows that see no key at LSE +inf, the cap's derivative from P; for sm_90a without a spilled byte."""
    config = WGMMA_CONFIGS[head_dim][name]
    variants = [Variant(head_dim, causal, "bf16", ALL) for causal in (False, True)]
    rendered = [render(BACKWARD_TEMPLATE, config, v) for v in variants]
    plain = render(BACKWARD_TEMPLATE, config, Variant(head_dim, True, "bf16"))
    for r in rendered:
        dkdv = r.source[r.source.index("attn_bwd_dkdv("):]
        assert "const mma_bwd::Ranges rng(seqlens_k, leftpad_k, seqlens_q, b, S_k, S_q);" in dkdv
        assert "key >= rng.hi || key < rng.lo || (IS_CAUSAL && key > row) || key < row - win.left" in dkdv
        assert "lse2_of(lse.x, m0 + c0 < S_q && m0 + c0 < rng.q_hi)" in dkdv and "cap_factor_of(cap.on, " in dkdv
        assert "const int m_tiles = k_first <= k_last ? min((rng.q_hi + BM - 1) / BM, (k_last + win.left) / BM + 1) : 0;" in dkdv
        assert backward_launches(r) == backward_launches(plain)
    for variant, result in zip(variants, compile_many([r.source for r in rendered], "sm_90a")):
        assert result.ok, f"{name} {variant.label()}: {result.error}"
        assert result.spill_bytes == 0, f"{name} {variant.label()}: {result.registers} registers, {result.spill_bytes} spill bytes"


def test_the_backward_refuses_features_it_does_not_hold() -> None:
    for config in (BACKWARD_CONFIGS[64]["m64n64"], WGMMA_CONFIGS[64]["w64n128"]):
        with pytest.raises(RenderError, match="THE_BACKWARD_PATH_DOES_NOT_HOLD_A_FEATURE_ASKED"):
            render(BACKWARD_TEMPLATE, config, Variant(64, False, "fp16", ("varlen",)))


def test_the_paths_declare_what_they_hold() -> None:
    assert mma_backward.PATH.features == FEATURES == ALL and wgmma_backward.PATH.features == ALL
    assert holds_features(default_config(64)) and holds_features(default_config(64, hopper=True))
    scope = {**mma_backward.DEFAULTS, "DKDV": "strips", "BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIMS": (64,),
             "MIN_HEAD_DIM": 64, "MAX_HEAD_DIM": 64, "SMEM_LIMIT": 1 << 20}
    assert mma_backward.PATH.violations(scope, {"FEATURES": ALL}) == []
    assert mma_backward.PATH.violations(scope, {"FEATURES": ("varlen",)}) == [
        "mma.features: the mma path holds the features seqlens, softcap, window"]
    # a Hopper export's feature kernels: its wgmma fallback's, and the deterministic one
    hopper, exact = default_config(128, hopper=True), default_config(128, deterministic_dq=True)
    assert feature_configs(hopper, exact, 128) == [hopper, exact]
    assert feature_configs(exact, exact, 128) == [exact]
    assert problems(default_config(64), 64) == []


def _compile(jobs: list[tuple[str, Config, Variant]]) -> list:
    out: list = [None] * len(jobs)
    for arch in ARCHS:
        idx = [i for i, (a, _, _) in enumerate(jobs) if a == arch]
        sources = [render(BACKWARD_TEMPLATE, jobs[i][1], jobs[i][2]).source for i in idx]
        for i, result in zip(idx, compile_many(sources, arch)):
            out[i] = result
    return out


SAMPLE = [(64, "m64n64"), (64, "m64n64-sep"), (64, "t128n128"), (128, "m32n128-sep"), (128, "t64n128")]
FEATURE_SPILLS_ALLOWED = {(128, "m32n128-sep"): 8}
"""Spill bytes the feature kernels add to ``SPILLS_ALLOWED``: D128 m32n128-sep's attn_bwd_dq, full,
on sm_80 (168 registers, 8 bytes; none on sm_90a nor causal)."""


@pytest.mark.parametrize("features", [BOTH, ("seqlens",), ALL], ids="-".join)
@pytest.mark.parametrize("head_dim,name", SAMPLE, ids=lambda x: str(x))
def test_feature_kernels_compile_for_sm80_and_sm90a_within_their_spill_allowance(head_dim: int, name: str,
                                                                                 features: tuple[str, ...]) -> None:
    config = BACKWARD_CONFIGS[head_dim][name]
    variants = [Variant(head_dim, c, t, features) for c, t in itertools.product((False, True), ("fp16", "bf16"))]
    jobs = [(arch, config, v) for arch in ARCHS for v in variants]
    for (arch, _, variant), result in zip(jobs, _compile(jobs)):
        assert result.ok, f"{arch} {name} {variant.label()}: {result.error}"
        assert 0 < result.registers <= 255
        allowed = SPILLS_ALLOWED.get((head_dim, name), 0) + FEATURE_SPILLS_ALLOWED.get((head_dim, name), 0)
        assert result.spill_bytes <= allowed, \
            f"{arch} {name} {variant.label()}: {result.registers} registers, {result.spill_bytes} spill bytes"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_halves_layout_and_every_dq_tile_compile_with_the_features(head_dim: int) -> None:
    configs = [HALVES] + [backward_config(32, 64, dq_mode="separate", dq_block_m=m, dq_block_n=n)
                          for m, n in ((64, 32), (128, 128))]
    jobs = [(arch, c, Variant(head_dim, causal, "bf16", ALL)) for arch in ARCHS for c in configs
            for causal in (False, True) if not problems(c, head_dim)]
    for (arch, config, variant), result in zip(jobs, _compile(jobs)):
        assert result.ok, f"{arch} {config.short_label()} {variant.label()}: {result.error}"


def _space_configs() -> list[Config]:
    space = load_space("search_spaces/h100-backward.yaml")
    return [c for c in space.valid_configs() if dict(c).get("PATH", "mma") == "mma"]


def test_every_mma_configuration_of_the_backward_space_renders_with_the_features() -> None:
    configs = _space_configs()
    assert len(configs) > 50
    for config, (d, causal) in itertools.product(configs, itertools.product((64, 128), (False, True))):
        if problems(config, d):
            continue
        plain = render(BACKWARD_TEMPLATE, config, Variant(d, causal, "fp16"))
        rendered = render(BACKWARD_TEMPLATE, config, Variant(d, causal, "fp16", ALL))
        assert rendered.features == ALL and backward_launches(rendered) == backward_launches(plain)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 1,336 kernel sets on two cores, beside the other slow tests: near 600 s
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mma_configuration_of_the_backward_space_compiles_with_the_features(arch: str) -> None:
    """The full sweep (--slow): every mma configuration of h100-backward at both head dims, causal and
    full, both dtypes, with every switch; registers and spills reported per kernel set."""
    jobs = [(arch, c, Variant(d, causal, t, ALL)) for c in _space_configs() for d in (64, 128)
            for causal, t in itertools.product((False, True), ("fp16", "bf16")) if not problems(c, d)]
    failed = []
    for (_, config, variant), result in zip(jobs, _compile(jobs)):
        print(f"{arch} {config.short_label()} {variant.label()}: "
              + (f"{result.registers} registers, {result.spill_bytes} spill bytes" if result.ok else "FAILED"))
        if not result.ok:
            failed.append(f"{config.short_label()} {variant.label()}: {result.error.splitlines()[0]}")
    assert not failed, failed


def test_the_lse_forward_renders_with_the_features() -> None:
    for d in (64, 128):
        rendered = render("flash_attention", forward_lse_config(d), Variant(d, True, "fp16", ALL))
        assert rendered.features == ALL and rendered.workspace_floats_per_row == 1


# -- an export that trains with a window or a soft cap ------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("export_bwd_features")
    export_runs([make_run(root / "run")], root / "out")
    return root / "out", load_module(root / "out")


def _meta(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.float16, device="meta", requires_grad=grad)


def test_the_export_ships_feature_kernels_of_the_backward_for_every_variant(exported) -> None:
    out, module = exported
    info = json.loads((out / "kernel.json").read_text())["backward"]
    for entry in info["variants"]:
        variant = (entry["dtype"], entry["head_dim"], entry["causal"])
        kernels = [k for k in info["kernels"] if (k["dtype"], k["head_dim"], k["causal"]) == variant]
        with_features = [k for k in kernels if k.get("features")]
        assert {k["config"] for k in with_features} == {entry["fallback"], entry["deterministic"]}
        for kernel in with_features:
            assert kernel["features"] == list(ALL) and "-seqlens-softcap-window" in kernel["source"]
            maps = 4 if kernel.get("tensor_maps") else 0   # a TMA kernel's tensor maps follow the arguments
            assert kernel["args"][len(kernel["args"]) - 6 - maps:len(kernel["args"]) - maps] == [
                ["softcap", "f32"], ["window_left", "i32"], ["window_right", "i32"],
                ["seqlens_k", "ptr"], ["leftpad_k", "ptr"], ["seqlens_q", "ptr"]]
            assert "// FEATURES seqlens softcap window" in (out / kernel["source"]).read_text()
        forwards = [k for k in info["forward_kernels"] if (k["dtype"], k["head_dim"], k["causal"]) == variant]
        assert sorted(tuple(sorted(set(k["features"]) & set(ALL))) for k in forwards) == [(), ALL]
        lse_features = next(k for k in forwards if "seqlens" in k["features"])
        assert [a for a in lse_features["args"] if a[0] in ("seqlens_k", "leftpad_k", "seqlens_q")] == [
            ["seqlens_k", "ptr"], ["leftpad_k", "ptr"], ["seqlens_q", "ptr"]]
    data = module._export.data.backward
    assert all(data.switches(v) == set(ALL) and data.switches(v, deterministic=True) == set(ALL) for v in data.variants)


def test_a_call_with_features_runs_the_kernels_built_with_them(exported) -> None:
    _, module = exported
    launcher = module._export.backward
    plain_cid = module.dispatch_backward("fp16", 64, True, 2, 8, 77, 77)   # the wgmma fallback (a Hopper export)
    spec = launcher._kernel("fp16", 64, True, plain_cid, False, ("window",))
    assert spec.features == ALL and spec.config == plain_cid and not spec.deterministic   # the fallback's own
    spec = launcher._kernel("fp16", 64, True, plain_cid, False, ("seqlens",))
    assert spec.features == ALL and not spec.deterministic
    assert [a for a in spec.args if a[1] == "ptr"][-3:] == [("seqlens_k", "ptr"), ("leftpad_k", "ptr"), ("seqlens_q", "ptr")]
    spec = launcher._kernel("fp16", 64, True, plain_cid, True, ("softcap",))
    assert spec.deterministic and spec.config == default_config(64, deterministic_dq=True).key()
    assert launcher._kernel("fp16", 64, True, plain_cid, False, ()).features == ()


@pytest.mark.parametrize("causal,window,softcap", [(True, (16, 0), None), (False, (8, 3), 30.0), (False, None, 50.0)])
def test_gradients_with_features_flow_through_the_ops_on_meta_tensors(exported, causal, window, softcap) -> None:
    _, module = exported
    q, k, v = _meta(2, 8, 100, 64), _meta(2, 2, 70, 64), _meta(2, 2, 70, 64)
    out = module.attention(q, k, v, causal, None, True, window_size=window, softcap=softcap)
    fn = out.grad_fn
    assert "attention_lse" in type(fn).__name__
    assert (fn.window_left, fn.window_right, fn.softcap) == (*(window or (-1, -1)), softcap or 0.0)
    out.float().sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def _lengths(batch: int = 2) -> torch.Tensor:
    return torch.empty(batch, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("ranges", ["seqlens_k", "leftpad_k", "seqlens_q", "seqlens_k leftpad_k seqlens_q"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (16, 0))])
def test_a_padded_batch_trains_through_the_ops_on_meta_tensors(exported, ranges: str, causal: bool, window) -> None:
    """Per-batch key ranges and query lengths with a gradient: the LSE op keeps the range tensors for
    its backward, whose op takes them too (no refusal, no fallback)."""
    _, module = exported
    q, k, v = _meta(2, 8, 100, 64), _meta(2, 2, 70, 64), _meta(2, 2, 70, 64)
    given = {name: _lengths() for name in ranges.split()}
    out = module.attention(q, k, v, causal, None, True, window_size=window, **given)
    fn = out.grad_fn
    assert "attention_lse" in type(fn).__name__
    saved = dict(zip(("seqlens_k", "leftpad_k", "seqlens_q"), fn.saved_tensors[5:]))
    assert all((saved[name] is not None) == (name in given) for name in saved)
    out.float().sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    assert module.fallback_counts() == {}


def test_opcheck_passes_for_the_ops_with_features(exported) -> None:
    _, module = exported
    q, kv = _meta(2, 8, 40, 64), _meta(2, 2, 70, 64)
    args = (q, kv, kv, False, None, True, False, 5, 2, 30.0)
    results = torch.library.opcheck(module.attention_lse_op, args)
    assert set(results.values()) == {"SUCCESS"}
    out, lse = module.attention_lse_op(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    backward = (out, q.detach(), kv.detach(), kv.detach(), out, lse, False, None, True, False, 5, 2, 30.0)
    assert set(torch.library.opcheck(module.attention_backward_op, backward).values()) == {"SUCCESS"}
    lengths = _lengths()
    padded = (q, kv, kv, True, None, True, False, -1, -1, 0.0, lengths, lengths, lengths)
    assert set(torch.library.opcheck(module.attention_lse_op, padded).values()) == {"SUCCESS"}
    backward = (out, q.detach(), kv.detach(), kv.detach(), out, lse, True, None, True, False, -1, -1, 0.0, lengths,
                None, lengths)
    assert set(torch.library.opcheck(module.attention_backward_op, backward).values()) == {"SUCCESS"}
    with pytest.raises(ValueError, match=r"^attention: seqlens_q must be an int32 tensor of shape \(batch,\) = \(2,\)"):
        module.attention_lse_op(q.detach(), kv.detach(), kv.detach(), True, None, True, False, -1, -1, 0.0, None, None,
                                _lengths(3))


def test_torch_compile_traces_a_window_and_a_soft_cap_forward_and_backward(exported) -> None:
    from test_export_backward import _recording_backend

    _, module = exported
    ns = module.OP_NAMESPACE
    graphs: list = []
    step = torch.compile(lambda q, k, v: module.attention(q, k, v, True, None, True, window_size=(32, 0),
                                                          softcap=30.0).float().square().sum(),
                         fullgraph=True, backend=_recording_backend(graphs))
    q, kv = _meta(2, 8, 64, 64), _meta(2, 2, 64, 64)
    step(q, kv, kv).backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    named = dict(graphs)
    assert f"{ns}.attention_lse.default" in named["forward"] and f"{ns}.attention_backward.default" in named["backward"]


def test_torch_compile_traces_a_padded_batch_forward_and_backward(exported) -> None:
    from test_export_backward import _recording_backend

    _, module = exported
    ns = module.OP_NAMESPACE
    graphs: list = []
    step = torch.compile(lambda q, k, v, lo, hi, n: module.attention(q, k, v, True, None, True, seqlens_k=hi,
                                                                     leftpad_k=lo, seqlens_q=n).float().square().sum(),
                         fullgraph=True, backend=_recording_backend(graphs))
    q, kv = _meta(2, 8, 64, 64), _meta(2, 2, 64, 64)
    step(q, kv, kv, _lengths(), _lengths(), _lengths()).backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    named = dict(graphs)
    assert f"{ns}.attention_lse.default" in named["forward"] and f"{ns}.attention_backward.default" in named["backward"]
    assert module.fallback_counts() == {}


def test_what_the_backward_cannot_serve_is_one_line(exported, tmp_path: Path) -> None:
    out_dir, module = exported
    q = _meta(1, 4, 16, 64)
    lengths = torch.empty(1, dtype=torch.int32, device="meta")
    assert "attention_lse" in type(module.attention(q, q, q, seqlens_k=lengths).grad_fn).__name__   # padding trains
    with pytest.raises(ValueError, match=r"^attention: leftpad_k must be an int32 tensor [^\n]*$"):
        module.attention(q, q, q, leftpad_k=lengths.long())
    # an export whose backward has no feature kernels (made before they existed)
    info = json.loads((out_dir / "kernel.json").read_text())
    info["backward"]["kernels"] = [k for k in info["backward"]["kernels"] if not k.get("features")]
    info["op_namespace"] += "_older"   # another export: ops of its own
    shutil.copytree(out_dir, tmp_path / "out")
    (tmp_path / "out" / "kernel.json").write_text(json.dumps(info))
    older = load_module(tmp_path / "out")
    with pytest.raises(NotImplementedError, match=r"^attention: a gradient is needed .* backward for fp16 head_dim 64 "
                                                  r"has no softcap; [^\n]*fallback='sdpa'"):
        older.attention(q, q, q, softcap=20.0)
    with pytest.raises(NotImplementedError, match=r"^attention: a gradient is needed .* backward for fp16 head_dim 64 "
                                                  r"has no seqlens; [^\n]*fallback='sdpa'"):
        older.attention(q, q, q, seqlens_q=lengths)
    with torch.no_grad():
        assert older.attention(q, q, q, softcap=20.0).shape == q.shape   # inference keeps its feature kernels
    assert CallFeatures(4, 0, 0.0).needed(True) == ("window",) and CallFeatures(-1, 0).needed(True) == ()


def test_the_gpu_helpers_hand_the_ranges_to_a_seqlens_kernel() -> None:
    """``gpu.backward``'s LSE forward and backward (the GPU tests' entry points) turn the range
    tensors into the seqlens switch and its pointer arguments (null where not given)."""
    from evoengineer.gpu.backward import _feature_arguments, _with_ranges

    lengths = torch.zeros(2, dtype=torch.int32)
    features = _with_ranges(CallFeatures(3, 1, 0.0), {"seqlens_k": lengths, "leftpad_k": None, "seqlens_q": None})
    assert features.seqlens and not features.padded and features.needed(False) == ("seqlens", "window")
    assert _with_ranges(CallFeatures(), {"seqlens_k": None, "leftpad_k": None, "seqlens_q": None}) == CallFeatures()
    args = _feature_arguments(features, Variant(64, False, "fp16", ("seqlens", "window")), {"seqlens_k": lengths})
    assert args == {"seqlens_k": lengths, "leftpad_k": None, "seqlens_q": None, "window_left": 3, "window_right": 1}
