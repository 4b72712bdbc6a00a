"""PATH=scalar and PATH=wmma against fp32 SDPA on the GPU, through the gate the search uses.

Tile sizes from 16 to 128, one to eight warps, every vector width, head dims 64/128,
causal and not, sequence lengths that are not multiples of the tiles or shorter than
one tile, and S_q != S_k.
"""
from __future__ import annotations

import pytest

from evoengineer.kernels import compile_source, render
from evoengineer.space import Case, Config, Variant

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

CONFIGS = [
    Config(PATH="scalar", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1),
    Config(PATH="scalar", BLOCK_M=32, BLOCK_N=32, WARPS=4, VEC=8),
    Config(PATH="scalar", BLOCK_M=128, BLOCK_N=64, WARPS=8, VEC=4),
    Config(PATH="scalar", BLOCK_M=64, BLOCK_N=128, WARPS=2, VEC=2),
    Config(PATH="wmma", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1),
    Config(PATH="wmma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8),
    Config(PATH="wmma", BLOCK_M=128, BLOCK_N=128, WARPS=8, VEC=8),
    Config(PATH="wmma", BLOCK_M=64, BLOCK_N=32, WARPS=2, VEC=4),
]
SHAPES = [(1, 8, 512), (2, 3, 77), (1, 2, 5), (1, 1, 1), (1, 2, 1000)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=Config.label)
def test_path_matches_sdpa(config: Config, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu import AttentionKernel
    from evoengineer.gpu.evaluate import gate_launcher

    rendered = render("flash_attention", config, Variant(head_dim, causal))
    compiled = compile_source(rendered.source, "sm_90")
    assert compiled.ok, compiled.error
    kernel = AttentionKernel(rendered, compiled.cubin_path)
    for batch, heads, seq in SHAPES:
        result = gate_launcher(kernel, Case(batch, heads, seq, head_dim, causal), None, 2e-2, 2e-2, seed=seq, trials=1)
        assert result.status == "ok", result.reason


@pytest.mark.parametrize("path", ["scalar", "wmma"])
def test_query_and_key_lengths_may_differ(path: str) -> None:
    import torch
    import torch.nn.functional as F

    from evoengineer.gpu import AttentionKernel

    config = Config(PATH=path, BLOCK_M=32, BLOCK_N=64, WARPS=2, VEC=8)
    for causal in (False, True):
        rendered = render("flash_attention", config, Variant(64, causal))
        kernel = AttentionKernel(rendered, compile_source(rendered.source, "sm_90").cubin_path)
        for seq_q, seq_k in ((100, 37), (37, 100)):
            q = torch.randn(2, 3, seq_q, 64, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(2, 3, seq_k, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            out = torch.full_like(q, float("nan"))
            kernel(q, k, v, out)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
