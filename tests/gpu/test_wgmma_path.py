"""PATH=wgmma (Hopper warpgroup MMA, sm_90a) against fp32 SDPA on the GPU, through the gate
the search uses: the h100 space's wgmma seeds and a few neighbours, each loading by cp.async
and by TMA (LOAD=tma), head dims 64 and 128, full and causal, every shape of the space plus
edge shapes (one token, S not a multiple of any tile, S shorter than one tile), S_q != S_k,
grouped K/V heads, strided views, and an export called through the exported module."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evoengineer.kernels import compile_source, render
from evoengineer.space import Case, Config, Variant, load_space

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

SPACE = load_space("h100")
SEEDS = [c for c in SPACE.search.seeds if c["PATH"] == "wgmma" and c["LOAD"] == "cpasync"]
TMA_SEED = next(c for c in SPACE.search.seeds if c["PATH"] == "wgmma" and c["LOAD"] == "tma")
NEIGHBOURS = [
    SEEDS[0].replace(BLOCK_N=128, STAGES=3),                       # a deeper ring, ping-pong
    SEEDS[3].replace(STAGES=3, INTRA_WG_OVERLAP=1),                # overlap without a producer
    SEEDS[1].replace(BLOCK_N=64, REG_PRODUCER=40, REG_CONSUMER=232),
    SEEDS[2].replace(STAGES=2),                                    # three consumer warpgroups, two stages
]
TMA = [TMA_SEED] + [c.replace(LOAD="tma") for c in SEEDS + NEIGHBOURS] + [
    SEEDS[1].replace(BLOCK_N=64, LOAD="tma"),                      # a 24-register producer at BLOCK_N 64 (TMA only)
    TMA_SEED.replace(BLOCK_N=176),                                  # 11 key steps of 16 per tile
]
PERSISTENT = [
    TMA_SEED.replace(PERSISTENT=1),
    TMA_SEED.replace(BLOCK_N=176, PERSISTENT=1),
    TMA_SEED.replace(INTRA_WG_OVERLAP=0, PINGPONG=0, STAGES=3, PERSISTENT=1),
    SEEDS[2].replace(LOAD="tma", PERSISTENT=1),                    # three consumer warpgroups, four stages
]
# INTRA_WG_OVERLAP=2: P V issued after the row maximum, the exponentials under it
OVERLAP2 = [c.replace(INTRA_WG_OVERLAP=2) for c in (TMA_SEED, PERSISTENT[0], PERSISTENT[1], SEEDS[3].replace(STAGES=3),
                                                    TMA_SEED.replace(PINGPONG=0, PERSISTENT=1, BLOCK_N=192), PERSISTENT[3])]
CONFIGS = [c for c in SEEDS + NEIGHBOURS + TMA + PERSISTENT + OVERLAP2 if SPACE.contains(c)]
# SOFTMAX_PIN (the softmax held before the wait for P V by a store of the row sums): with overlap 1
# and 2, ping-pong or not, persistent or not, three consumer warpgroups
PINNED = [c.replace(SOFTMAX_PIN=1) for c in (TMA_SEED, PERSISTENT[0], OVERLAP2[0], OVERLAP2[4],
                                             TMA_SEED.replace(BLOCK_N=176, PINGPONG=0), SEEDS[2].replace(LOAD="tma"))]
# O_TMA (O through shared memory and a TMA store): ping-pong or not, overlap 2, three consumer warpgroups
O_TMA = [c.replace(O_TMA=1) for c in (PERSISTENT[0], TMA_SEED.replace(PINGPONG=0, PERSISTENT=1), OVERLAP2[1], PERSISTENT[3])]
# PERSISTENT=2 (work tiles from a counter, causal ones longest first over head groups): with O_TMA, overlap 2,
# without ping-pong, three consumer warpgroups
DYNAMIC = [c.replace(PERSISTENT=2) for c in (PERSISTENT[0], O_TMA[1], O_TMA[0], OVERLAP2[4], PERSISTENT[3],
                                             SEEDS[2].replace(LOAD="tma", PERSISTENT=1))]
# Q_IN_REGS (Q K^T reads Q's A fragments from registers, the Q buffer given back at once): ping-pong or not,
# persistent (both kinds), overlap 1 and 2, O by TMA, a cp.async producer, TMA without a producer (128x192 at
# D128 spills with it: its scores and P leave no room for Q)
Q_IN_REGS = [c.replace(Q_IN_REGS=1) for c in (TMA_SEED, PERSISTENT[0], OVERLAP2[1], O_TMA[1], DYNAMIC[1],
                                        PERSISTENT[0].replace(PERSISTENT=2), NEIGHBOURS[0],
                                        TMA_SEED.replace(PRODUCER=0, REG_PRODUCER=0, REG_CONSUMER=0, PINGPONG=0, STAGES=3))]
# ... plus 80 heads of 2048 keys: persistent CTAs run ten rounds of work tiles, the last one partial
# (causal: in reverse, the snake order's odd round)
SHAPES = [(1, 8, 512), (2, 3, 77), (1, 2, 5), (1, 1, 1), (1, 1, 257), (1, 2, 1000), (1, 2, 2048), (2, 40, 2048)]


def test_the_configurations_are_in_the_space() -> None:
    assert len(SEEDS) >= 4 and len(CONFIGS) == len(SEEDS) + len(NEIGHBOURS) + len(TMA) + len(PERSISTENT) + len(OVERLAP2) == len(set(CONFIGS))


def _kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel

    rendered = render("flash_attention", config, variant)
    compiled = compile_source(rendered.source, "sm_90a")
    assert compiled.ok, compiled.error
    assert compiled.spill_bytes == 0
    return AttentionKernel(rendered, compiled.cubin_path)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS + PINNED + O_TMA + DYNAMIC + Q_IN_REGS,
                         ids=Config.label)
def test_wgmma_matches_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu.evaluate import gate_launcher

    kernel = _kernel(config, Variant(head_dim, causal))
    for batch, heads, seq in SHAPES + [(c.batch, c.heads, c.seq) for c in SPACE.cases if c.head_dim == head_dim]:
        case = Case(batch, heads, seq, head_dim, causal)
        result = gate_launcher(kernel, case, None, 2e-2, 2e-2, seed=seq, trials=1)
        assert result.status == "ok", f"{case.label()}: {result.reason}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [TMA_SEED, PERSISTENT[0], OVERLAP2[1], NEIGHBOURS[1]], ids=Config.short_label)
def test_a_row_maximum_that_keeps_growing_is_followed(config: Config, causal: bool, head_dim: int) -> None:
    """Scores that rise along the keys by about 90 (log2 units) over a row, so its maximum moves
    tile after tile and O is rescaled many times; against fp32 SDPA."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(head_dim + causal)
    for batch, heads, seq in ((1, 4, 1000), (2, 2, 2048), (1, 1, 77)):
        shape = (batch, heads, seq, head_dim)
        q = (0.1 + 0.05 * torch.randn(shape, device="cuda")).half()
        ramp = torch.linspace(0, 60 / (0.1 * head_dim ** 0.5), seq, device="cuda").view(1, 1, seq, 1)
        k = (ramp + 0.5 * torch.randn(shape, device="cuda")).half()
        v = torch.randn(shape, device="cuda").half()
        out = torch.full_like(q, float("nan"))
        _kernel(config, Variant(head_dim, causal))(q, k, v, out)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        err = (out.float() - ref).abs().max().item()
        assert err < 2e-2, f"B{batch} H{heads} S{seq}: max error {err}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", [SEEDS[0], TMA_SEED, NEIGHBOURS[1].replace(LOAD="tma"), PERSISTENT[0], PINNED[1],
                                    O_TMA[0], O_TMA[2], DYNAMIC[0], DYNAMIC[2]],
                         ids=Config.short_label)
