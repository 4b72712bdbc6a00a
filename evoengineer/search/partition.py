"""A search split where export decides: one partition per kernel the exported module picks by.

An export dispatches a call by its (dtype, head dim, causal) and, within those, to the
nearest measured case, decode calls (S_q 1) to decode cases only, packed sequences' calls to
packed cases only (``runtime.dispatch``). One
geometric mean over every case of a space asks one configuration to serve them all: a
configuration valid at one head dim only (a D64 tile too large for D128's registers) is not
in the space's valid set at all, and one that is fast on one head dim but slow on another
loses to a compromise. So a search by default partitions the space's cases by

* ``regime`` (the default): as ``head-dim``, and within a head dim whose shapes are of both
  regimes, the small shapes (``small_shape``: one partial wave, latency-bound) apart from the
  large ones, as ``D64 small`` beside ``D64``: a tile that wins a shape filling the GPU many
  times over (192 rows of three consumer warpgroups) loses a shape of 32 tiles, and one geometric
  mean over both picked neither.
* ``head-dim``: (dtype, head dim, decode, packed sequences or neither): each partition the space narrowed to its
  cases, searched with its own valid set (``MAX_HEAD_DIM`` and ``MIN_HEAD_DIM`` are its head
  dim's), its own strategy state (its own Optuna study in the run's storage) and its share of
  the budget; its objective is the geometric mean over its cases. Causal and full attention
  stay together: they share a kernel's configuration space and valid set, and the per-case
  winners export picks come from every record of the partition anyway.
* ``shape``: one partition per shape (B, H, S, D, S_KV) and dtype, full and causal together:
  what ``--shape`` searches, for every shape at once.
* ``none``: one geometric mean over every case (the search before partitions).

Budget: ``--trials`` split evenly over the partitions, each at most its valid-set size, what
one cannot use shared evenly by the others (earlier partitions take a remainder); the
partitions are searched side by side (``loop.run_parts``) within one ``--time``. Every
partition's records land in the run's
``results.jsonl`` tagged with its name, so ``export`` picks each case's winner among the
records that measured it, as from any run.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..space import Case, Space

PARTITION_BY = ("regime", "head-dim", "shape", "none")
"""How a search partitions a space's cases (``--partition``); the first is the default."""
DEFAULT_PARTITION = PARTITION_BY[0]


@dataclass(frozen=True)
class Partition:
    """A part of a search: its name (None for a search of one part, whose records carry no
    tag), the space narrowed to its cases and its evaluation budget."""

    name: str | None
    space: Space
    trials: int

    @property
    def labels(self) -> list[str]:
        return [c.label() for c in self.space.cases]

    def study_name(self, run_study: str) -> str:
        """Its study's name in the run's storage: the run's study name, a partition's name after it."""
        return run_study if self.name is None else f"{run_study}:{self.name.replace(' ', '-')}"

    def to_json(self, run_study: str) -> dict[str, Any]:
        return {"name": self.name, "study": self.study_name(run_study), "trials": self.trials, "cases": self.labels}


REGIME_TILE_ROWS = 128
"""The query rows of a work tile ``small_shape`` counts tiles of (the paths' common BLOCK_M)."""


def small_shape(case: Case, sms: int) -> bool:
    """Whether ``case`` gives fewer work tiles of ``REGIME_TILE_ROWS`` query rows than the GPU has
    ``sms``: its kernel runs one partial wave and its time is a tile's latency. Decode and packed
    sequences and padded batches are partitions of their own and never small."""
    if case.seq == 1 or case.lengths:
        return False
    return case.batch * case.heads * -(-case.seq // REGIME_TILE_ROWS) < sms


def _name(case: Case, by: str) -> str:
    dtype = "" if case.dtype == "fp16" else f" {case.dtype}"  # as case labels: fp16 unnamed
    if by == "shape":
        shape = Case(case.batch, case.heads, case.seq, case.head_dim, False, heads_kv=case.heads_kv, seq_kv=case.seq_kv,
                     lengths=case.lengths, padded=case.padded)
        return shape.label() + dtype
    layout = " padded" if case.padded else " varlen" if case.lengths else " decode" if case.seq == 1 else ""
    return f"D{case.head_dim}{layout}{dtype}"


def split_cases(space: Space, by: str) -> list[tuple[str, Space]]:
    """The space's cases grouped by ``by`` (``PARTITION_BY``), in the order they first appear:
    (name, the space narrowed to that group's cases, its seeds re-chosen)."""
    if by not in PARTITION_BY:
        raise ValueError(f"partition by {by!r}: expected one of {', '.join(PARTITION_BY)}")
    if by == "none" or not space.cases:
        return [("", space)]
    groups: dict[str, list[Case]] = {}
    for case in space.cases:
        groups.setdefault(_name(case, "head-dim" if by == "regime" else by), []).append(case)
    if by == "regime":
        groups = _by_regime(groups, space.target.sms)
    return [(name, replace(space, cases=tuple(cases)).reseeded()) for name, cases in groups.items()]


def _by_regime(groups: dict[str, list[Case]], sms: int) -> dict[str, list[Case]]:
    """Each group whose cases are of both regimes split in two, the small shapes' part named with
    `` small`` after the head dim (``D64 small bf16``); parts in the order their cases first appear."""
    split: dict[str, list[Case]] = {}
    for name, cases in groups.items():
        regimes = {small_shape(c, sms) for c in cases}
        head, _, rest = name.partition(" ")
        for case in cases:
            small = len(regimes) == 2 and small_shape(case, sms)
            split.setdefault(f"{head} small{' ' + rest if rest else ''}" if small else name, []).append(case)
    return split


def budget_shares(total: int, sizes: Sequence[int]) -> list[int]:
    """``total`` evaluations split evenly over partitions of valid-set ``sizes``, none above
    its size; what one cannot use goes evenly to the others, a remainder to the earlier ones."""
    shares = [0] * len(sizes)
    left = total
    while left > 0:
        open_ = [i for i, size in enumerate(sizes) if shares[i] < size]
        if not open_:
            break
        each, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            give = min(sizes[i] - shares[i], each + (1 if rank < extra else 0))
            shares[i] += give
            left -= give
    return shares


def plan(space: Space, by: str, trials: int | None = None) -> list[Partition]:
    """The search's partitions with, given ``trials``, their budgets (``budget_shares``;
    without, 0). A split into one part is the search of old: untagged, on the run's own study.
    ValueError for a partition without a valid configuration."""
    parts = split_cases(space, by)
    if len(parts) == 1:
        return [Partition(None, parts[0][1], trials or 0)]
    shares = [0] * len(parts)
    if trials is not None:
        sizes = [part.valid_size() for _, part in parts]
        empty = [name for (name, _), size in zip(parts, sizes) if not size]
        if empty:
            raise ValueError(f"partition {empty[0]} has no valid configuration at its head dim")
        shares = budget_shares(trials, sizes)
    return [Partition(name, part, share) for (name, part), share in zip(parts, shares)]


def narrow_evaluator(evaluator: Any, space: Space) -> None:
    """Point an evaluator at one partition's cases: a GPU ``Evaluator`` gates and times the
    narrowed space's cases, a replay reports (and takes the geometric mean of) its labels."""
    if hasattr(evaluator, "labels"):
        evaluator.labels = [c.label() for c in space.cases]
    else:
        evaluator.space = space
