"""The backward's wgmma path without a GPU: its rules (``paths.wgmma_backward``) agree with the template
(``_attn_bwd_wgmma.cuh.j2``) on every combination of its parameters, the h100-backward space holds exactly the
configurations the rules build, and every valid configuration compiles for sm_90a with NVRTC (fp16 and bf16,
head dims 64 and 128, full and causal) without spills."""
from __future__ import annotations

import itertools

import pytest

from evoengineer import paths
from evoengineer.kernels import RenderError, compile_many, render
from evoengineer.kernels.backward_rules import (
    BACKWARD_TEMPLATE,
    WGMMA_CONFIGS,
    backward_arguments,
    backward_launch_arguments,
    backward_launches,
    fits,
    problems,
    smem_bytes,
    warps,
    wgmma_config,
)
from evoengineer.runtime.loading import required_arch
from evoengineer.space import Config, Variant, load_space

RULES = paths.get("wgmma", BACKWARD_TEMPLATE)
SPACE = load_space("h100-backward")
MMA = Config(PATH="mma", DKDV="tiles", BLOCK_M=64, BLOCK_N=128, STAGES=2, DQ_MODE="atomic", DQ_BLOCK_M=64, DQ_BLOCK_N=64)
VALUES = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (64, 128, 192), "CONSUMER_WGS": (1, 2, 3), "STAGES": (1, 2, 3),
          "DQ_MODE": ("atomic", "separate"), "PRODUCER": (0, 1, 2), "LOAD": ("cpasync", "tma", "bulk")}


def _every_combination():
    for values in itertools.product(*VALUES.values()):
        yield Config(PATH="wgmma", **dict(zip(VALUES, values)))


def test_the_path_is_the_backward_templates_own() -> None:
    assert RULES is paths.wgmma_backward.PATH and RULES is not paths.get("wgmma")
    assert set(paths.of_template(BACKWARD_TEMPLATE)) == {"mma", "wgmma"}
    assert wgmma_config(64, 128).short_label() == "bwg 64x128 st2 dq=atomic"
    assert wgmma_config(128, 64, stages=1).short_label() == "bwg 128x64 dq=atomic"


@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_rules_and_the_template_agree_on_every_combination(head_dim: int) -> None:
    built = 0
    for config in _every_combination():
        broken = problems(config, head_dim)
        for causal in (False, True):
            variant = Variant(head_dim, causal, "bf16")
            if broken:
                with pytest.raises(RenderError):
                    render(BACKWARD_TEMPLATE, config, variant)
                continue
            rendered = render(BACKWARD_TEMPLATE, config, variant)
            built += 1
            assert required_arch(rendered.source) == "sm_90a"
            launches = backward_launches(rendered)
            assert [(l.kernel, l.over) for l in launches] == [("attn_bwd_pre", "q"), ("attn_bwd_dkdv", "kv"),
                                                              ("attn_bwd_dq_convert", "q")]
            assert {l.kernel: l.smem for l in launches} == smem_bytes(config, head_dim), config.label()
            dkdv = launches[1]
            assert dkdv.block == (32 * warps(config), 1, 1) and dkdv.rows_per_cta == config["BLOCK_N"]
            # the mma path's argument list and workspaces: the runtime launches either path alike
            mma = render(BACKWARD_TEMPLATE, MMA, variant)
            assert backward_arguments(rendered) == backward_arguments(mma)
            # LOAD tma: six tensor maps after them, the dK/dV kernel's
            tma = config["LOAD"] == "tma"
            assert [m.tensor for m in rendered.tensor_maps] == (list(paths.wgmma_backward.TENSOR_MAPS) if tma else [])
            assert backward_launch_arguments(rendered) == backward_arguments(mma) + [
                (f"tm_{t}", "tmap") for t in (paths.wgmma_backward.TENSOR_MAPS if tma else ())]
    assert built == {64: 2 * (9 + 5), 128: 2 * (3 + 1)}[head_dim]


