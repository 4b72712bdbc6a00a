"""Evolutionary search: tournament selection, uniform crossover, neighbour mutation, and a
surrogate that picks which child to evaluate.

The population is not held in memory: it is the ``population`` best completed trials of
the study, so every worker sharing the study breeds from the same parents, the best are
always kept (elitism, a (mu + lambda) scheme) and failures are never parents.
Generation 0 is the space's seed configurations, then random valid ones until ``init``
trials. After that each proposal breeds ``candidates`` distinct valid, unseen children and
evaluates the one a kernel regression over the study's results predicts fastest
(``surrogate.py``); with probability ``immigrant_rate`` it evaluates a random configuration
instead. ``candidates=1`` is the plain genetic algorithm.

Measured on exhaustive recordings (``benchmarks/strategies.py``): screening 24 children and
starting to breed after 6 trials halves the evaluations the plain algorithm needs to come
within 2% of the optimum.
"""
from __future__ import annotations

from optuna.study import Study
from optuna.trial import FrozenTrial

from ...space import Config, Param, Space
from .base import History, Proposal, SpaceSampler
from .surrogate import KernelRegression


class EvoSampler(SpaceSampler):
    """A steady-state genetic algorithm over the space's valid configurations."""

    name = "evo"

    def __init__(
        self,
        space: Space,
        *,
        seed: int | None = None,
        population: int | None = None,
        init: int = 6,
        tournament: int = 3,
        mutation_rate: float = 0.2,
        crossover_rate: float = 0.7,
        immigrant_rate: float = 0.1,
        candidates: int = 24,
        bandwidth: float = 1.0,
        max_repairs: int = 24,
    ) -> None:
        super().__init__(space, seed=seed)
        self.population = space.search.population if population is None else population
        self.init = init
        self.tournament = tournament
        self.mutation_rate = mutation_rate
        self.crossover_rate = crossover_rate
        self.immigrant_rate = immigrant_rate
        self.candidates = candidates
        self.max_repairs = max_repairs
        if self.population < 1:
            raise ValueError(f"population must be >= 1, got {self.population}")
        if init < 1:
            raise ValueError(f"init must be >= 1, got {init}")
        if tournament < 1:
            raise ValueError(f"tournament must be >= 1, got {tournament}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        if max_repairs < 0:
            raise ValueError(f"max_repairs must be >= 0, got {max_repairs}")
        for label, rate in (("mutation_rate", mutation_rate), ("crossover_rate", crossover_rate), ("immigrant_rate", immigrant_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {rate}")
        self.surrogate = KernelRegression(space, bandwidth=bandwidth)
        self._mutable: tuple[Param, ...] = tuple(p for p in space.params if len(p.values) > 1)

    # -- public helpers -------------------------------------------------------------------
    def parents(self, study: Study) -> list[Config]:
        """The current parent pool: the best ``population`` completed configurations."""
        return [c for c, _ in self.history(study).best(self.population)]

    # -- the strategy ------------------------------------------------------------------------
    def propose(self, study: Study, trial: FrozenTrial, history: History) -> Proposal:
        rng = self._rng
        for seed in self.space.search.seeds:  # generation 0: every seed first
            if self.is_new(seed, history):
                return Proposal(seed, "seed")
        pool = [c for c, _ in history.best(self.population)]
        if history.n_trials < self.init or not pool:
            return Proposal(self.random_unseen(history), "random")
        if rng.random() < self.immigrant_rate:
            return Proposal(self.random_unseen(history), "immigrant")

        children: dict[Config, Proposal] = {}
        for _ in range(2 * self.candidates):
            child = self._breed(pool, history)
            if child is not None:
                children.setdefault(child.config, child)
            if len(children) >= self.candidates:
                break
        if len(children) > 1:
            options = list(children.values())
            self.surrogate.fit(history.complete, history.failed)
            predicted = self.surrogate.predict([p.config for p in options])
            return options[int(predicted.argmin())]
        if children:
            return next(iter(children.values()))

        for parent in pool:
            options = [n for n in self._neighbours(parent) if self.is_new(n, history)]
            if options:
                return Proposal(rng.choice(options), "neighbour", (parent,))
        return Proposal(self.random_unseen(history), "random")

    def _breed(self, pool: list[Config], history: History) -> Proposal | None:
        """A valid, unseen child of one or two parents from ``pool``, or None after the repairs."""
        rng = self._rng
        first = self._select(pool)
        parents: tuple[Config, ...] = (first,)
        child = first
        if len(pool) > 1 and rng.random() < self.crossover_rate:
            second = self._select([c for c in pool if c != first])
            parents = (first, second)
            child = self._crossover(first, second)

        candidate = self._mutate(child, force=child in parents)
        for attempt in range(self.max_repairs):
            if self.is_new(candidate, history):
                return Proposal(candidate, "child", parents)
            # invalid or seen: mutate again, starting over from the child now and then
            candidate = self._mutate(child if attempt % 8 == 7 else candidate, force=True)
        return Proposal(candidate, "child", parents) if self.is_new(candidate, history) else None

    # -- operators ----------------------------------------------------------------------------
    def _select(self, pool: list[Config]) -> Config:
        """Tournament: the best of ``tournament`` distinct members (``pool`` is best first)."""
        picks = self._rng.sample(range(len(pool)), min(self.tournament, len(pool)))
        return pool[min(picks)]

    def _crossover(self, a: Config, b: Config) -> Config:
        """Uniform crossover: each parameter from either parent with probability 1/2."""
        return Config({n: (a[n] if self._rng.random() < 0.5 else b[n]) for n in self._names})

    def _mutate(self, config: Config, force: bool = True) -> Config:
        """Each parameter changes with ``mutation_rate``; with ``force``, at least one does."""
        if not self._mutable:
            return config
        rng = self._rng
        changes = {p.name: self._step(p, config[p.name]) for p in self._mutable if rng.random() < self.mutation_rate}
        if not changes and force:
            p = rng.choice(self._mutable)
            changes[p.name] = self._step(p, config[p.name])
        return config.replace(**changes)

    def _neighbours(self, config: Config) -> list[Config]:
        """Configurations one mutation step away (valid or not), in parameter order."""
        out = []
        for p in self._mutable:
            out.extend(config.replace(**{p.name: v}) for v in p.steps(config[p.name]))
        return out

    def _step(self, param: Param, value: object) -> object:
        """An ordinal parameter moves to an adjacent value; a categorical one to another value."""
        return self._rng.choice(param.steps(value))
