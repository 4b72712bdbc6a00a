"""Grids and workspaces of a kernel's launches: the one place their shapes are computed, for
the search's launcher (``kernels.Launch``) and every export's (``launch.py``); and the rule
that chooses a call's K/V split count (``decode_splits``), which both run."""
from __future__ import annotations

import math
from typing import Protocol, Sequence


class LaunchShape(Protocol):
    """What the grid of a launch depends on (``kernel_file.LaunchSpec``, ``kernels.Launch``)."""

    @property
    def rows_per_cta(self) -> int: ...
    @property
    def grid_z(self) -> int: ...
    @property
    def persistent(self) -> bool: ...
    @property
    def pack_gqa(self) -> bool: ...
    @property
    def split_tail(self) -> tuple[int, int] | None: ...
    @property
    def auto_split(self) -> tuple[int, int] | None: ...
    @property
    def split_combine(self) -> bool: ...


MAX_SPLITS = 128
"""The most K/V splits a call gets (each adds a partial row of head_dim + 1 floats to the workspace)."""
FILLED = 0.8
"""A grid of at least this many waves of resident CTAs without a split is not split (FlashAttention's rule)."""
NEAR_BEST = 0.9
"""The split count taken: the fewest whose wave efficiency reaches this share of the best one's."""


def wave_efficiency(ctas: int, slots: int) -> float:
    """How full the waves of ``ctas`` CTAs are on ``slots`` resident CTAs (1.0: every wave full)."""
    waves = ctas / slots
    return waves / math.ceil(waves)


def split_tiles(tiles: int, splits: int) -> list[int]:
    """K/V tiles of each split of ``tiles`` into ``splits`` contiguous shares, as the kernel cuts
    them: ``ceil(tiles / splits)`` each, the last ones what is left (possibly none)."""
    per = -(-tiles // splits)
    return [max(0, min(per, tiles - z * per)) for z in range(splits)]


def decode_splits(ctas: int, seq_k: int, block_n: int, kv_groups: int, slots: int, most: int = MAX_SPLITS) -> int:
    """The K/V split count of a call whose kernel runs ``ctas`` CTAs without a split, over
    ``seq_k`` keys in tiles of ``block_n``, each CTA's tiles dealt to ``kv_groups`` warp groups,
    on a GPU that holds ``slots`` CTAs at once (multiprocessors x resident CTAs per multiprocessor).

    FlashAttention-2's ``num_splits_heuristic`` on whole waves: no split where the grid already
    fills ``FILLED`` of a wave; otherwise, among the split counts whose every split gets at least
    one tile per warp group (at most ``most`` and ``slots``; counts that would leave a split
    empty are not taken), the fewest whose wave efficiency reaches ``NEAR_BEST`` of the best one's."""
    if ctas < 1 or slots < 1 or ctas >= FILLED * slots:
        return 1
    tiles = -(-max(1, seq_k) // block_n)
    candidates = [s for s in range(1, min(most, slots, tiles // max(1, kv_groups)) + 1)
                  if min(split_tiles(tiles, s)) >= kv_groups]
    if not candidates:
        return 1
    best = max(wave_efficiency(ctas * s, slots) for s in candidates)
    return next(s for s in candidates if wave_efficiency(ctas * s, slots) >= NEAR_BEST * best)


def grid(launch: LaunchShape, batch: int, heads: int, heads_kv: int, seq_q: int, sms: int | None,
         splits: int = 1) -> tuple[int, int, int]:
    """A launch's grid: a query block by batch * head (by split); with packed grouped-query rows
    a block of (position, query head) rows by batch * K/V head; for a persistent kernel one CTA
    per multiprocessor at most (``sms``; None: a CTA per work tile, correct but not
    persistent), each walking its share of the work tiles. A launch whose split count is the
    call's (``auto_split``) has ``splits`` (``call_splits``) in z."""
    z = splits if launch.auto_split is not None else launch.grid_z
    if launch.pack_gqa:
        rows = seq_q * (heads // heads_kv)
        return (-(-rows // launch.rows_per_cta), batch * heads_kv, z)
    blocks = -(-seq_q // launch.rows_per_cta)
    if launch.persistent:
        tiles = blocks * batch * heads
        return (max(1, min(tiles, sms or tiles)), 1, 1)
    return (blocks, batch * heads, z)


def call_splits(launches: Sequence[LaunchShape], batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int,
                slots: int) -> int:
    """The K/V split count of a call: ``decode_splits`` over the CTAs of the kernel's launch whose
    split count is chosen per call (``auto_split`` = (BLOCK_N, KV_GROUPS)), on ``slots`` resident
    CTAs; 1 for a kernel without one (a fixed split count is its launch's ``grid_z``)."""
    for launch in launches:
        if launch.auto_split is not None:
            x, y, _ = grid(launch, batch, heads, heads_kv, seq_q, None)
            block_n, kv_groups = launch.auto_split
            return decode_splits(x * y, seq_k, block_n, kv_groups, slots)
    return 1


def runs(launch: LaunchShape, splits: int) -> bool:
    """Whether a call with ``splits`` K/V splits runs ``launch``: a combine step (``split_combine``)
    only where the K/V range is split (one split writes O itself)."""
    return splits > 1 or not launch.split_combine


def workspace_floats(floats_per_row: int, floats_per_split_row: int, batch: int, heads: int, seq_q: int,
                     splits: int = 1) -> int:
    """Floats of a call's workspace: per output row ``floats_per_row``, and where the K/V range is
    split over ``splits`` > 1 CTAs chosen per call, ``floats_per_split_row`` per split (a partial
    row and its log-sum-exp)."""
    return batch * heads * seq_q * (floats_per_row + (floats_per_split_row * splits if splits > 1 else 0))


def counter_words(launch: LaunchShape, batch: int, heads: int, seq_q: int, sms: int) -> tuple[int, int]:
    """(32-bit words of a tile-counter kernel's workspace, how many are zeroed per call): the
    counter, and for a kernel that cuts its last tiles over every CTA (``split_tail``) where the
    tiles outnumber the multiprocessors, the cuts' counters, then their partials from a 16-byte
    boundary."""
    if launch.split_tail is None or -(-seq_q // launch.rows_per_cta) * batch * heads <= sms:
        return 1, 1
    counters, floats = launch.split_tail
    zeroed = 1 + sms * counters
    return (zeroed + 3) // 4 * 4 + sms * floats, zeroed