def test_the_rules_name_what_they_refuse() -> None:
    assert problems(wgmma_config(128, 128), 128) == [
        "BLOCK_M 128 CONSUMER_WGS 2 STAGES 2 PRODUCER 0: wgmma.registers: S^T, dP^T, dK and dV accumulators (BLOCK_M + head dim "
        "floats, 64 more where one warpgroup prefetches the next tile alone) within 192"]
    assert problems(wgmma_config(64, 128).replace(CONSUMER_WGS=1), 64)[0].startswith("BLOCK_N 128 CONSUMER_WGS 1: wgmma.keys:")
    assert problems(wgmma_config(64, 128).replace(DQ_MODE="separate"), 64)[0].startswith("DQ_MODE separate: wgmma.dq-mode:")
    assert problems(Config(PATH="wmma", BLOCK_M=64, BLOCK_N=64), 64) == ["PATH 'wmma': the backward's paths are mma, wgmma"]
    assert problems(wgmma_config(64, 128).replace(DKDV="tiles"), 64) == ["PATH wgmma: the wgmma path does not use DKDV"]
    # the arch is the space's: an sm_90 space (no wgmma) refuses the path
    scope = RULES.scope(wgmma_config(64, 128), {"ARCH_NAME": "sm_90", "MIN_HEAD_DIM": 64, "MAX_HEAD_DIM": 64,
                                               "SMEM_LIMIT": 232448})
    assert [r.name for r in RULES.rules if not r(scope)] == ["wgmma.arch"]


def test_the_backward_space_holds_exactly_the_wgmma_configurations_the_rules_build() -> None:
    assert SPACE.target.arch == "sm_90a"
    dims = sorted({c.head_dim for c in SPACE.cases})
    valid = {c for c in SPACE.valid_configs() if c["PATH"] == "wgmma"}
    own = next(p for p in SPACE.paths if p.name == "wgmma")
    for values in itertools.product(*(p.values for p in own.params)):
        config = Config(PATH="wgmma", **dict(zip(own.param_names, values)))
        assert (config in valid) == all(fits(config, d, SPACE.target.smem_per_block) for d in dims), config.label()
    assert valid and {c for c in SPACE.search.seeds if c["PATH"] == "wgmma"} <= valid
    # narrowed to D64, the 128-row tile (BLOCK_M + D over 192 at D128) joins, as its seed
    d64 = SPACE.with_shapes([(4, 16, 2048, 64, 2048)])
    wide = wgmma_config(128, 128, producer=1, load="cpasync")
    assert d64.contains(wide) and not SPACE.contains(wide) and wide in d64.search.seeds


def _valid_builds() -> list[tuple[Config, Variant]]:
    out = []
    for head_dim in (64, 128):
        space = SPACE.with_shapes([(4, 16, 2048, head_dim, 2048)])
        for config in sorted((c for c in space.valid_configs() if c["PATH"] == "wgmma"), key=Config.label):
            for dtype, causal in itertools.product(("fp16", "bf16"), (False, True)):
                out.append((config, Variant(head_dim, causal, dtype)))
    return out


def test_every_valid_wgmma_configuration_compiles_for_sm90a_without_spills() -> None:
    builds = _valid_builds()
    named = {(d, SPACE.complete(c)) for d, by_name in WGMMA_CONFIGS.items() for c in by_name.values()}
    seeds = {c for c in SPACE.search.listed_seeds if c["PATH"] == "wgmma"}
    assert {(d, c) for c in seeds for d in (64, 128) if not problems(c, d)} | named <= {(v.head_dim, c) for c, v in builds}
    results = list(compile_many([render(BACKWARD_TEMPLATE, c, v).source for c, v in builds], "sm_90a", workers=2))
    failed = [f"{c.label()} {v.label()}: {r.error}" for (c, v), r in zip(builds, results) if not r.ok]
    assert not failed, failed[:3]
    spilled = [f"{c.label()} {v.label()}: {r.spill_bytes} bytes" for (c, v), r in zip(builds, results) if r.spill_bytes]
    assert not spilled, spilled
    assert not any(r.wgmma_serialized for r in results)
    bulk = {(v.head_dim, c) for c, v in builds if c["DQ_MODE"] == "bulk"}
    assert bulk == {(v.head_dim, c.replace(DQ_MODE="bulk")) for c, v in builds if c["LOAD"] == "tma" and c["DQ_MODE"] == "atomic"}
    assert len(builds) == 4 * (9 + 5 + 3 + 1) + 4 * len(bulk)   # each TMA configuration's DQ_MODE bulk twin


