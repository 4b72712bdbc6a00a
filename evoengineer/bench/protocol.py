"""The measurement protocol: interleaved rounds and paired ratios (pure Python, no GPU).

A comparison runs in rounds. Each round measures every side once, one right after the
other, and every other round reverses their order (A B C, then C B A), so that a drift of
the GPU's clock over the run reaches every side alike. A ratio between two sides is the
median of the rounds' own ratios (round i against round i), not the ratio of two medians:
a round measured while the clock was low counts against both sides of that round only.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence, TypeVar

Name = TypeVar("Name", bound=Hashable)


def round_order(names: Sequence[Name], round_index: int) -> list[Name]:
    """The order ``names`` are measured in round ``round_index`` (0-based): as given in even
    rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def schedule(names: Sequence[Name], rounds: int) -> list[tuple[int, Name]]:
    """Every (round, name) step of ``rounds`` interleaved rounds, in the order they run."""
    return [(r, name) for r in range(rounds) for name in round_order(names, r)]


def run_rounds(names: Sequence[Name], rounds: int, measure: Callable[[Name], float | None]) -> dict[Name, list[float]]:
    """Measure each of ``names`` once a round, in ``schedule`` order: name -> one figure per
    round it was measured in. ``measure`` returns None for a failure; a name that failed is
    not measured again (its list keeps the rounds before)."""
    figures: dict[Name, list[float]] = {name: [] for name in names}
    failed: set[Name] = set()
    for _, name in schedule(names, rounds):
        if name in failed:
            continue
        value = measure(name)
        if value is None:
            failed.add(name)
        else:
            figures[name].append(value)
    return figures


def paired_ratios(ours: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """ours[i] / theirs[i] for every round both sides have (the first min(len) rounds)."""
    return [a / b for a, b in zip(ours, theirs)]


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of the rounds' ratios ours / theirs (NaN when no round pairs)."""
    ratios = paired_ratios(ours, theirs)
    return statistics.median(ratios) if ratios else math.nan


def half_range(values: Sequence[float]) -> float:
    """(max - min) / 2, the spread reported for repeated rounds, loops or samples (0 for none)."""
    return (max(values) - min(values)) / 2 if values else 0.0


def geomean(values: Sequence[float]) -> float:
    """Geometric mean (NaN for none)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


@dataclass(frozen=True)
class Summary:
    """One side's figures over the rounds: median, min, max and how many rounds."""

    median_us: float
    min_us: float
    max_us: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary":
        return cls(statistics.median(values), min(values), max(values), len(values))

    def to_json(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us, "rounds": self.rounds}
