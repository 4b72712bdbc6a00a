"""Packed variable-length sequences (VARLEN) on the wgmma path without a GPU: the switch's render
(its offsets between softcap and the window, before the tensor maps; the FEATURES line; O_TMA's
store switched off; SPLIT_TAIL left out; WRITE_LSE refused), NVRTC compiles for sm_90a of the
h100 space's wgmma seeds with every feature (no spills), the tensor maps over packed tensors,
and an export of a wgmma run whose varlen calls get the wgmma kernel with every feature."""
from __future__ import annotations

import json

import pytest
import torch
from run_fixtures import MMA, SMALL, SMALL_C, WMMA, load_module, make_run, space_doc

from evoengineer.kernels import RenderError, build_config, render
from evoengineer.kernels.render import FEATURE_ARGS
from evoengineer.paths import wgmma as wgmma_rules
from evoengineer.resources import builtin_spaces
from evoengineer.results import export_runs
from evoengineer.runtime import features as F
from evoengineer.runtime import tensormap
from evoengineer.runtime import varlen as V
from evoengineer.space import Config, Variant, load_space

ALL = tuple(F.SWITCHES)   # seqlens, softcap, varlen, window


def wg(**values) -> Config:
    return Config({"PATH": "wgmma", **values})


_PP = {"CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "INTRA_WG_OVERLAP": 1, "PINGPONG": 1, "LOAD": "tma",
       "PRODUCER": 1}
TMA = wg(**_PP, REG_PRODUCER=24, REG_CONSUMER=240)
PTMAO = wg(**_PP, REG_PRODUCER=24, REG_CONSUMER=240, PERSISTENT=1, O_TMA=1)
DTMAO = wg(**_PP, REG_PRODUCER=32, REG_CONSUMER=232, PERSISTENT=2, O_TMA=1, Q_IN_REGS=1, SOFTMAX_PIN=3)
CPASYNC = wg(CONSUMER_WGS=1, BLOCK_M=64, BLOCK_N=64, STAGES=2)


def _launch(rendered) -> dict:
    return json.loads(next(line for line in rendered.source.splitlines() if line.startswith("// LAUNCH "))[len("// LAUNCH "):])


def test_the_varlen_switch_adds_its_offsets_between_softcap_and_window_before_the_tensor_maps() -> None:
    rendered = render("flash_attention", TMA, Variant(128, True, "bf16", ALL))
    assert "// FEATURES seqlens softcap varlen window" in rendered.source and rendered.features == ALL
    names = [name for name, _ in rendered.arguments]
    assert names[names.index("scale_log2") + 1:] == ["seqlens_k", "leftpad_k", "seqlens_q", "softcap", "cu_seqlens_q",
                                                     "cu_seqlens_k", "window_left", "window_right", "tm_q", "tm_k",
                                                     "tm_v"]
    # the order the launchers pack: render.FEATURE_ARGS in runtime.features.SWITCHES order
    expected = [arg for feature in F.SWITCHES for arg in FEATURE_ARGS[feature]]
    assert rendered.arguments[names.index("scale_log2") + 1:names.index("tm_q")] == expected
    alone = render("flash_attention", CPASYNC, Variant(64, False, "fp16", ("varlen",)))
    assert "// FEATURES varlen\n" in alone.source and alone.features == ("varlen",)
    assert alone.arguments[-2:] == [("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")]
    assert "static constexpr bool VARLEN = true;" in alone.source and "softcap" not in alone.arguments[-1][0]
    other = render("flash_attention", CPASYNC, Variant(64, False, "fp16", ("window",)))
    assert "static constexpr bool VARLEN = false;" in other.source and "int* cu_seqlens" not in other.source


@pytest.mark.parametrize("config", [PTMAO, DTMAO], ids=["ptmao", "dtmao"])
def test_o_tma_configurations_render_with_varlen_storing_o_from_registers(config: Config) -> None:
    """A TMA store of O would write past a sequence's rows into the next one's: with VARLEN the
    kernel stores from registers with a row guard, without the O buffer and its tensor map."""
    plain = render("flash_attention", config, Variant(128, False, "fp16"))
    packed = render("flash_attention", config, Variant(128, False, "fp16", ("varlen",)))
    assert [m.arg for m in plain.tensor_maps] == ["tm_q", "tm_k", "tm_v", "tm_o"]
    assert [m.arg for m in packed.tensor_maps] == ["tm_q", "tm_k", "tm_v"]
    assert "static constexpr bool O_TMA = false;" in packed.source and "tm_o" not in packed.source
    assert _launch(packed)["smem"] == _launch(plain)["smem"] - 2 * 128 * 128
    # the figure the template declares is the path rule's, which counts the O tile only without VARLEN
    assert _launch(packed)["smem"] == wgmma_rules.smem_bytes(wgmma_rules.PATH.scope(config, {"VARLEN": 1}), 128)
    assert _launch(plain)["smem"] == wgmma_rules.smem_bytes(wgmma_rules.PATH.scope(config), 128)
    assert _launch(packed)["persistent"] is True


