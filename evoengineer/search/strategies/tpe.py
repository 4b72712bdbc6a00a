"""TPE: Optuna's multivariate Tree-structured Parzen Estimator, kept inside the valid set."""
from __future__ import annotations

import warnings

from optuna.samplers import TPESampler
from optuna.study import Study
from optuna.trial import FrozenTrial

from ...space import Space
from .base import History, Proposal, SpaceSampler


class TPESearchSampler(SpaceSampler):
    """Asks a multivariate ``TPESampler`` for a configuration; an invalid or already seen one
    is asked again (``max_retries`` times) before falling back to a random unseen one. During
    TPE's startup phase (fewer than ``n_startup_trials`` completed trials) it draws a random
    valid, unseen configuration itself."""

    name = "tpe"

    def __init__(
        self,
        space: Space,
        *,
        seed: int | None = None,
        n_startup_trials: int = 10,
        n_ei_candidates: int = 24,
        max_retries: int = 5,
    ) -> None:
        super().__init__(space, seed=seed)
        if n_startup_trials < 0 or max_retries < 0:
            raise ValueError("n_startup_trials and max_retries must be >= 0")
        self.n_startup_trials = n_startup_trials
        self.max_retries = max_retries
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # constant_liar is experimental
            self._tpe = TPESampler(
                multivariate=True,
                seed=seed,
                n_startup_trials=n_startup_trials,
                n_ei_candidates=n_ei_candidates,
                constant_liar=True,  # trials asked ahead (still running) count as bad, so the next asks spread out
            )

    def propose(self, study: Study, trial: FrozenTrial, history: History) -> Proposal:
        if trial is not None and len(history.complete) >= self.n_startup_trials:  # None: a background batch
            for _ in range(self.max_retries + 1):
                params = self._tpe.sample_relative(study, trial, dict(self._distributions))
                if not params:
                    break
                if all(n in params for n in self._names) and self.is_new(config := self.space.config(params), history):
                    return Proposal(config, "tpe")
        return Proposal(self.random_unseen(history), "random")

    def reseed_rng(self) -> None:
        super().reseed_rng()
        self._tpe.reseed_rng()
