"""The wmma path: 16x16x16 WMMA fragments for Q K^T and P V, scores through shared memory."""
from __future__ import annotations

from .base import KernelPath, Scope, features_rule, head_dims_rule, rule

NAME = "wmma"
PARAMS = ("BLOCK_M", "BLOCK_N", "WARPS", "VEC")
HEAD_DIMS = (64, 128)
FEATURES: tuple[str, ...] = ()
"""The compile-time features the template holds (none)."""


def smem_bytes(c: Scope, head_dim: int) -> int:
    """Q, K and V tiles (rows padded by 8 halves) and the fp32 score tile (rows padded by 4)."""
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    return (bm + 2 * bn) * (head_dim + 8) * 2 + bm * (bn + 4) * 4


RULES = (
    head_dims_rule(NAME, HEAD_DIMS),
    features_rule(NAME, FEATURES),
    rule(NAME, "warps", "no more warps than the tile has 16-row groups", "BLOCK_M WARPS",
         lambda c: c["WARPS"] <= c["BLOCK_M"] // 16),
    rule(NAME, "rows-per-warp", "a WMMA warp holding more than two 16-row groups of accumulators spills kilobytes "
         "(check shows it)", "BLOCK_M WARPS", lambda c: c["BLOCK_M"] <= 32 * c["WARPS"]),
    rule(NAME, "vec", "the vector width divides the head dimension", "VEC",
         lambda c: c["MIN_HEAD_DIM"] % c["VEC"] == 0),
    rule(NAME, "smem", "Q, K, V tiles plus the fp32 score tile fit the shared memory per block", "BLOCK_M BLOCK_N",
         lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)

PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=lambda c: 32 * c["WARPS"], rows_per_cta=lambda c: c["BLOCK_M"],
                  head_dims=HEAD_DIMS, features=FEATURES)