def test_split_tail_is_left_out_and_write_lse_refused_with_varlen() -> None:
    cut = wg(**_PP, REG_PRODUCER=32, REG_CONSUMER=232, PERSISTENT=2, O_TMA=1, SPLIT_TAIL=1)
    assert "split_tail" in _launch(render("flash_attention", cut, Variant(128, False, "fp16")))
    rendered = render("flash_attention", cut, Variant(128, False, "fp16", ("varlen",)))
    assert "split_tail" not in _launch(rendered) and "static constexpr int SPLIT_TAIL = 0;" in rendered.source
    with pytest.raises(RenderError, match="WGMMA_PATH_WRITE_LSE_TAKES_NO_PACKED_SEQUENCES"):
        render("flash_attention", Config({**TMA.to_dict(), "WRITE_LSE": 1}), Variant(64, True, "fp16", ("varlen",)))


def test_the_kernel_reads_the_sequence_and_aligns_positions_bottom_right() -> None:
    source = render("flash_attention", DTMAO, Variant(64, True, "fp16", ("varlen",))).source
    assert "struct Seq {" in source and "shift = len_k - len_q;" in source
    assert "tma_tile<BM>(sm.q, maps.q, seq.q_first + m0, h, seq.batch, bars + BAR_Q);" in source
    assert "tma_k(sm, maps, stage, t, h_kv, seq.batch, seq.k_first);" in source
    assert "softmax_tile(s, m_r, l_r, alpha, t * BN, pos0, S_k, scale_log2, tq, keys);" in source
    assert "Keys(feat, b, seq.len_k).tiles(m0 + seq.shift, BM, t_lo, n_tiles);" in source


def test_tile_counter_kernels_take_only_the_sequences_own_query_blocks() -> None:
    """PERSISTENT=2 with VARLEN: the producer maps each counter item to a query block of some
    sequence (a cursor kept in shared memory), not to the longest sequence's m_blocks of every
    batch; other kernels keep the dense order, and the plain kernel has no cursor."""
    packed = render("flash_attention", DTMAO, Variant(128, True, "bf16", ("varlen",))).source
    assert "w = sched.packed_tile(item, seq, first);" in packed and "int packed_tile(" in packed
    assert "work_tile_lpt(w, m_blocks, B * H, group, mblk, bh)" not in packed
    for config, features in ((PTMAO, ("varlen",)), (DTMAO, ()), (DTMAO, ("seqlens", "window"))):
        source = render("flash_attention", config, Variant(128, True, "bf16", features)).source
        assert "int packed_tile(" not in source and "sched.packed_tile" not in source
    assert "work_tile_lpt(w, m_blocks, B * H, group, mblk, bh)" in source


# -- compiled -------------------------------------------------------------------------------------


def _h100_wgmma_seeds() -> list[Config]:
    return [s for s in load_space(builtin_spaces()["h100"]).search.listed_seeds if s.get("PATH") == "wgmma"]


SEEDS = _h100_wgmma_seeds()
THREE = ("seqlens", "softcap", "window")


@pytest.mark.parametrize("index, head_dim, causal, dtype", [
    pytest.param(i, d, c, dt, marks=() if (i, d) in ((1, 64), (7, 128)) else pytest.mark.slow)
    for i in range(len(SEEDS)) for d, c, dt in ((64, True, "bf16"), (128, False, "fp16"))],
    ids=lambda x: str(x))
