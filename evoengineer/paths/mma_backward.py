"""The backward's mma path (``templates/flash_attention_bwd.cu.j2``): the FlashAttention-2 backward
on mma.sync, a dK/dV kernel over key tiles and dQ by fp32 atomics or by a separate pass.

Parameters:

- ``DKDV``: how the dK/dV kernel splits its work over warps: ``strips`` (one warp per 16 keys, S^T
  and P^T in its registers), ``tiles`` (8 warps tile every product in two dimensions, 32-row warp
  tiles; P and dS go through shared memory, as FlashAttention-2's backward) or ``halves`` (tiles, a
  warp's S and dP computed in two column halves, so half as many of their accumulators are live:
  BLOCK_M x BLOCK_N tiles of 128 x 128 at D64 and 64 x 128 at D128 then fit 255 registers; warp tiles
  of at least 32 keys, BLOCK_M * BLOCK_N >= 8192),
- ``BLOCK_M``: query rows per tile of the dK/dV kernel (strips: 16 to 128, at most ``BLOCK_N``;
  tiles, halves: 64 or 128), ``BLOCK_N``: keys per CTA (64 or 128),
- ``STAGES``: 1 or 2 (the next Q/dO tile loads during this one),
- ``DQ_MODE``: ``atomic`` (fp32 reductions into a workspace, then a conversion) or ``separate`` (a
  deterministic kernel over query tiles), with ``DQ_BLOCK_M`` query rows per CTA and ``DQ_BLOCK_N``
  keys per tile of that kernel (atomic dQ has none: they stay at their defaults).

Features (``FEATURES``): per-batch key ranges and query lengths (a padded batch), soft-capping and a
sliding window, compile-time switches as the forward's (SEQLENS=1, SOFTCAP=1, WINDOW=1); every kernel
of the path holds them.
"""
from __future__ import annotations

from typing import Any

from .base import KernelPath, Scope, features_rule, rule, scope_head_dims

