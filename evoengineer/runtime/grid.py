"""Grids and workspaces of a kernel's launches: the one place their shapes are computed, for
the search's launcher (``kernels.Launch``) and every export's (``launch.py``)."""
from __future__ import annotations

from typing import Protocol


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


def grid(launch: LaunchShape, batch: int, heads: int, heads_kv: int, seq_q: int, sms: int | None) -> tuple[int, int, int]:
    """A launch's grid: a query block by batch * head (by split); with packed grouped-query rows
    a block of (position, query head) rows by batch * K/V head; for a persistent kernel one CTA
    per multiprocessor at most (``sms``; None: a CTA per work tile, correct but not
    persistent), each walking its share of the work tiles."""
    if launch.pack_gqa:
        rows = seq_q * (heads // heads_kv)
        return (-(-rows // launch.rows_per_cta), batch * heads_kv, launch.grid_z)
    blocks = -(-seq_q // launch.rows_per_cta)
    if launch.persistent:
        tiles = blocks * batch * heads
        return (max(1, min(tiles, sms or tiles)), 1, 1)
    return (blocks, batch * heads, launch.grid_z)


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
