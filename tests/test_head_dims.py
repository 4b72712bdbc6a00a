"""Head dims beyond 64 and 128 without a GPU: each path's ``head-dims`` rule, the mma path's
swizzle rule, the model-family spaces that use them, and NVRTC compiles of their seeds."""
from __future__ import annotations

import collections

import pytest
import yaml

from evoengineer import paths
from evoengineer.kernels import RenderError, compile_many, render
from evoengineer.resources import builtin_spaces
from evoengineer.space import Config, SpaceError, Variant, load_space, parse_space

FAMILIES = ("llama3-8b", "qwen2.5-7b", "mistral-7b", "gemma2-9b", "phi3-mini")
WGMMA = Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=64, STAGES=2, Q_IN_REGS=0, CONSUMER_WGS=2, PRODUCER=1,
               REG_PRODUCER=24, REG_CONSUMER=240, INTRA_WG_OVERLAP=1, PINGPONG=0, LOAD="tma", PERSISTENT=0, O_TMA=0,
               SPLIT_TAIL=0, SOFTMAX_PIN=0)
MMA = Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SMEM_LAYOUT="swizzle", Q_IN_REGS=0,
             P_IN_REGS=1, SPLITS=1, KV_GROUPS=1)


def _h100_with(*head_dims: int):
    doc = yaml.safe_load(builtin_spaces()["h100"].read_text())
    doc["problem"]["shapes"] = [{"B": 2, "H": 8, "S": 1024, "D": d, "causal": [False, True]} for d in head_dims]
    doc["search"]["seeds"] = []
    return parse_space(doc, "h100-dims.yaml")


def _paths_of(space) -> collections.Counter:
    return collections.Counter(str(c["PATH"]) for c in space.valid_configs())


def test_the_forward_holds_the_union_of_its_paths_head_dims() -> None:
    assert paths.head_dims() == (32, 64, 80, 96, 128, 192, 256)
    assert paths.head_dims(paths.BACKWARD_TEMPLATE) == (64, 128)
    assert paths.get("wgmma").head_dims == (32, 64, 80, 96, 128, 192, 256)


def test_a_head_dim_no_path_holds_is_refused_naming_the_key() -> None:
    doc = yaml.safe_load(builtin_spaces()["h100"].read_text())
    doc["problem"]["shapes"][1]["D"] = 72
    with pytest.raises(SpaceError) as err:
        parse_space(doc, "h100-72.yaml")
    assert err.value.key == "problem.shapes[1].D" and "96" in str(err.value) and "72" in str(err.value)


def test_head_dim_96_is_searched_on_mma_with_padded_rows_and_on_wgmma_in_whole_panels_by_tma() -> None:
    space = _h100_with(96)
    found = _paths_of(space)
    assert set(found) == {"mma", "wgmma"} and found["mma"] > 100 and found["wgmma"] > 100
    assert all(c["SMEM_LAYOUT"] == "pad" for c in space.valid_configs() if c["PATH"] == "mma")
    assert all(c["LOAD"] == "tma" for c in space.valid_configs() if c["PATH"] == "wgmma")
    assert space.violations(WGMMA) == []
    assert any("wgmma.panel-head-dims" in v for v in space.violations(WGMMA.replace(LOAD="cpasync")))
    assert any("mma.swizzle" in v for v in space.violations(MMA))
    with pytest.raises(RenderError, match="SWIZZLES_ROWS_OF_A_MULTIPLE_OF_64"):
        render("flash_attention", MMA, Variant(96, False))


def test_head_dim_256_is_searched_on_mma_and_wgmma_within_shared_memory() -> None:
    space = _h100_with(256)
    found = _paths_of(space)
    assert set(found) == {"mma", "wgmma"}
    wgmma = paths.get("wgmma")
    assert all(wgmma.smem(c, 256) <= space.target.smem_per_block for c in space.valid_configs() if c["PATH"] == "wgmma")
    assert space.violations(WGMMA) == []
    too_big = WGMMA.replace(BLOCK_N=192)   # 2 stages of 192 x 256 K and V tiles: 384 KB
    assert any("wgmma.smem" in v for v in space.violations(too_big))


