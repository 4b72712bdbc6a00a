"""The mma path: mma.sync m16n8k16 with ldmatrix, cp.async K/V stages, optional K/V splits
over CTAs (SPLITS, then a combine launch) and over the warps of a CTA (KV_GROUPS).

SPLITS 0 leaves the split count to the call: ``decode_splits`` chooses it from the shape (whole
waves of resident CTAs, every split at least a K/V tile per warp group), the launcher puts it in
the grid and sizes the workspace by it, and one split skips the combine launch. The rule is
written in ``runtime.grid``, which every export copies, so that the search's launcher and every
exported module run this same function.
"""
from __future__ import annotations

from typing import Any

from ..runtime.grid import MAX_SPLITS, decode_splits
from .base import KernelPath, Scope, features_rule, head_dims_rule, rule, scope_head_dims

NAME = "mma"
PARAMS = ("BLOCK_M", "BLOCK_N", "WARPS", "VEC", "STAGES", "SMEM_LAYOUT", "Q_IN_REGS", "P_IN_REGS", "SPLITS",
          "KV_GROUPS", "PACK_GQA")
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
DEFAULTS = {"STAGES": 2, "SMEM_LAYOUT": "swizzle", "Q_IN_REGS": 1, "P_IN_REGS": 1, "SPLITS": 1, "KV_GROUPS": 1,
            "PACK_GQA": 0}
"""What the template takes for a parameter a configuration leaves out."""
FEATURES = ("seqlens", "softcap", "varlen", "window")
"""The compile-time features the template holds (SEQLENS, SOFTCAP, VARLEN, WINDOW)."""


def row_halves(c: Scope, head_dim: int) -> int:
    """The shared-memory row stride of the Q, K, V and O tiles, in 16-bit elements (padded by 8
    with ``SMEM_LAYOUT: pad``)."""
    return head_dim + (8 if c["SMEM_LAYOUT"] == "pad" else 0)


def p_row_halves(c: Scope) -> int:
    """The shared-memory row stride of a P tile, in 16-bit elements."""
    return c["BLOCK_N"] + 8


def smem_bytes(c: Scope, head_dim: int) -> int:
    """The Q tile, STAGES K and V tiles per K/V group (or, if larger, the groups' fp32 merge area)
    and, unless P stays in registers, each group's P tile."""
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    groups, stages = c["KV_GROUPS"], c["STAGES"]
    row = row_halves(c, head_dim)
    kv = 4 * row * groups * stages * bn
    merge = 8 * (groups - 1) * bm * (head_dim // 2 + 4)
    p_tiles = 0 if c["P_IN_REGS"] else 2 * groups * bm * p_row_halves(c)
    return 2 * row * bm + max(kv, merge) + p_tiles


def template_values(c: Scope, head_dim: int) -> dict[str, Any]:
    """What the template reads of these rules besides shared memory, threads and rows: its tiles'
    row strides."""
    return {"ROW": row_halves(c, head_dim), "P_ROW": p_row_halves(c)}


RULES = (
    head_dims_rule(NAME, HEAD_DIMS),
    features_rule(NAME, FEATURES),
    rule(NAME, "warps", "no more warps than the tile has 16-row groups, times the K/V groups", "BLOCK_M WARPS KV_GROUPS",
         lambda c: c["WARPS"] <= c["KV_GROUPS"] * (c["BLOCK_M"] // 16)),
    rule(NAME, "rows", "each K/V group's warps cover the tile's rows, one or two 16-row strips per warp; "
         "two strips with Q in registers spill", "BLOCK_M WARPS KV_GROUPS Q_IN_REGS",
         lambda c: c["BLOCK_M"] * c["KV_GROUPS"] == 16 * c["WARPS"]
         or (c["BLOCK_M"] * c["KV_GROUPS"] == 32 * c["WARPS"] and c["WARPS"] >= 2 * c["KV_GROUPS"] and not c["Q_IN_REGS"])),
    rule(NAME, "loads", "the mma path loads with 16-byte cp.async and steps K in 16-key slices", "BLOCK_N VEC",
         lambda c: c["VEC"] == 8 and c["BLOCK_N"] % 16 == 0),
    rule(NAME, "swizzle", "the XOR swizzle permutes 8 16-byte chunks of a row: a swizzled row holds a multiple of 64 "
         "halves (other head dims pad their rows)", "SMEM_LAYOUT",
         lambda c: c["SMEM_LAYOUT"] == "pad" or all(d % 64 == 0 for d in scope_head_dims(c))),
    rule(NAME, "vec", "the vector width divides the head dimension", "VEC",
         lambda c: c["MIN_HEAD_DIM"] % c["VEC"] == 0),
    rule(NAME, "smem", "the Q tile, STAGES K and V tiles per K/V group (or, if larger, the groups' fp32 merge area) "
         "and, unless P stays in registers, each group's P tile fit the shared memory per block",
         "BLOCK_M BLOCK_N STAGES SMEM_LAYOUT P_IN_REGS KV_GROUPS",
         lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)

AUTO_SPLITS = 0
"""The SPLITS value that leaves the K/V split count to each call (``decode_splits``)."""


def label(values: dict[str, Any]) -> None:
    """``sauto`` for SPLITS 0 (the split count chosen per call), in place."""
    if values.get("SPLITS") == AUTO_SPLITS:
        values["SPLITS"] = "auto"


PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=lambda c: 32 * c["WARPS"], rows_per_cta=lambda c: c["BLOCK_M"],
                  defaults=DEFAULTS, label=label, head_dims=HEAD_DIMS, features=FEATURES, template_values=template_values)

__all__ = ["AUTO_SPLITS", "DEFAULTS", "FEATURES", "HEAD_DIMS", "MAX_SPLITS", "NAME", "PARAMS", "PATH", "RULES", "decode_splits",
           "label", "smem_bytes"]
