"""Grid search: the valid configurations in the space's order, each once."""
from __future__ import annotations

import random

from optuna.study import Study
from optuna.trial import FrozenTrial

from ...space import Config, Space
from .. import optuna_internals as internals
from .base import History, Proposal, SpaceSampler


class GridSearchSampler(SpaceSampler):
    """The first unseen valid configuration in enumeration order (shuffled by ``seed`` if asked)."""

    name = "grid"

    def __init__(self, space: Space, *, seed: int | None = None, shuffle: bool = False) -> None:
        super().__init__(space, seed=seed)
        self.shuffle = shuffle
        self._order: list[Config] | None = None
        self._study: tuple[int, int] | None = None
        self._start = 0  # where the last scan found an unseen configuration

    @property
    def order(self) -> list[Config]:
        if self._order is None:
            order = list(self.valid)
            if self.shuffle:
                random.Random(self.seed).shuffle(order)
            self._order = order
        return self._order

    def propose(self, study: Study, trial: FrozenTrial, history: History) -> Proposal:
        order = self.order
        ident = (id(internals.storage(study)), internals.study_id(study))
        start = self._start if self._study == ident else 0
        for i in (*range(start, len(order)), *range(start)):  # wrap: a claim may have been withdrawn
            if order[i] not in history.seen:
                self._study, self._start = ident, i
                return Proposal(order[i], "grid")
        return Proposal(self.order[0], "repeat")
