"""PATH=wgmma (Hopper warpgroup MMA, sm_90a) against fp32 SDPA on the GPU, through the gate
the search uses: the h100 space's wgmma seeds and a few neighbours, head dims 64 and 128,
full and causal, every shape of the space plus edge shapes (one token, S not a multiple of
any tile, S shorter than one tile), S_q != S_k, grouped K/V heads, and an export called
through the exported module."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evoengineer.kernels import compile_source, render
from evoengineer.space import Case, Config, Variant, load_space

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

pytestmark = pytest.mark.gpu

SPACE = load_space("h100")
SEEDS = [c for c in SPACE.search.seeds if c["PATH"] == "wgmma"]
NEIGHBOURS = [
    SEEDS[0].replace(BLOCK_N=128, STAGES=3),                       # a deeper ring, ping-pong
    SEEDS[3].replace(STAGES=3, INTRA_WG_OVERLAP=1),                # overlap without a producer
    SEEDS[1].replace(BLOCK_N=64, REG_PRODUCER=40, REG_CONSUMER=232),
    SEEDS[2].replace(STAGES=2),                                    # three consumer warpgroups, two stages
]
CONFIGS = [c for c in SEEDS + NEIGHBOURS if SPACE.contains(c)]
SHAPES = [(1, 8, 512), (2, 3, 77), (1, 2, 5), (1, 1, 1), (1, 1, 257), (1, 2, 1000), (1, 2, 2048)]


def test_the_configurations_are_in_the_space() -> None:
    assert len(SEEDS) >= 4 and len(CONFIGS) == len(SEEDS) + len(NEIGHBOURS)


def _kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel

    rendered = render("flash_attention", config, variant)
    compiled = compile_source(rendered.source, "sm_90a")
    assert compiled.ok, compiled.error
    assert compiled.spill_bytes == 0
    return AttentionKernel(rendered, compiled.cubin_path)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=Config.label)
def test_wgmma_matches_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu.evaluate import gate_launcher

    kernel = _kernel(config, Variant(head_dim, causal))
    for batch, heads, seq in SHAPES + [(c.batch, c.heads, c.seq) for c in SPACE.cases if c.head_dim == head_dim]:
        case = Case(batch, heads, seq, head_dim, causal)
        result = gate_launcher(kernel, case, None, 2e-2, 2e-2, seed=seq, trials=1)
        assert result.status == "ok", f"{case.label()}: {result.reason}"


@pytest.mark.parametrize("causal", [False, True])
def test_query_and_key_lengths_may_differ_and_kv_heads_may_be_grouped(causal: bool) -> None:
    import torch
    import torch.nn.functional as F

    kernel = _kernel(SEEDS[0], Variant(128, causal))
    for seq_q, seq_k, heads_kv in ((100, 333, 8), (333, 100, 8), (300, 300, 2), (1, 64, 4)):
        q = torch.randn(2, 8, seq_q, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(2, heads_kv, seq_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_an_exported_wgmma_configuration_runs_through_the_module(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F
    from run_fixtures import load_module, make_run

    from evoengineer.results import export_runs

    best = SEEDS[0]
    times = {label: {best: 100.0} for label in ("B1 H8 S512 D64", "B4 H16 S2048 D64", "B4 H16 S2048 D128",
                                                "B4 H16 S2048 D128 causal")}
    export_runs([make_run(tmp_path / "run", times, sdpa={label: 120.0 for label in times})], tmp_path / "out")
    module = load_module(tmp_path / "out")
    for d, causal, seq in ((128, False, 2048), (128, True, 1000), (64, False, 77)):
        q, k, v = (torch.randn(2, 4, seq, d, device="cuda", dtype=torch.float16) for _ in range(3))
        assert module.explain(q, k, v, is_causal=causal)["config"] == best.key()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        torch.testing.assert_close(module.attention(q, k, v, is_causal=causal).float(), ref, atol=2e-2, rtol=2e-2)