def test_the_h100_wgmma_seeds_compile_with_varlen_and_every_feature_without_spills(index: int, head_dim: int, causal: bool,
                                                                                   dtype: str) -> None:
    """VARLEN alone spills nothing where the plain kernel spills nothing, and every feature
    nothing where seqlens, softcap and window spill nothing (128x192 at D128, whose consumers'
    registers are exactly their accumulators, spills some bytes with those three already; the
    three-consumer 192x128 seed is meant for D64 only)."""
    config = SEEDS[index]
    for features, baseline in ((("varlen",), ()), (ALL, THREE)):
        report = build_config("flash_attention", config, [Variant(head_dim, causal, dtype, features)], "sm_90a")
        assert not report.error, report.error
        if report.spill_bytes:
            base = build_config("flash_attention", config, [Variant(head_dim, causal, dtype, baseline)], "sm_90a")
            assert base.spill_bytes > 0, (features, report.builds[0].compiled.kernels)


def test_there_are_wgmma_seeds_of_every_kind() -> None:
    kinds = {(s.get("LOAD", "cpasync"), s.get("PERSISTENT", 0), s.get("O_TMA", 0)) for s in SEEDS}
    assert {("cpasync", 0, 0), ("tma", 0, 0), ("tma", 1, 1), ("tma", 2, 1)} <= kinds
    assert SEEDS[1].get("LOAD", "cpasync") == "cpasync" and SEEDS[7].get("O_TMA") == 1 and SEEDS[7].get("PERSISTENT") == 1


# -- tensor maps over packed tensors --------------------------------------------------------------


def test_packed_tensors_map_as_one_batch_of_every_token() -> None:
    """A (tokens, heads, head_dim) tensor's map: (head_dim, tokens, heads, 1), rows a token apart,
    heads head_dim apart, so that row q_first + m0 of head h is sequence row m0 of its sequence."""
    spec = render("flash_attention", TMA, Variant(128, True, "fp16", ("varlen",))).tensor_maps[1]
    k = torch.empty(5216, 2, 128, dtype=torch.float16)
    view = V.packed_view(k)
    assert view.shape == (1, 2, 5216, 128) and view.data_ptr() == k.data_ptr()
    geometry = tensormap.map_geometry(spec, view.shape, view.stride(), "fp16")
    assert geometry.dims == (128, 5216, 2, 1)
    assert geometry.strides[:2] == (2 * 128 * 2, 128 * 2)   # bytes: a token's row, a head
    assert geometry.box == (64, 128, 1, 1)
    one_head = tensormap.map_geometry(spec, *(lambda t: (t.shape, t.stride()))(V.packed_view(k[:, :1])), "fp16")
    assert one_head.dims == (128, 5216, 1, 1) and one_head.strides[0] == 2 * 128 * 2


# -- export ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    """An export whose cases a wgmma configuration won (and mma and wmma others): its every-feature
    kernels come from the wgmma winner."""
    root = tmp_path_factory.mktemp("wgvarlen")
    times = {SMALL: {PTMAO: 10.0, WMMA: 20.0, MMA: 26.0}, SMALL_C: {PTMAO: 9.0, WMMA: 15.0, MMA: 18.0}}
    run = make_run(root / "run", times, space=space_doc(), sdpa={SMALL: 18.0, SMALL_C: 16.0})
    export_runs([run], root / "out")
    return load_module(root / "out")


def test_an_export_of_a_wgmma_run_serves_varlen_calls_with_the_wgmma_kernel_with_every_feature(module) -> None:
    data = module._export.data
    assert data.fallback == PTMAO.key()
    for causal in (False, True):
        key = ("fp16", 64, causal, PTMAO.key(), ALL)
        assert key in module.KERNELS, sorted(k for k in module.KERNELS if len(k) == 5)
        names = [a[0] for a in module.KERNELS[key]["args"]]
        assert names[names.index("scale_log2") + 1:] == ["seqlens_k", "leftpad_k", "seqlens_q", "softcap",
                                                         "cu_seqlens_q", "cu_seqlens_k", "window_left", "window_right",
                                                         "tm_q", "tm_k", "tm_v"]
        for needed in (("varlen",), ("softcap", "varlen", "window")):
            chosen = F.select_kernel(data.kernels, ("fp16", 64, causal), PTMAO.key(), data.fallback, needed)
            assert chosen.config == PTMAO.key() and chosen.switches == ALL
            assert [m.arg for m in chosen.tensor_maps] == ["tm_q", "tm_k", "tm_v"]
    # no mma kernel with varlen was needed: the wgmma one holds every feature
    assert not any(k[3] == MMA.key() and "varlen" in k[4] for k in module.KERNELS if len(k) == 5)
