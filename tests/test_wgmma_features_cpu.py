"""Sliding windows, soft-capping and per-batch key ranges on the wgmma path without a GPU: the
switches' renders (arguments before the tensor maps, the FEATURES line, SPLIT_TAIL left out where
the K/V range starts past 0), the renders with the switches off unchanged, NVRTC compiles for
sm_90a of a spread of configurations with every switch (no spills where the plain kernel has
none and its consumers have registers to spare), the features each path declares, and an export
that ships a wgmma winner of a case with features and lets calls with them run it."""
from __future__ import annotations

import hashlib
import json

import pytest
from run_fixtures import MMA, SMALL, SMALL_C, WMMA, load_module, make_run, space_doc

from evoengineer import paths
from evoengineer.kernels import RenderError, build_config, render
from evoengineer.paths import wgmma as wgmma_path
from evoengineer.results import export_runs
from evoengineer.runtime import features as F
from evoengineer.space import Config, Variant

ALL = ("seqlens", "softcap", "window")
_P24 = {"PRODUCER": 1, "REG_PRODUCER": 24, "REG_CONSUMER": 240}
_TMA_PP = {"CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "INTRA_WG_OVERLAP": 1, "PINGPONG": 1, "LOAD": "tma"}


def wg(**values) -> Config:
    return Config({"PATH": "wgmma", **values})


# Every variant of the kernel: cp.async by every thread or a producer warpgroup, TMA, overlap 1
# and 2, ping-pong, persistent CTAs (a stride or the tile counter), the cut last round, Q in
# registers, the softmax pin, O by TMA, one to three consumer warpgroups (h100.yaml's seeds and more).
CONFIGS = {
    "c1-n64": wg(CONSUMER_WGS=1, BLOCK_M=64, BLOCK_N=64, STAGES=2),
    "c1-n128-ovl-st3": wg(CONSUMER_WGS=1, BLOCK_M=64, BLOCK_N=128, STAGES=3, INTRA_WG_OVERLAP=1),
    "c1-n128-tma-ovl-st3": wg(CONSUMER_WGS=1, BLOCK_M=64, BLOCK_N=128, STAGES=3, INTRA_WG_OVERLAP=1, LOAD="tma"),
    "c2-n192-pp": wg(CONSUMER_WGS=2, BLOCK_M=128, BLOCK_N=192, STAGES=2, **_P24, INTRA_WG_OVERLAP=1, PINGPONG=1),
    "c3-n64-st4": wg(CONSUMER_WGS=3, BLOCK_M=192, BLOCK_N=64, STAGES=4, PRODUCER=1, REG_PRODUCER=32, REG_CONSUMER=160,
                     INTRA_WG_OVERLAP=1),
    "c3-n128-noovl": wg(CONSUMER_WGS=3, BLOCK_M=192, BLOCK_N=128, STAGES=2, PRODUCER=1, REG_PRODUCER=32, REG_CONSUMER=160),
    "tma-pp": wg(**_TMA_PP, **_P24),
    "ptma-pp": wg(**_TMA_PP, **_P24, PERSISTENT=1),
    "ptma-ov2": wg(CONSUMER_WGS=2, BLOCK_M=128, BLOCK_N=128, STAGES=2, PRODUCER=1, REG_PRODUCER=24, REG_CONSUMER=232,
                   INTRA_WG_OVERLAP=2, LOAD="tma", PERSISTENT=1),
    "ptmao-q-pin3": wg(**_TMA_PP, PRODUCER=1, REG_PRODUCER=24, REG_CONSUMER=232, PERSISTENT=1, O_TMA=1, Q_IN_REGS=1,
                       SOFTMAX_PIN=3),
    "dtma-n192": wg(CONSUMER_WGS=2, BLOCK_M=128, BLOCK_N=192, STAGES=2, **_P24, INTRA_WG_OVERLAP=1, LOAD="tma", PERSISTENT=2),
    "dtmao-q-pp": wg(**_TMA_PP, PRODUCER=1, REG_PRODUCER=32, REG_CONSUMER=232, PERSISTENT=2, O_TMA=1, Q_IN_REGS=1),
    "stmao-pp": wg(**_TMA_PP, PRODUCER=1, REG_PRODUCER=32, REG_CONSUMER=232, PERSISTENT=2, O_TMA=1, SPLIT_TAIL=1),
    "htmao-c3-pin3": wg(CONSUMER_WGS=3, BLOCK_M=192, BLOCK_N=64, STAGES=2, PRODUCER=1, REG_PRODUCER=24, REG_CONSUMER=160,
                        INTRA_WG_OVERLAP=1, PINGPONG=1, LOAD="tma", PERSISTENT=2, O_TMA=1, SOFTMAX_PIN=3, SPLIT_TAIL=2),
}

# sha256 (first 16 hex digits) of renders with the switches off. They began as the renders made
# before the feature switches existed on this path (their SASS compared with nvdisasm); a feature
# must leave them exactly so, and only a deliberate change to the plain kernels (such as the 16-byte
# stores of O from registers) updates them.
UNCHANGED = {
    ("c1-n64", 64, True, "fp16"): "d36c3ad55f51f6a7",
    ("c1-n64", 128, False, "bf16"): "352111add33426dc",
    ("c1-n128-ovl-st3", 64, True, "fp16"): "9fac3b6bf0aabcd1",
    ("c1-n128-ovl-st3", 128, False, "bf16"): "733584c2035f7b26",
    ("c1-n128-tma-ovl-st3", 64, True, "fp16"): "bb8b4d9ed2cc2091",
    ("c1-n128-tma-ovl-st3", 128, False, "bf16"): "2c5ec3bd6d0c3c6f",
    ("c2-n192-pp", 64, True, "fp16"): "5fc346997492ebe1",
    ("c2-n192-pp", 128, False, "bf16"): "b68dd1f82e542e59",
    ("c3-n64-st4", 64, True, "fp16"): "7cb7839454063944",
    ("c3-n64-st4", 128, False, "bf16"): "0fb35553eccdd138",
    ("c3-n128-noovl", 64, True, "fp16"): "7f343ad30d9817e2",
    ("c3-n128-noovl", 128, False, "bf16"): "cf4d116d3fd170d6",
    ("tma-pp", 64, True, "fp16"): "6836f1d304561f05",
    ("tma-pp", 128, False, "bf16"): "44ba85376a7177e8",
    ("ptma-pp", 64, True, "fp16"): "ceda4b4421c1bced",
    ("ptma-pp", 128, False, "bf16"): "89c5412cb63910f4",
    ("ptma-ov2", 64, True, "fp16"): "4a1459c14b786d18",
    ("ptma-ov2", 128, False, "bf16"): "084413c799260526",
    ("ptmao-q-pin3", 64, True, "fp16"): "1e22b26596026f5f",
    ("ptmao-q-pin3", 128, False, "bf16"): "e9bf07c37cf2b83b",
    ("dtma-n192", 64, True, "fp16"): "90c09798ec07a391",
    ("dtma-n192", 128, False, "bf16"): "e038164e88586d4d",
    ("dtmao-q-pp", 64, True, "fp16"): "acf08d35babc22a9",
    ("dtmao-q-pp", 128, False, "bf16"): "eeadce72e6802604",
    ("stmao-pp", 64, True, "fp16"): "16e7788ebba52867",
    ("stmao-pp", 128, False, "bf16"): "392c7ea30bec0ad4",
    ("htmao-c3-pin3", 64, True, "fp16"): "4abe180c4ce759a0",
    ("htmao-c3-pin3", 128, False, "bf16"): "72bf14f8ca9e4cb1",
}


@pytest.mark.parametrize("key", list(UNCHANGED), ids=lambda k: f"{k[0]}-D{k[1]}-{'causal' if k[2] else 'full'}-{k[3]}")
def test_with_the_switches_off_the_wgmma_kernel_renders_as_before(key) -> None:
    name, head_dim, causal, dtype = key
    source = render("flash_attention", CONFIGS[name], Variant(head_dim, causal, dtype)).source
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == UNCHANGED[key]
    assert "softcap" not in source and "window" not in source and "// FEATURES" not in source


def test_each_switch_adds_its_arguments_before_the_tensor_maps_and_its_feature_name() -> None:
    rendered = render("flash_attention", CONFIGS["dtmao-q-pp"], Variant(128, True, "bf16", ALL))
    assert "// FEATURES seqlens softcap window" in rendered.source and rendered.features == ALL
    signature = next(line for line in rendered.source.splitlines() if "attn_fwd(" in line)
    assert ("float scale_log2, const int* seqlens_k, const int* leftpad_k, const int* seqlens_q, float softcap, "
            "int window_left, int window_right, const __grid_constant__ CUtensorMap tm_q") in signature
    names = [name for name, _ in rendered.arguments]
    assert names[names.index("scale_log2") + 1:] == ["seqlens_k", "leftpad_k", "seqlens_q", "softcap", "window_left",
                                                     "window_right", "tm_q", "tm_k", "tm_v", "tm_o"]
    one = render("flash_attention", CONFIGS["c1-n64"], Variant(64, False, "fp16", ("window",)))
    assert one.features == ("window",) and one.arguments[-2:] == [("window_left", "i32"), ("window_right", "i32")]
    one_signature = next(line for line in one.source.splitlines() if "attn_fwd(" in line)
    assert "softcap" not in one_signature and "seqlens_k" not in one_signature
    assert "static constexpr bool WINDOW = true;" in one.source and "static constexpr bool SOFTCAP = false;" in one.source


def _launch(rendered) -> dict:
    return json.loads(next(line for line in rendered.source.splitlines() if line.startswith("// LAUNCH "))[len("// LAUNCH "):])


@pytest.mark.parametrize("features, cut", [((), True), (("softcap",), True), (("window",), False), (("seqlens",), False)])
def test_split_tail_is_left_out_where_a_work_tiles_k_v_range_starts_past_zero(features, cut: bool) -> None:
    """Cutting the last round's tiles assumes every work tile visits the same K/V tiles; a window
    or per-batch key ranges give each its own, so the kernel is the tile counter's (as causal)."""
    rendered = render("flash_attention", CONFIGS["stmao-pp"], Variant(128, False, "fp16", features))
    assert ("split_tail" in _launch(rendered)) == cut
    assert f"static constexpr int SPLIT_TAIL = {1 if cut else 0};" in rendered.source
    assert _launch(rendered)["tile_counter"] is True


def test_each_path_declares_the_features_it_holds_and_the_template_refuses_others() -> None:
    assert paths.get("wgmma").features == wgmma_path.FEATURES == ("seqlens", "softcap", "varlen", "window")
    assert paths.get("mma").features == ("seqlens", "softcap", "varlen", "window")
    assert paths.get("wmma").features == paths.get("scalar").features == ()
    assert set(paths.get("mma").features) == set(paths.get("wgmma").features) == set(F.SWITCHES)
    with pytest.raises(RenderError, match="THE_PATH_DOES_NOT_HOLD_A_FEATURE_ASKED"):
        render("flash_attention", Config({"PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8}),
               Variant(64, False, "fp16", ("varlen",)))
    with pytest.raises(RenderError, match="THE_PATH_DOES_NOT_HOLD_A_FEATURE_ASKED"):
        render("flash_attention", Config({"PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8}),
               Variant(64, False, "fp16", ("softcap",)))


# -- compiled -------------------------------------------------------------------------------------


def _headroom(config: Config, head_dim: int) -> int:
    """Registers a consumer thread has beyond what the path's budget counts it needs."""
    scope = wgmma_path.PATH.scope(config)
    return wgmma_path.consumer_register_cap(scope) - wgmma_path.consumer_registers(scope, head_dim)


COMPILED = [(name, 64, True) for name in CONFIGS] + [(name, 128, False) for name in CONFIGS]
D256 = wg(CONSUMER_WGS=1, BLOCK_M=64, BLOCK_N=64, STAGES=2, PRODUCER=1, INTRA_WG_OVERLAP=1, LOAD="tma")


@pytest.mark.parametrize("name, head_dim, causal", [
    pytest.param(*c, marks=() if i < 2 else pytest.mark.slow) for i, c in enumerate(
        sorted(COMPILED, key=lambda c: (c[0] not in ("dtmao-q-pp", "c1-n64"), c[1], c[0])))],
    ids=lambda x: str(x))
def test_every_switch_compiles_for_sm_90a_without_spills(name: str, head_dim: int, causal: bool) -> None:
    """With every switch the kernel compiles and spills nothing where the plain one spills
    nothing and its consumers' register budget has room; where the budget is exact (the S, P and
    O accumulators fill the cap: c2-n192-pp, c3-n128-noovl at D128) a few registers more spill
    some bytes, which the search measures as it does any kernel."""
    config = CONFIGS[name]
    variant = Variant(head_dim, causal, "bf16", ALL)
    report = build_config("flash_attention", config, [variant], "sm_90a")
    plain = build_config("flash_attention", config, [Variant(head_dim, causal, "bf16")], "sm_90a")
    assert not report.error, report.error
    assert report.smem == plain.smem   # no shared memory added
    if plain.spill_bytes == 0 and _headroom(config, head_dim) > 0:
        assert report.spill_bytes == 0, report.builds[0].compiled.kernels


@pytest.mark.parametrize("features", [("softcap",), ("window",), ("seqlens",), ALL], ids="-".join)
def test_each_switch_alone_compiles_and_head_dim_256_with_all(features) -> None:
    for config, variant in ((CONFIGS["c2-n192-pp"], Variant(128, False, "fp16", features)),
                            (D256, Variant(256, True, "fp16", features))):
        if config is CONFIGS["c2-n192-pp"] and features == ALL:
            continue   # its budget is exact: above
        report = build_config("flash_attention", config, [variant], "sm_90a")
        assert not report.error and report.spill_bytes == 0, report.error or report.builds[0].compiled.kernels


# -- export ---------------------------------------------------------------------------------------

WGMMA = CONFIGS["dtmao-q-pp"]


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("wgfeatures")
    doc = space_doc()
    doc["problem"]["shapes"].append({"B": 1, "H": 8, "S": 512, "D": 64, "causal": True, "softcap": 30.0, "window": [128, 0]})
    capped = "B1 H8 S512 D64 causal softcap30 window128,0"
    times = {SMALL: {WMMA: 20.0, MMA: 26.0}, SMALL_C: {WMMA: 15.0, MMA: 18.0}, capped: {MMA: 30.0, WGMMA: 12.0}}
    run = make_run(root / "run", times, space=doc, sdpa={SMALL: 18.0, SMALL_C: 16.0})
    export_runs([run], root / "out")
    return load_module(root / "out")


def test_an_export_ships_a_wgmma_winner_of_a_case_with_features_and_calls_with_them_run_it(module) -> None:
    key = ("fp16", 64, True, WGMMA.key(), ("softcap", "window"))
    assert key in module.KERNELS
    spec = module.KERNELS[key]
    names = [a[0] for a in spec["args"]]
    assert names[names.index("scale_log2") + 1:] == ["softcap", "window_left", "window_right", "tm_q", "tm_k", "tm_v", "tm_o"]
    data = module._export.data
    # whichever configuration the shape dispatches to, a call with the case's features runs the
    # measured wgmma kernel rather than another configuration's kernel with every feature
    for dispatched in (WGMMA.key(), WMMA.key(), MMA.key(), data.fallback):
        chosen = F.select_kernel(data.kernels, ("fp16", 64, True), dispatched, data.fallback, ("softcap", "window"))
        assert chosen.config == WGMMA.key() and chosen.switches == ("softcap", "window"), dispatched
    # padded batches (per-batch key ranges) and packed sequences: the fallback's kernel with every
    # feature (its path holds all four)
    assert data.fallback == WGMMA.key()
    padded = F.select_kernel(data.kernels, ("fp16", 64, True), WMMA.key(), data.fallback, ("seqlens", "softcap"))
    assert padded.config == WGMMA.key() and padded.switches == tuple(F.SWITCHES)
    packed = F.select_kernel(data.kernels, ("fp16", 128, False), WGMMA.key(), data.fallback, ("varlen",))
    assert packed.config == WGMMA.key() and packed.switches == tuple(F.SWITCHES)
