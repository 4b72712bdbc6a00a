"""The wgmma path in bf16 without a GPU: the h100-bf16 space's wgmma configurations render with
bf16 wgmma operands (shared-memory and register-A forms), bf16 P and output packing, the same
launches and tensor maps as fp16, and compile with NVRTC for sm_90a without spills."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from evoengineer.gpu.tensormap import DATA_TYPES
from evoengineer.kernels import compile_many, render
from evoengineer.space import Config, Variant, load_space

REPO = Path(__file__).resolve().parent.parent
SPACE = load_space("h100-bf16")
SEEDS = [c for c in SPACE.search.seeds if c["PATH"] == "wgmma"]
TMA_SEED = next(c for c in SEEDS if c["LOAD"] == "tma")
WIDE_SEED = next(c for c in SEEDS if c["CONSUMER_WGS"] == 3)
# the seeds, each with the other load, and one without a producer
CONFIGS = [TMA_SEED, TMA_SEED.replace(LOAD="cpasync"), WIDE_SEED, WIDE_SEED.replace(LOAD="tma"),
           TMA_SEED.replace(PRODUCER=0, REG_PRODUCER=0, REG_CONSUMER=0, PINGPONG=0, STAGES=3, BLOCK_M=64,
                            CONSUMER_WGS=1, BLOCK_N=64, LOAD="cpasync")]
VARIANTS = [Variant(64, False, "bf16"), Variant(128, True, "bf16")]


def test_the_bf16_space_has_the_wgmma_seeds_on_sm_90a() -> None:
    assert SPACE.target.arch == "sm_90a" and SPACE.dtypes == ("bf16",)
    assert [c.short_label() for c in SEEDS] == ["tma 128x128 st2 r24/240 ovl pp", "ptma 128x128 st2 r24/240 ovl pp",
                                                   "ptmao 128x128 st2 r24/240 ovl pp", "dtma 128x192 st2 r24/240 ovl",
                                                   "wgmma 192x128 st2 r32/160"]
    assert all(SPACE.contains(c) for c in CONFIGS)
    loads = {c["LOAD"] for c in SPACE.valid_configs() if c["PATH"] == "wgmma"}
    assert loads == {"cpasync", "tma"}


@pytest.mark.parametrize("config", CONFIGS, ids=Config.short_label)
@pytest.mark.parametrize("variant", VARIANTS, ids=Variant.label)
def test_bf16_wgmma_renders_bf16_instructions_only(config: Config, variant: Variant) -> None:
    bf16 = render("flash_attention", config, variant)
    fp16 = render("flash_attention", config, Variant(variant.head_dim, variant.causal))
    bn, d = config["BLOCK_N"], variant.head_dim
    for form in (f"m64n{bn}k16.f32.bf16.bf16 ", f"m64n{d}k16.f32.bf16.bf16 "):   # S = Q K^T (smem), O += P V (reg A)
        assert f"wgmma.mma_async.sync.aligned.{form}" in bf16.source
        assert f"wgmma.mma_async.sync.aligned.{form.replace('bf16', 'f16')}" in fp16.source
    assert "cvt.rn.bf16x2.f32" in bf16.source and "cvt.rn.f16x2.f32" in fp16.source   # P and O packing
    assert not re.search(r"(?<!b)f16", bf16.source), "an fp16 instruction in a bf16 kernel"
    assert bf16.launches == fp16.launches and bf16.max_smem == fp16.max_smem
    assert bf16.tensor_maps == fp16.tensor_maps and bool(bf16.tensor_maps) == (config["LOAD"] == "tma")
    assert bf16.launch_metadata()["variant"]["dtype"] == "bf16"


def test_tensor_maps_name_bfloat16() -> None:
    assert DATA_TYPES == {"fp16": 6, "bf16": 9}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16 in cuda.h


@pytest.fixture(scope="module")
def compiled() -> dict:
    builds = [(c, v) for c in CONFIGS for v in VARIANTS]
    sources = [render("flash_attention", c, v).source for c, v in builds]
    return {(c.short_label(), v.label()): r for (c, v), r in zip(builds, compile_many(sources, "sm_90a", workers=2))}


@pytest.mark.parametrize("config", CONFIGS, ids=Config.short_label)
@pytest.mark.parametrize("variant", VARIANTS, ids=Variant.label)
def test_bf16_wgmma_compiles_for_sm_90a_without_spills(config: Config, variant: Variant, compiled: dict) -> None:
    result = compiled[(config.short_label(), variant.label())]
    assert result.ok, f"{result.error}\n{result.log[-2000:]}"
    assert result.spill_bytes == 0 and result.stack_bytes == 0, result.kernels
    threads = render("flash_attention", config, variant).launches[0].threads
    assert result.registers <= 65536 // threads