def test_query_and_key_lengths_may_differ_and_kv_heads_may_be_grouped(config: Config, causal: bool, head_dim: int) -> None:
    import torch
    import torch.nn.functional as F

    kernel = _kernel(config, Variant(head_dim, causal))
    for seq_q, seq_k, heads_kv in ((100, 333, 8), (333, 100, 8), (300, 300, 2), (1, 64, 4), (5, 1000, 1), (1000, 5, 2)):
        q = torch.randn(2, 8, seq_q, head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(2, heads_kv, seq_k, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2, msg=f"S_q {seq_q} S_k {seq_k} H_kv {heads_kv}")


@pytest.mark.parametrize("config", [TMA_SEED, NEIGHBOURS[1].replace(LOAD="tma"), O_TMA[1], DYNAMIC[2]], ids=Config.short_label)
def test_tma_reads_views_by_their_strides_and_nothing_past_the_sequence(config: Config) -> None:
    """Tensor maps follow each tensor's strides: (B, S, H, D) storage viewed as (B, H, S, D), a
    K/V cache longer than the keys used (NaN past them: a read beyond S_k would poison the
    output), a batch of one with odd strides; and new tensors each call (maps re-encoded). With O_TMA the
    output is written through a map too: rows past S_q of the NaN-filled output must stay NaN."""
    import torch
    import torch.nn.functional as F

    for causal in (False, True):
        kernel = _kernel(config, Variant(128, causal))
        for seq_q, seq_k in ((77, 300), (300, 300), (1, 257)):
            q = torch.randn(2, seq_q, 8, 128, device="cuda", dtype=torch.float16).transpose(1, 2)
            cache_k, cache_v = (torch.full((2, 4, 1024, 128), float("nan"), device="cuda", dtype=torch.float16) for _ in range(2))
            cache_k[:, :, :seq_k].normal_()
            cache_v[:, :, :seq_k].normal_()
            k, v = cache_k[:, :, :seq_k], cache_v[:, :, :seq_k]
            out = torch.full((2, 8, seq_q, 128), float("nan"), device="cuda", dtype=torch.float16)
            rows = torch.full((2, 8, seq_q + 64, 128), float("nan"), device="cuda", dtype=torch.float16)
            out = rows[:, :, :seq_q] if config.to_dict().get("O_TMA") else out   # a view whose next rows are NaN
            kernel(q, k, v, out)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2, msg=f"causal {causal} S_q {seq_q} S_k {seq_k}")
            assert rows[:, :, seq_q:].isnan().all() or not config.to_dict().get("O_TMA")
        one = torch.randn(1, 1, 333, 128, device="cuda", dtype=torch.float16).as_strided((1, 1, 333, 128), (8, 0, 128, 1))
        out = torch.empty_like(one)
        kernel(one, one, one, out)
        ref = F.scaled_dot_product_attention(one.float(), one.float(), one.float(), is_causal=causal)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_a_tma_kernel_refuses_tensors_its_maps_cannot_describe() -> None:
    import torch

    from evoengineer.gpu import LaunchError

    kernel = _kernel(TMA_SEED, Variant(64, False))
    q = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.float16).expand(1, 2, 128, 64)   # heads stride 0
    with pytest.raises(LaunchError, match="heads stride 0"):
        kernel(q, k, k, torch.empty_like(q))


