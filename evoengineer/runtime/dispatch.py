"""The dispatch rule: which measured configuration serves a call.

The search measured some cases (dtype, B, H, H_kv, S_q, S_k, D, causal); each has a winner.
A call runs the winner of the nearest measured case of its own (dtype, head_dim, causal):
nearest in the L1 distance of the natural logs of (B*H, S_q, S_k, H/H_kv), ties to the
earlier case of the table. A call on packed sequences (``attention_varlen``: B sequences, S_q
and S_k the longest) looks only at the measured packed cases where its variant has any, a call
on a padded batch (``seqlens_q``) only at the padded ones, else the dense ones, any other call
only at the dense ones where it has any. A decode call (S_q = 1) then looks only at
the decode cases where there are any. A variant without measured cases runs its fallback. This module
is the one place the rule is written: the search's per-shape table and every export use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

RULE = (
    "a call (dtype, head_dim, causal, B, H, H_kv, S_q, S_k; S_q the query length, S_k the K/V length) runs the "
    "configuration that won the nearest measured case of the same (dtype, head_dim, causal), nearest in the L1 "
    "distance of the natural logs of (B*H, S_q, S_k, H/H_kv), ties to the earlier case in the table; a call on packed "
    "sequences (attention_varlen: B sequences, S_q and S_k the longest) looks only at the measured packed cases, a call "
    "on a padded batch (seqlens_q) only at the padded ones, else the dense ones, any other call only at the dense "
    "ones, where the (dtype, head_dim, causal) has any; a decode call "
    "(S_q = 1) then looks only at the measured decode cases (S_q = 1) where there are any; a "
    "(dtype, head_dim, causal) without measured cases runs the fallback configuration (the geometric-mean winner "
    "of the first run)"
)

Point = tuple[float, float, float, float]
Variant = tuple[str, int, bool]
"""(dtype, head_dim, causal): ``fp16`` or ``bf16``, the head dimension, causal masking."""


class CaseShape(Protocol):
    """What the rule reads of a measured case (``MeasuredCase``, or the search's ``Shape``)."""

    @property
    def batch(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def heads_kv(self) -> int: ...
    @property
    def seq_q(self) -> int: ...
    @property
    def seq_k(self) -> int: ...
    @property
    def varlen(self) -> bool: ...
    @property
    def padded(self) -> bool: ...


def point(batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int) -> Point:
    """The coordinates the distance is measured in: logs of (B*H, S_q, S_k, H/H_kv), each at least 0."""
    return (math.log(max(1, batch * heads)), math.log(max(1, seq_q)), math.log(max(1, seq_k)),
            math.log(max(1, heads // max(1, heads_kv))))


def distance(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b))


def nearest_index(cases: Sequence[CaseShape], batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int,
                  varlen: bool = False, padded: bool = False) -> int | None:
    """The index in ``cases`` (one variant's measured cases, in table order) of the case that
    serves such a call (``varlen``: on packed sequences; ``padded``: on a padded batch), or None
    when ``cases`` is empty."""
    here = point(batch, heads, heads_kv, seq_q, seq_k)
    candidates = range(len(cases))

    def layout_of(i: int) -> tuple[bool, bool]:
        return bool(getattr(cases[i], "varlen", False)), bool(getattr(cases[i], "padded", False))

    for wanted in ((varlen, padded), (False, False)) if padded else ((varlen, False),):
        layout = [i for i in candidates if layout_of(i) == wanted]
        if layout:
            candidates = layout  # type: ignore[assignment]
            break
    if seq_q == 1:
        decode = [i for i in candidates if cases[i].seq_q == 1]
        if decode:
            candidates = decode  # type: ignore[assignment]
    best: tuple[float, int] | None = None
    for i in candidates:
        c = cases[i]
        d = distance(here, point(c.batch, c.heads, c.heads_kv, c.seq_q, c.seq_k))
        if best is None or d < best[0]:
            best = (d, i)
    return None if best is None else best[1]


@dataclass(frozen=True)
class MeasuredCase:
    """A measured case of the table and the configuration that won it."""

    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    config: str
    varlen: bool = False
    """A case on packed sequences (B of them, S_q and S_k the longest)."""
    padded: bool = False
    """A case on a padded batch (``seqlens_q``: its padding skipped)."""


@dataclass(frozen=True)
class VariantTable:
    """One (dtype, head_dim, causal): its fallback and its measured cases in table order."""

    fallback: str
    cases: tuple[MeasuredCase, ...] = ()

    def choose(self, batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int, varlen: bool = False,
               padded: bool = False) -> str:
        index = nearest_index(self.cases, batch, heads, heads_kv, seq_q, seq_k, varlen, padded)
        return self.fallback if index is None else self.cases[index].config


class NoKernelError(ValueError):
    """No kernel of the export serves this (dtype, head_dim, causal)."""


def variant_label(variant: Variant) -> str:
    dtype, head_dim, causal = variant
    return f"{dtype} D{head_dim}{' causal' if causal else ''}"


class DispatchTable:
    """The rule over an export's table: (dtype, head_dim, causal) -> ``VariantTable``."""

    def __init__(self, variants: Mapping[Variant, VariantTable]) -> None:
        self.variants = dict(variants)

    def covered(self) -> str:
        return ", ".join(variant_label(v) for v in sorted(self.variants))

    def choose(self, dtype: str, head_dim: int, causal: bool, batch: int, heads: int, seq_q: int, seq_k: int,
               heads_kv: int | None = None, varlen: bool = False, padded: bool = False) -> str:
        """The configuration id that serves such a call (``varlen``: on packed sequences, B of them,
        S_q and S_k the longest; ``padded``: on a padded batch); NoKernelError naming what is covered."""
        table = self.variants.get((dtype, int(head_dim), bool(causal)))
        if table is None:
            raise NoKernelError(f"attention: no exported kernel for {dtype} head_dim {head_dim}"
                                f"{' causal' if causal else ''}; this module covers {self.covered()}")
        return table.choose(batch, heads, heads_kv or heads, seq_q, seq_k, varlen, padded)