def test_a_space_of_two_head_dims_keeps_a_path_only_where_it_holds_both() -> None:
    mixed = _h100_with(64, 256)   # wgmma holds both, but its 128x192 tiles overflow shared memory at D256
    big = WGMMA.replace(BLOCK_N=192)
    assert mixed.violations(big, head_dim=64) == []   # narrowed to D64 (--shape), it joins
    assert any("wgmma.smem" in v for v in mixed.violations(big))
    assert any("wgmma.smem" in v for v in mixed.violations(big, head_dim=256))
    assert not any(c == big for c in mixed.valid_configs())
    cpasync = _h100_with(64, 96)   # a cp.async wgmma kernel holds D64, not D96
    by_threads = WGMMA.replace(LOAD="cpasync", BLOCK_N=128)
    assert cpasync.violations(by_threads, head_dim=64) == []
    assert [v.split(":")[0] for v in cpasync.violations(by_threads)] == ["wgmma.panel-head-dims"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_model_family_space_loads_with_valid_seeds_in_both_dtypes(name: str) -> None:
    space = load_space(name)
    assert space.dtypes == ("bf16", "fp16")
    assert all(c.causal for c in space.cases if c.seq > 1)
    # each seed is valid where its partition searches it (a path without packed sequences: in the dense ones)
    from evoengineer.search.partition import split_cases

    parts = [part for _, part in split_cases(space, "head-dim")]
    assert {s for part in parts for s in part.search.seeds} == set(space.search.listed_seeds)
    for part in parts:
        for seed in part.search.seeds:
            assert part.violations(seed) == [], seed
    dims = {c.head_dim for c in space.cases}
    assert len(dims) == 1 and dims <= set(paths.get("mma").head_dims)


def test_the_family_spaces_carry_their_models_features() -> None:
    gemma, mistral, phi = load_space("gemma2-9b"), load_space("mistral-7b"), load_space("phi3-mini")
    assert {c.softcap for c in gemma.cases} == {50.0} and (4095, 0) in {c.window for c in gemma.cases}
    assert {c.window for c in mistral.cases} == {(-1, -1), (4095, 0)}
    assert {c.head_dim for c in phi.cases} == {96} and (2046, 0) in {c.window for c in phi.cases}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_family_seeds_compile_for_sm_90a_without_spills(name: str) -> None:
    space = load_space(name)
    variants = {c.variant for c in space.cases if c.dtype == "bf16"}
    rendered = []
    for seed in space.search.seeds:
        for variant in sorted(variants, key=lambda v: v.label()):
            try:
                rendered.append((seed, variant, render("flash_attention", seed, variant)))
            except RenderError as exc:   # wgmma without a feature its case needs
                assert seed["PATH"] == "wgmma" and variant.features, exc
    assert rendered
    results = list(compile_many([r.source for *_, r in rendered], "sm_90a"))
    for (seed, variant, _), res in zip(rendered, results):
        assert res.ok, (seed.label(), variant.label(), res.error)
        spills = {name: k.spills for name, k in res.kernels.items() if k.spills}
        assert not spills, (seed.label(), variant.label(), spills)


def test_a_cp_async_wgmma_kernel_past_head_dim_128_is_refused_by_its_rule_and_would_not_build() -> None:
    big = _h100_with(256)
    cpasync = WGMMA.replace(LOAD="cpasync", REG_PRODUCER=32, REG_CONSUMER=232)
    assert [v.split(":")[0] for v in big.violations(cpasync)] == ["wgmma.cpasync-head-dims"]
    assert _h100_with(128).violations(cpasync) == []
    assert not any(c["LOAD"] == "cpasync" for c in big.valid_configs() if c["PATH"] == "wgmma")
    # what the rule keeps out: the loader's 128 threads would step 4 rows at a time over D256's 32 chunks
    result = next(compile_many([render("flash_attention", cpasync, Variant(256, True)).source], "sm_90a"))
    assert not result.ok and "rows a thread visits share a swizzle key" in result.error