@pytest.mark.parametrize("best", [SEEDS[0], TMA_SEED, PERSISTENT[0], O_TMA[1], DYNAMIC[2]], ids=Config.short_label)
def test_an_exported_wgmma_configuration_runs_through_the_module(tmp_path: Path, best: Config) -> None:
    import torch
    import torch.nn.functional as F
    from run_fixtures import load_module, make_run

    from evoengineer.results import export_runs

    times = {label: {best: 100.0} for label in ("B1 H8 S512 D64", "B4 H16 S2048 D64", "B4 H16 S2048 D128",
                                                "B4 H16 S2048 D128 causal")}
    export_runs([make_run(tmp_path / "run", times, sdpa={label: 120.0 for label in times})], tmp_path / "out")
    module = load_module(tmp_path / "out")
    for d, causal, seq in ((128, False, 2048), (128, True, 1000), (64, False, 77)):
        q, k, v = (torch.randn(2, 4, seq, d, device="cuda", dtype=torch.float16) for _ in range(3))
        assert module.explain(q, k, v, is_causal=causal)["config"] == best.key()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        torch.testing.assert_close(module.attention(q, k, v, is_causal=causal).float(), ref, atol=2e-2, rtol=2e-2)
    # new tensors of a planned shape (their maps re-pointed), grouped K/V heads, a captured CUDA graph
    for _ in range(3):
        q = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(2, 2, 300, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        got = module.attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = module.attention(q, k, v, is_causal=True, enable_gqa=True)
    for _ in range(2):
        for t in (q, k, v):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        torch.testing.assert_close(captured.float(), ref, atol=2e-2, rtol=2e-2)


# SPLIT_TAIL (the last round's tiles cut over every CTA, full attention): the dtmao seed (ping-pong, O by
# TMA), O from registers, overlap 2, without ping-pong, three consumer warpgroups
DTMAO = next(c for c in SPACE.search.seeds if c.get("PERSISTENT") == 2 and c.get("O_TMA") == 1)
SPLIT_TAIL = [c.replace(SPLIT_TAIL=1) for c in (
    DTMAO, DTMAO.replace(O_TMA=0), DTMAO.replace(INTRA_WG_OVERLAP=2),
    DTMAO.replace(PINGPONG=0, O_TMA=0),
    DYNAMIC[4], DTMAO.replace(Q_IN_REGS=1), DTMAO.replace(BLOCK_N=160))] + [
    # SPLIT_TAIL=2 (a last round up to half full cut too): the seed, Q in registers with pin 3, and the
    # three consumer warpgroups of D64 with pin 3
    c.replace(SPLIT_TAIL=2) for c in (DTMAO, DTMAO.replace(Q_IN_REGS=1, SOFTMAX_PIN=3))]
# and the seeds valid at D64 only (searches narrowed to a D64 shape start from them)
SPLIT_TAIL_D64 = [DTMAO.replace(CONSUMER_WGS=3, BLOCK_M=192, REG_CONSUMER=160, SOFTMAX_PIN=3, SPLIT_TAIL=2),
                  *(c for c in SPACE.search.listed_seeds if c not in SPACE.search.seeds)]
# BLOCK_N 160 (ten key steps of 16; the largest K/V tile beside the O buffer at D128 with two stages): the dtmao
# seed, with the registers of 240, overlap 2 without ping-pong, not persistent
BLOCK_N_160 = [DTMAO.replace(BLOCK_N=160), DTMAO.replace(BLOCK_N=160, REG_PRODUCER=24, REG_CONSUMER=240),
               DTMAO.replace(BLOCK_N=160, INTRA_WG_OVERLAP=2, PINGPONG=0, REG_PRODUCER=24, REG_CONSUMER=240),
               TMA_SEED.replace(BLOCK_N=160)]


# SOFTMAX_PIN 2 and 3 (the row maximum, or it and half the exponentials, held before the wait for P V):
# the seeds that take them, Q in registers and not, SPLIT_TAIL, persistent or not, ping-pong or not,
# three consumer warpgroups (and the seed with three from the counter)
PIN_MAX = [c.replace(SOFTMAX_PIN=pin) for pin in (2, 3) for c in (
    DTMAO.replace(Q_IN_REGS=1), SPLIT_TAIL[5], O_TMA[0].replace(Q_IN_REGS=1, REG_CONSUMER=232), PERSISTENT[0], TMA_SEED,
    TMA_SEED.replace(PINGPONG=0, PERSISTENT=1), SEEDS[2].replace(LOAD="tma"))] + [
    next(c for c in SPACE.search.seeds if c.get("CONSUMER_WGS") == 3 and c.get("SOFTMAX_PIN"))]


def test_the_block_n_160_configurations_are_in_the_space() -> None:
    assert all(SPACE.contains(c) for c in BLOCK_N_160 + SPLIT_TAIL[6:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", BLOCK_N_160, ids=Config.short_label)
def test_block_n_160_matches_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    test_wgmma_matches_sdpa(config, causal, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", PIN_MAX, ids=Config.short_label)
def test_softmax_pin_2_and_3_match_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    test_wgmma_matches_sdpa(config, causal, head_dim)


def split_shapes(sms: int, rows: int, fuller: bool = False) -> list[tuple[int, int, int, int, int]]:
    """(B, H, H_kv, S_q, S_k) whose work tiles of ``rows`` query rows outnumber ``sms`` CTAs with
    a last round that SPLIT_TAIL cuts (0 < tiles % sms <= sms / 8; ``fuller``: sms / 4 < tiles % sms
    <= sms / 2, which only SPLIT_TAIL=2 cuts): query blocks of one tile, of several with rows past
    S_q, K/V lengths not a multiple of any tile, grouped K/V heads."""
    out = []
    for batch, seq_q, seq_k, group in ((1, rows, 1500, 1), (1, 1000, 1000, 1), (2, 300, 2048, 2), (1, 1000, 77, 2),
                                       (1, 2 * rows, 4096, 1)):
        blocks = -(-seq_q // rows)
        least = sms + (sms // 4 + 1 if fuller else 1)
        heads = -(-least // (batch * blocks * group)) * group   # the fewest heads with that many tiles
        tiles = batch * heads * blocks
        low, high = (sms // 4, sms // 2) if fuller else (0, sms // 8)
        assert tiles > sms and low < tiles % sms <= high, (seq_q, tiles, sms)
        out.append((batch, heads, heads // group, seq_q, seq_k))
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("config", SPLIT_TAIL, ids=Config.short_label)
def test_split_tail_cuts_the_last_tiles_over_every_cta_and_matches_sdpa(config: Config, head_dim: int) -> None:
    """Each shape cuts its last round's tiles into one chunk per multiprocessor, pieces of two CTAs
    merged by the second to finish; NaN-poisoned outputs, against fp32 SDPA, each shape twice (the
    cuts' counters zeroed per call). Causal runs the same source without the cuts."""
    _check_split_tail(config, head_dim)


@pytest.mark.parametrize("config", SPLIT_TAIL_D64, ids=Config.short_label)
def test_split_tail_2_on_three_warpgroups_matches_sdpa(config: Config) -> None:
    _check_split_tail(config, 64)


def _check_split_tail(config: Config, head_dim: int) -> None:
    import torch
    import torch.nn.functional as F

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for causal in (False, True):
        kernel = _kernel(config, Variant(head_dim, causal))
        launch = kernel.rendered.launches[0]
        assert (launch.split_tail is not None) == (not causal)
        shapes = split_shapes(sms, launch.rows_per_cta)
        if config["SPLIT_TAIL"] == 2:
            shapes += split_shapes(sms, launch.rows_per_cta, fuller=True)
        for batch, heads, heads_kv, seq_q, seq_k in shapes:
            torch.manual_seed(seq_q + seq_k + heads)
            q = torch.randn(batch, heads, seq_q, head_dim, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(batch, heads_kv, seq_k, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
            for _ in range(2):
                out = torch.full_like(q, float("nan"))
                kernel(q, k, v, out)
                torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2,
                                           msg=f"causal {causal} B{batch} H{heads}/{heads_kv} S_q {seq_q} S_k {seq_k}")


def test_an_exported_split_tail_kernel_cuts_its_tiles_eagerly_and_in_a_graph(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F
    from run_fixtures import load_module, make_run

    from evoengineer.results import export_runs

    best = SPLIT_TAIL[0]
    times = {label: {best: 100.0} for label in ("B4 H16 S2048 D64", "B4 H16 S2048 D128")}
    export_runs([make_run(tmp_path / "run", times, sdpa={label: 120.0 for label in times})], tmp_path / "out")
    module = load_module(tmp_path / "out")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, heads, heads_kv, seq_q, seq_k in split_shapes(sms, 128)[1:3]:
        q = torch.randn(batch, heads, seq_q, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, heads_kv, seq_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        plan = module.explain(q, k, v, enable_gqa=True)
        assert plan["config"] == best.key() and plan["workspace_bytes"] > 4 * sms * 128 * 68
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        torch.testing.assert_close(module.attention(q, k, v, enable_gqa=True).float(), ref, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = module.attention(q, k, v, enable_gqa=True)
    for _ in range(3):
        for t in (q, k, v):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        torch.testing.assert_close(captured.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_search_evaluates_tma_configurations_as_it_evaluates_cpasync_ones() -> None:
    """Through the search's Evaluator: the gate in a worker process, then CUDA-graph timing with
    rotated inputs (the launch captured in a graph must write the output on its stream)."""
    from dataclasses import replace

    from evoengineer.gpu import Evaluator

    space = SPACE.with_shapes([(1, 8, 512, 64), (4, 16, 2048, 128)])
    space = replace(space, timing=replace(space.timing, warmup=2, repetitions=10, timeout_s=60))
    with Evaluator(space, gate_trials=1) as evaluator:
        for config in (TMA_SEED, TMA_SEED.replace(LOAD="cpasync"), NEIGHBOURS[1].replace(LOAD="tma")):
            result = evaluator.evaluate(config)
            assert result.status == "ok", f"{config.short_label()}: {result.reason}"
            timed = [c for c in result.cases if c.get("time")]
            assert len(timed) == len(space.cases) and all(c["tflops"] > 0 for c in timed)


# -- bf16 ----------------------------------------------------------------------------------------

BF16_SPACE = load_space("h100-bf16")
BF16_SEEDS = [c for c in BF16_SPACE.search.seeds if c["PATH"] == "wgmma"]   # tma 128x128, persistent (O from registers and by TMA), cp.async 192x128

# ... and those of them that take Q_IN_REGS (Q K^T reading bf16 Q fragments from registers)
BF16_Q_IN_REGS = [c.replace(Q_IN_REGS=1) for c in BF16_SEEDS if BF16_SPACE.contains(c.replace(Q_IN_REGS=1))]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", BF16_SEEDS + BF16_Q_IN_REGS, ids=Config.short_label)
def test_bf16_wgmma_matches_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu.evaluate import gate_launcher
    from evoengineer.space import DEFAULT_TOLERANCES

    atol, rtol = BF16_SPACE.tolerance("bf16")
    assert (atol, rtol) == DEFAULT_TOLERANCES["bf16"]
    kernel = _kernel(config, Variant(head_dim, causal, "bf16"))
    for batch, heads, heads_kv, seq in ((2, 3, 3, 77), (1, 2, 2, 1000), (1, 1, 1, 1), (2, 8, 2, 300), (1, 8, 2, 2048)):
        case = Case(batch, heads, seq, head_dim, causal, heads_kv=heads_kv, dtype="bf16")
        result = gate_launcher(kernel, case, None, atol, rtol, seed=seq + heads, trials=1)
        assert result.status == "ok", f"{case.label()}: {result.reason}"


def test_an_exported_bf16_wgmma_configuration_runs_through_the_module(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F
    from run_fixtures import load_module, make_run, space_doc

    from evoengineer.results import export_runs

    best = BF16_SEEDS[0]
    assert best["LOAD"] == "tma"
    doc = space_doc()
    doc["problem"]["dtype"] = "bf16"
    times = {label: {best: 100.0} for label in ("B1 H8 S512 D64 bf16", "B4 H16 S2048 D64 bf16", "B4 H16 S2048 D128 bf16",
                                                "B4 H16 S2048 D128 causal bf16")}
    export_runs([make_run(tmp_path / "run", times, sdpa={label: 120.0 for label in times}, space=doc)], tmp_path / "out")
    module = load_module(tmp_path / "out")
    atol, rtol = BF16_SPACE.tolerance("bf16")
    for d, causal, seq, heads_kv in ((128, False, 2048, 4), (128, True, 1000, 4), (64, False, 77, 4), (128, True, 300, 2)):
        q = torch.randn(2, 4, seq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, heads_kv, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        assert module.explain(q, k, v, is_causal=causal, enable_gqa=True)["config"] == best.key()
        got = module.attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert got.dtype == torch.bfloat16
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol, msg=f"D{d} causal {causal} S {seq} H_kv {heads_kv}")