NAME = "mma"
TEMPLATE = "flash_attention_bwd"
PARAMS = ("DKDV", "BLOCK_M", "BLOCK_N", "STAGES", "DQ_MODE", "DQ_BLOCK_M", "DQ_BLOCK_N")
DEFAULTS: dict[str, Any] = {"DKDV": "strips", "STAGES": 2, "DQ_MODE": "atomic", "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 64}
HEAD_DIMS = (64, 128)
DKDV_LAYOUTS = ("strips", "tiles", "halves")
TILED_LAYOUTS = ("tiles", "halves")
"""The layouts of the 8-warp dK/dV kernel with 2-D warp tiles (halves: S and dP by column halves)."""
DQ_MODES = ("atomic", "separate")
FEATURES = ("seqlens", "softcap", "window")
"""The compile-time features the template holds on this path (SEQLENS, SOFTCAP, WINDOW): no packed
sequences (varlen)."""
TILES_WARPS = 8
HALVES_MIN_TILE = 8192
"""halves: the least BLOCK_M * BLOCK_N, where a warp's S/dP tile (BLOCK_M * BLOCK_N / 256 keys wide)
has two halves of 16-column multiples."""


def tiled(c: Scope) -> bool:
    """The dK/dV kernel of 8 warps with 2-D warp tiles (DKDV tiles or halves)."""
    return c["DKDV"] in TILED_LAYOUTS


def warps(c: Scope) -> int:
    """Warps of the dK/dV kernel: strips, one per 16 keys of its tile; tiles and halves, 8."""
    return TILES_WARPS if tiled(c) else int(c["BLOCK_N"]) // 16


def kernel_smem(c: Scope, head_dim: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel of the backward (bytes), as the template declares it."""
    bm, bn, stages, d = int(c["BLOCK_M"]), int(c["BLOCK_N"]), int(c["STAGES"]), head_dim
    dkdv = 4 * bn * d + stages * (4 * bm * d + 8 * bm)
    if tiled(c):
        dkdv += 4 * bm * bn   # P and dS
    elif c["DQ_MODE"] == "atomic":
        dkdv += 2 * bn * (bm + 8)   # dS^T
    out = {"attn_bwd_pre": 0, "attn_bwd_dkdv": dkdv}
    if c["DQ_MODE"] == "atomic":
        out["attn_bwd_dq_convert"] = 0
    else:
        out["attn_bwd_dq"] = 4 * int(c["DQ_BLOCK_M"]) * d + stages * 4 * int(c["DQ_BLOCK_N"]) * d
    return out


def smem_bytes(c: Scope, head_dim: int) -> int:
    """The largest of the backward's kernels' shared memory."""
    return max(kernel_smem(c, head_dim).values())


def _dq_slices(c: Scope, head_dim: int) -> bool:
    """strips: the warps that share a query strip split dQ's columns in multiples of 16."""
    if tiled(c):
        return True
    strips, w = int(c["BLOCK_M"]) // 16, int(c["BLOCK_N"]) // 16
    return w % strips == 0 and (head_dim // (w // strips)) % 16 == 0


RULES = (
    rule(NAME, "head-dims", f"the backward supports head dims {', '.join(map(str, HEAD_DIMS))}", "",
         lambda c: all(d in HEAD_DIMS for d in scope_head_dims(c))),
    features_rule(NAME, FEATURES),
    rule(NAME, "layout", f"DKDV is one of {', '.join(DKDV_LAYOUTS)}", "DKDV", lambda c: c["DKDV"] in DKDV_LAYOUTS),
    rule(NAME, "keys", "BLOCK_N is 64 or 128 (strips: one warp per 16 keys)", "BLOCK_N", lambda c: c["BLOCK_N"] in (64, 128)),
    rule(NAME, "rows", "tiles, halves: BLOCK_M is 64 or 128; strips: 16, 32, 64 or 128 and at most BLOCK_N", "DKDV BLOCK_M BLOCK_N",
         lambda c: c["BLOCK_M"] in (64, 128) if tiled(c) else c["BLOCK_M"] in (16, 32, 64, 128) and c["BLOCK_M"] <= c["BLOCK_N"]),
    rule(NAME, "halves", f"halves: BLOCK_M * BLOCK_N is at least {HALVES_MIN_TILE} (each half of a warp's S/dP tile "
         "a multiple of 16 keys)", "DKDV BLOCK_M BLOCK_N",
         lambda c: c["DKDV"] != "halves" or int(c["BLOCK_M"]) * int(c["BLOCK_N"]) >= HALVES_MIN_TILE),
    rule(NAME, "stages", "STAGES is 1 or 2", "STAGES", lambda c: c["STAGES"] in (1, 2)),
    rule(NAME, "dq-mode", f"DQ_MODE is one of {', '.join(DQ_MODES)}", "DQ_MODE", lambda c: c["DQ_MODE"] in DQ_MODES),
    rule(NAME, "dq-tiles", "the separate dQ kernel takes 64 or 128 query rows and 32, 64 or 128 keys a tile; atomic dQ "
         "has no such kernel (DQ_BLOCK_M and DQ_BLOCK_N stay 64)", "DQ_MODE DQ_BLOCK_M DQ_BLOCK_N",
         lambda c: (c["DQ_BLOCK_M"] in (64, 128) and c["DQ_BLOCK_N"] in (32, 64, 128)) if c["DQ_MODE"] == "separate"
         else (c["DQ_BLOCK_M"], c["DQ_BLOCK_N"]) == (DEFAULTS["DQ_BLOCK_M"], DEFAULTS["DQ_BLOCK_N"])),
    rule(NAME, "dq-slices", "strips: the warps sharing a query strip split dQ's columns in multiples of 16",
         "DKDV BLOCK_M BLOCK_N", lambda c: _dq_slices(c, c["MIN_HEAD_DIM"]) and _dq_slices(c, c["MAX_HEAD_DIM"])),
    rule(NAME, "smem", "every kernel's tiles fit the shared memory per block",
         "DKDV BLOCK_M BLOCK_N STAGES DQ_MODE DQ_BLOCK_M DQ_BLOCK_N",
         lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)

def label(values: dict[str, Any]) -> None:
    """Fold the backward's parameters into short-label tokens, in place: ``bwd`` (``bwdt`` with
    DKDV=tiles, ``bwdh`` with DKDV=halves), and ``dq=atomic`` or ``dq=sep64x32`` (the separate dQ kernel's tile)."""
    values["PATH"] = {"tiles": "bwdt", "halves": "bwdh"}.get(values.pop("DKDV", "strips"), "bwd")
    mode, rows, keys = values.pop("DQ_MODE", "atomic"), values.pop("DQ_BLOCK_M", 64), values.pop("DQ_BLOCK_N", 64)
    values["dq"] = "atomic" if mode == "atomic" else f"sep{rows}x{keys}"


PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=lambda c: 32 * warps(c), rows_per_cta=lambda c: c["BLOCK_N"],
                  defaults=DEFAULTS, label=label, head_dims=HEAD_DIMS, features=FEATURES)
