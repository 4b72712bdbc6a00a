"""PATH=mma (mma.sync m16n8k16 FlashAttention-2) against fp32 SDPA on the GPU.

Covers head dims 64/128, causal and not, sequence lengths that are not multiples of
the tiles (and shorter than one tile), non-contiguous strides, every technique switch
(STAGES, SMEM_LAYOUT, Q_IN_REGS, P_IN_REGS, one or two 16-row strips per warp) and
SPLITS > 1 with its combine launch, and KV_GROUPS > 1 (warp groups splitting K/V inside the CTA,
merged in shared memory), alone and with the other switches.
"""
from __future__ import annotations

import pytest

from evoengineer.kernels import Rendered, render
from evoengineer.space import Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency, but keep collection safe
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = RTOL = 2e-2


def mma(BM: int, BN: int, warps: int | None = None, stages: int = 2, layout: str = "swizzle",
        q_regs: int = 1, p_regs: int = 1, splits: int = 1, groups: int = 1) -> Config:
    return Config(PATH="mma", BLOCK_M=BM, BLOCK_N=BN, WARPS=warps or groups * BM // 16, VEC=8, STAGES=stages,
                  SMEM_LAYOUT=layout, Q_IN_REGS=q_regs, P_IN_REGS=p_regs, SPLITS=splits, KV_GROUPS=groups)


CONFIGS = {
    "m64n64": mma(64, 64),
    "m128n64-st3": mma(128, 64, stages=3),
    "m64n128-st1": mma(64, 128, stages=1),
    "m64n64-pad-q0-p0": mma(64, 64, layout="pad", q_regs=0, p_regs=0),
    "m128n64-w4-q0": mma(128, 64, warps=4, q_regs=0),           # two 16-row strips per warp
    "m128n32-w4-pad-st1": mma(128, 32, warps=4, stages=1, layout="pad", q_regs=0),
    "m16n32": mma(16, 32),
    "m64n64-split2": mma(64, 64, splits=2),
    "m32n64-split4-p0": mma(32, 64, splits=4, p_regs=0),
    "m128n128-w8-split2": mma(128, 128, splits=2),
    "m128n64-w4-q0-st1": mma(128, 64, warps=4, stages=1, q_regs=0),     # FlashAttention-2 load order, two strips
    "m32n64-g4": mma(32, 64, stages=1, groups=4),
    "m16n64-g4-pad-p0": mma(16, 64, stages=1, layout="pad", p_regs=0, groups=4),
    "m64n64-g2-st2": mma(64, 64, stages=2, groups=2),
    "m128n64-w8-g2-q0": mma(128, 64, warps=8, stages=1, q_regs=0, groups=2),   # two strips per warp, two groups
    "m32n64-g2-split2": mma(32, 64, stages=1, splits=2, groups=2),
}

SHAPES = [  # (B, H, S, D)
    (1, 8, 512, 64),
    (2, 3, 77, 64),
    (1, 2, 5, 128),
    (1, 2, 1000, 64),
    (1, 3, 333, 128),
]


def _launch(rendered: Rendered, q, k, v, o) -> None:
    from evoengineer.gpu import AttentionKernel
    from evoengineer.kernels import compile_source

    res = compile_source(rendered.source, "sm_%d%d" % torch.cuda.get_device_capability())
    assert res.ok, res.error
    AttentionKernel(rendered, res.cubin_path)(q, k, v, o)
    torch.cuda.synchronize()


def _check(config: Config, shape: tuple[int, int, int, int], causal: bool, transposed: bool = False) -> None:
    import torch.nn.functional as F

    B, H, S, D = shape
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + S + D + int(causal))
    if transposed:  # (B, S, H, D) storage: head and sequence strides differ from the dense layout
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.float16, generator=gen).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    o = torch.full((B, H, S, D), float("nan"), device="cuda", dtype=torch.float16)
    rendered = render("flash_attention", config, Variant(D, causal))
    _launch(rendered, q, k, v, o)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert not torch.isnan(o).any(), "output rows left unwritten or NaN"
    torch.testing.assert_close(o.float(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}S{}D{}".format(*s))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mma_matches_sdpa(name: str, shape: tuple[int, int, int, int], causal: bool) -> None:
    _check(CONFIGS[name], shape, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["m64n64", "m128n64-w4-q0", "m64n64-split2", "m32n64-g4"])
def test_mma_strided_inputs(name: str, causal: bool) -> None:
    _check(CONFIGS[name], (2, 3, 130, 64), causal, transposed=True)
    _check(CONFIGS[name], (2, 2, 70, 128), causal, transposed=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mma_large_d128(causal: bool) -> None:
    _check(mma(128, 64, warps=4, q_regs=0), (2, 4, 2048, 128), causal)