def test_an_export_takes_a_wgmma_backward_by_name_or_parameters() -> None:
    from evoengineer.results.export_backward import parse_backward_option, short_backward

    assert parse_backward_option("D128:w64n128-pr") == {128: WGMMA_CONFIGS[128]["w64n128-pr"]}
    assert parse_backward_option("PATH=wgmma,BLOCK_M=64,BLOCK_N=128,CONSUMER_WGS=2,PRODUCER=1") == {
        64: wgmma_config(64, 128, producer=1, load="cpasync"), 128: wgmma_config(64, 128, producer=1, load="cpasync")}
    # a configuration valid at one head dim only (at D128 without a producer ptxas spills)
    assert parse_backward_option("PATH=wgmma,BLOCK_M=64,BLOCK_N=128,CONSUMER_WGS=2") == {
        64: wgmma_config(64, 128, load="cpasync")}
    assert parse_backward_option("PATH=wgmma,BLOCK_M=128,BLOCK_N=128,CONSUMER_WGS=2,PRODUCER=1") == {
        64: wgmma_config(128, 128, producer=1, load="cpasync")}
    assert short_backward(wgmma_config(64, 128)) == "bwd wgmma 64x128 st2 atomic"
    # the TMA twins: by name at both head dims, by parameters (a producer needed)
    assert parse_backward_option("w64n128-tma") == {d: wgmma_config(64, 128, producer=1, load="tma") for d in (64, 128)}
    assert parse_backward_option("PATH=wgmma,BLOCK_M=64,BLOCK_N=128,CONSUMER_WGS=2,PRODUCER=1,LOAD=tma") == {
        d: wgmma_config(64, 128, producer=1, load="tma") for d in (64, 128)}
    with pytest.raises(Exception, match="wgmma.load"):
        parse_backward_option("PATH=wgmma,BLOCK_M=64,BLOCK_N=128,CONSUMER_WGS=2,LOAD=tma")
    assert short_backward(wgmma_config(64, 128, producer=1, load="tma")) == "bwd wgmma 64x128 st2 tma atomic"


def test_the_producer_takes_the_setmaxnreg_values_of_the_path_rules() -> None:
    """Two consumer warpgroups beside a producer get ``registers``; one warpgroup or no producer, none."""
    for config, d in ((wgmma_config(64, 128, producer=1), 128), (wgmma_config(128, 128, producer=1, load="tma", dq_mode="bulk"), 64)):
        producer, consumer = paths.wgmma_backward.registers(config)
        assert producer + 2 * consumer <= 504 and producer >= 24
        source = render(BACKWARD_TEMPLATE, config, Variant(d, False, "bf16")).source
        assert f"REG_PRODUCER = {producer};" in source and f"REG_CONSUMER = {consumer};" in source
    assert paths.wgmma_backward.registers(wgmma_config(128, 128, producer=1, load="tma", dq_mode="bulk")) == (32, 232)
    assert paths.wgmma_backward.registers(wgmma_config(64, 128, producer=1, load="tma", dq_mode="bulk")) == (24, 240)
    for config in (wgmma_config(64, 128, stages=1), wgmma_config(64, 64, producer=1)):
        source = render(BACKWARD_TEMPLATE, config, Variant(64, False, "fp16")).source
        assert "REG_PRODUCER = 0;" in source and "REG_CONSUMER = 0;" in source


