"""The scalar path: one thread per (row, column slice), fp32 FMAs, no tensor cores."""
from __future__ import annotations

from .base import KernelPath, Scope, features_rule, head_dims_rule, rule

NAME = "scalar"
PARAMS = ("BLOCK_M", "BLOCK_N", "WARPS", "VEC")
HEAD_DIMS = (64, 128)
FEATURES: tuple[str, ...] = ()
"""The compile-time features the template holds (none)."""


def smem_bytes(c: Scope, head_dim: int) -> int:
    """Q, K and V tiles (rows padded by 8 halves), the fp32 O accumulator, each warp's scores for
    up to four rows at a time, and the row statistics."""
    bm, bn, warps = c["BLOCK_M"], c["BLOCK_N"], c["WARPS"]
    rows_per_group = min(4, bm // warps)
    return (bm + 2 * bn) * (head_dim + 8) * 2 + bm * head_dim * 4 + warps * rows_per_group * bn * 4 + bm * 8


RULES = (
    head_dims_rule(NAME, HEAD_DIMS),
    features_rule(NAME, FEATURES),
    rule(NAME, "warps", "no more warps than the tile has rows", "BLOCK_M WARPS",
         lambda c: c["WARPS"] <= c["BLOCK_M"]),
    rule(NAME, "vec", "the vector width divides the head dimension", "VEC",
         lambda c: c["MIN_HEAD_DIM"] % c["VEC"] == 0),
    rule(NAME, "smem", "Q, K, V tiles, the fp32 O accumulator and each warp's scores fit the shared memory per block",
         "BLOCK_M BLOCK_N WARPS", lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)

PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=lambda c: 32 * c["WARPS"], rows_per_cta=lambda c: c["BLOCK_M"],
                  head_dims=HEAD_DIMS, features=FEATURES)
