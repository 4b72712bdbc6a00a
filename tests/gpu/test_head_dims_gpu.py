"""Head dims 32, 80, 96, 192 and 256 on the GPU: the mma path (padded rows where the head dim is
not a multiple of 64; K/V splits, K/V groups, grouped query heads, decode) and the wgmma path
(each; 32, 80 and 96 computed as the next multiple of 64 from zeros the TMA reads past the
head dim, O stored from registers, staged or by TMA), fp16 and bf16, odd shapes, S_q != S_k, against fp32 under flash-attn's rule
(max|out - ref_fp32| <= 2 * max|out_lowp - ref_fp32| + eps), soft cap and window included."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_attention_features_gpu import check_rule, inputs, kernel  # noqa: E402

from evoengineer import paths  # noqa: E402
from evoengineer.runtime import features as F  # noqa: E402
from evoengineer.space import Config, Variant  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def mma(BM: int, BN: int, warps: int, layout: str, **extra) -> Config:
    return Config({"PATH": "mma", "BLOCK_M": BM, "BLOCK_N": BN, "WARPS": warps, "VEC": 8, "SMEM_LAYOUT": layout,
                   **extra})


def wgmma(BN: int, **extra) -> Config:
    return Config({"PATH": "wgmma", "CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": BN, "STAGES": 2, "PRODUCER": 1,
                   "REG_PRODUCER": 24, "REG_CONSUMER": 240, "INTRA_WG_OVERLAP": 1, "PINGPONG": 0, "LOAD": "tma",
                   **extra})


def _mma_configs(head_dim: int) -> dict[str, Config]:
    layout = "swizzle" if head_dim % 64 == 0 else "pad"
    q_regs = 0 if head_dim >= 192 else 1
    out = {
        "m64n64": mma(64, 64, 4, layout, Q_IN_REGS=q_regs),
        "m128n64-w8": mma(128, 64, 8, layout, Q_IN_REGS=q_regs),
        "m64n64-split3-pack": mma(64, 64, 4, layout, Q_IN_REGS=q_regs, SPLITS=3, PACK_GQA=1),
        "m16n64-g2-split4": mma(16, 64, 2, layout, Q_IN_REGS=q_regs, STAGES=1, KV_GROUPS=2, SPLITS=4),
    }
    if head_dim <= 128:
        out["m32n64-g4"] = mma(32, 64, 8, layout, STAGES=1, KV_GROUPS=4)
    return out


CASES = [(d, name, config) for d in (32, 80, 96, 192, 256) for name, config in _mma_configs(d).items()]
CASES += [(d, name, config) for d in (192, 256) for name, config in
          {"wg128x64": wgmma(64), "wg128x80-pp": wgmma(80, PINGPONG=1), "wg128x64-p1": wgmma(64, PERSISTENT=1),
           "wg128x64-p2-ovl2": wgmma(64, PERSISTENT=2, INTRA_WG_OVERLAP=2)}.items()]

PANEL_CONFIGS = {   # head dims that are not a multiple of 64: every store of O, Q in registers
    "wg128x128-pp": wgmma(128, PINGPONG=1),
    "wg128x64-p1": wgmma(64, PERSISTENT=1),
    "wg128x128-p1-otma": wgmma(128, PERSISTENT=1, O_TMA=1, PINGPONG=1),
    "wg128x128-p2-otma-q": wgmma(128, PERSISTENT=2, O_TMA=1, PINGPONG=1, Q_IN_REGS=1, SOFTMAX_PIN=3,
                                 REG_PRODUCER=32, REG_CONSUMER=232),
}
CASES += [(d, name, config) for d in (32, 80, 96) for name, config in PANEL_CONFIGS.items()]

SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (2, 4, 2, 77, 77),
    (1, 6, 3, 333, 333),
    (3, 4, 1, 130, 301),
    (2, 8, 2, 1, 1000),    # decode
    (1, 2, 2, 1024, 1024),
]


def _fits(config: Config, head_dim: int) -> bool:
    path = paths.path_of(config)
    env = {"HEAD_DIMS": (head_dim,), "MIN_HEAD_DIM": head_dim, "MAX_HEAD_DIM": head_dim, "SMEM_LIMIT": 232448,
           "ARCH_NAME": "sm_90a"}
    return not path.violations(config, env)


def test_every_configuration_here_is_valid_at_its_head_dim() -> None:
    assert all(_fits(config, d) for d, _, config in CASES), [(d, n) for d, n, c in CASES if not _fits(c, d)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, name, config", CASES, ids=[f"D{d}-{n}" for d, n, _ in CASES])
def test_a_head_dim_matches_fp32(head_dim: int, name: str, config: Config, causal: bool, dtype: str) -> None:
    if config["PATH"] == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    run = kernel(config, Variant(head_dim, causal, dtype))
    for shape in SHAPES:
        q, k, v = inputs((*shape, head_dim), torch_dtype, seed=hash((name, shape, head_dim)) % 10_000)
        out = torch.full_like(q, float("nan"))
        run(q, k, v, out)
        torch.cuda.synchronize()
        check_rule(out, q, k, v, causal, F.CallFeatures())


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("name", ["m64n64", "m64n64-split3-pack"])
def test_soft_cap_and_window_at_a_head_dim(head_dim: int, name: str) -> None:
    config = _mma_configs(head_dim)[name]
    features = ("softcap", "window")
    run = kernel(config, Variant(head_dim, True, "bf16", features))
    for shape in SHAPES:
        q, k, v = inputs((*shape, head_dim), torch.bfloat16, seed=head_dim, spread=2.0)
        out = torch.full_like(q, float("nan"))
        run(q, k, v, out, features={"window_left": 40, "window_right": 0, "softcap": 20.0})
        torch.cuda.synchronize()
        check_rule(out, q, k, v, True, F.CallFeatures(40, 0, 20.0))


@pytest.mark.parametrize("name", ["wg128x128-pp", "wg128x128-p2-otma-q"])
def test_soft_cap_and_window_at_head_dim_96_on_wgmma(name: str) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    features = ("softcap", "window")
    run = kernel(PANEL_CONFIGS[name], Variant(96, True, "bf16", features))
    for shape in SHAPES:
        q, k, v = inputs((*shape, 96), torch.bfloat16, seed=96, spread=2.0)
        out = torch.full_like(q, float("nan"))
        run(q, k, v, out, features={"window_left": 40, "window_right": 0, "softcap": 20.0})
        torch.cuda.synchronize()
        check_rule(out, q, k, v, True, F.CallFeatures(40, 0, 20.0))
