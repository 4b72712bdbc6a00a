"""Random search: uniform over the valid configurations the study does not hold."""
from __future__ import annotations

from optuna.study import Study
from optuna.trial import FrozenTrial

from .base import History, Proposal, SpaceSampler


class RandomSearchSampler(SpaceSampler):
    """Uniform over valid, unseen configurations."""

    name = "random"

    def propose(self, study: Study, trial: FrozenTrial, history: History) -> Proposal:
        return Proposal(self.random_unseen(history), "random")