def test_the_gemm_order_is_the_path_rules() -> None:
    """The dK/dV kernel takes FlashAttention-3's GEMM order exactly where ``overlap_gemms`` says (64 rows, a second
    warpgroup at D128), for every valid configuration of each head dim."""
    seen = set()
    for head_dim in (64, 128):
        space = SPACE.with_shapes([(4, 16, 2048, head_dim, 2048)])
        for config in (c for c in space.valid_configs() if c["PATH"] == "wgmma"):
            want = paths.wgmma_backward.overlap_gemms(config, head_dim)
            source = render(BACKWARD_TEMPLATE, config, Variant(head_dim, True, "bf16")).source
            assert f"constexpr bool OVERLAP = {str(want).lower()};" in source, (config.label(), head_dim)
            seen.add(want)
    assert seen == {True, False}


def test_the_default_search_opens_every_partition_with_its_wgmma_seeds() -> None:
    """The default backward search (its budget split over the head-dim partitions) evaluates the
    seeds first, in order: each partition's budget reaches every wgmma seed valid there, the
    Hopper path ahead of the mma fallbacks."""
    from evoengineer.search.partition import plan
    from evoengineer.search.strategies import SAMPLERS

    parts = plan(SPACE, "head-dim", SPACE.search.budget)
    assert len(parts) == 4
    for part in parts:
        opening = [c for c in SAMPLERS["evo"].opening(part.space) if part.space.contains(c)]
        wgmma = [c for c in opening if c["PATH"] == "wgmma"]
        assert wgmma and opening[: len(wgmma)] == wgmma and len(wgmma) <= part.trials
        if part.space.variants[0].head_dim == 64:
            assert Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=128, CONSUMER_WGS=2, STAGES=2, DQ_MODE="atomic",
                          PRODUCER=1, LOAD="cpasync") in wgmma


LSE_FORWARD = Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=128, CONSUMER_WGS=2, INTRA_WG_OVERLAP=1, LOAD="tma", O_TMA=1,
                     PERSISTENT=1, PINGPONG=0, PRODUCER=1, Q_IN_REGS=1, REG_CONSUMER=240, REG_PRODUCER=24,
                     SOFTMAX_PIN=3, SPLIT_TAIL=0, STAGES=2)


def test_a_wgmma_forward_writes_the_lse_for_the_backward_without_spills() -> None:
    """WRITE_LSE=1 on the wgmma forward: one workspace float per row (the LSE), the rows' stores
    to global memory in the SASS, no spills; off, the kernel renders as without the switch; with a
    tile counter (its workspace) the render refuses."""
    from evoengineer.kernels.backward_rules import FORWARD_TEMPLATE
    from evoengineer.kernels.sass import disassemble, nvdisasm, opcodes

    variants = [Variant(d, causal, dtype) for d, causal, dtype in ((64, True, "fp16"), (128, False, "bf16"))]
    for variant in variants:   # the first line names the configuration
        assert render(FORWARD_TEMPLATE, LSE_FORWARD.replace(WRITE_LSE=0), variant).source.split("\n", 1)[1] == \
            render(FORWARD_TEMPLATE, LSE_FORWARD, variant).source.split("\n", 1)[1]
    with pytest.raises(RenderError, match="WRITE_LSE"):
        render(FORWARD_TEMPLATE, LSE_FORWARD.replace(PERSISTENT=2, WRITE_LSE=1), variants[0])
    sources = [render(FORWARD_TEMPLATE, LSE_FORWARD.replace(WRITE_LSE=lse), v) for v in variants for lse in (0, 1)]
    assert [r.workspace_floats_per_row for r in sources] == [0, 1, 0, 1]
    results = list(compile_many([r.source for r in sources], "sm_90a", workers=2))
    assert all(r.ok and r.spill_bytes == 0 for r in results), [r.error or r.log[-300:] for r in results]
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    stores = [sum(n for op, n in opcodes(disassemble(r.cubin_path, tool)).items() if op.startswith("STG")) for r in results]
    assert stores[1] > stores[0] and stores[3] > stores[2], stores
