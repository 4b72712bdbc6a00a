"""Target verdicts: does a measured figure meet its target, given the noise of the rounds?

A difference smaller than the noise is no difference: "ratio <= 1 within noise" is met by
a ratio of 1.004 whose rounds spread by ±1 %, and missed by 1.03 whose rounds agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from .protocol import half_range, paired_ratios

Relation = Literal["lower", "equal", "higher"]
NOISE_FLOOR = 0.01
"""The least relative noise a ratio is given (a timing is rarely steadier than 1 % across rounds)."""


def relation(difference: float, noise: float) -> Relation:
    """``lower`` or ``higher`` where ``difference`` is beyond ``noise`` either way, else ``equal``."""
    if difference < -noise:
        return "lower"
    return "equal" if difference <= noise else "higher"


@dataclass(frozen=True)
class RatioVerdict:
    """A paired ratio against a target: the median of the rounds' ratios, its noise (half the
    range of the rounds' ratios, at least ``floor`` times the target), and where it lies."""

    ratio: float
    low: float
    high: float
    rounds: int
    noise: float
    target: float
    relation: Relation

    @property
    def at_most(self) -> bool:
        """The target "ratio <= target within noise"."""
        return self.relation != "higher"

    @property
    def at_least(self) -> bool:
        """The target "ratio >= target within noise"."""
        return self.relation != "lower"

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "rounds": self.rounds, "noise": self.noise,
                "target": self.target, "relation": self.relation}


def ratio_verdict(ratios: Sequence[float], target: float = 1.0, floor: float = NOISE_FLOOR) -> RatioVerdict:
    """The verdict on per-round ``ratios`` against ``target`` (NaN ratio and ``equal`` for none)."""
    if not ratios:
        return RatioVerdict(math.nan, math.nan, math.nan, 0, math.nan, target, "equal")
    ordered = sorted(ratios)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    noise = max(half_range(ordered), floor * target)
    return RatioVerdict(median, ordered[0], ordered[-1], n, noise, target, relation(median - target, noise))


def paired_verdict(ours: Sequence[float], theirs: Sequence[float], target: float = 1.0,
                   floor: float = NOISE_FLOOR) -> RatioVerdict:
    """``ratio_verdict`` of the rounds' ratios ours / theirs."""
    return ratio_verdict(paired_ratios(ours, theirs), target, floor)
