"""Evolutionary search guided by a model: every proposal is the candidate a Gaussian process
over the study's results expects to improve most on the best so far.

The population is not held in memory: it is the ``population`` best completed trials of
the study, so every worker sharing the study breeds from the same parents, the best are
always kept (elitism, a (mu + lambda) scheme) and failures are never parents.
Generation 0 is the space's seed configurations, then random valid ones until ``init``
trials (by default one per parameter that takes more than one value). After that each
proposal gathers candidates, all valid and unseen:

- ``candidates`` children of the population (tournament selection, uniform crossover,
  mutation to neighbouring values);
- the neighbours of the ``elites`` best configurations: every configuration that changes at
  most ``radius`` parameters, an ordinal one by one step. The space's constraints couple
  parameters (a tile's rows, its warps and its K/V groups), so that single mutations of a
  good configuration are mostly invalid; the valid set is enumerated, so its neighbourhoods
  are too;

and evaluates the one of highest expected improvement under a Gaussian process of the log
objective, times its estimated chance to run (``gp.py``). When no candidate is left, every
unseen valid configuration is a candidate. With probability ``immigrant_rate`` a proposal is
a random configuration instead.

In batches (``propose_batch``, k proposals for k free devices) the process is fitted once:
each later proposal of the batch refits it with the same length scale and noise, the earlier
ones pending at the mean the process predicts for them (a kriging believer), so that the
batch spreads out.

A proposal's cost does not grow with the history: the finished trials come from the history
reader's log, each turned into rows of the enumerated space once (``_Tally``); the process
holds at most its ``max_points`` (then its length scale and noise are searched every
``SEARCH_EVERY`` fits, kept in between); breeding makes at most ``MAX_MUTATIONS`` mutations,
repairs included; the chance to run, which compares a candidate with every evaluated
configuration, is computed only for the candidates whose expected improvement could still win
(``_best``); with no child or neighbour left, ``SCAN_LIMIT`` unseen configurations drawn at
random are scored, not the whole space. On the 17,956
configurations of the GEMM recording, ``benchmarks/proposal_time.py`` measures the same time
per proposal after 2,000 evaluations as after 100.

``model="kr"`` screens the children alone by the kernel regression's predicted mean
(``surrogate.py``; with ``init=6``, the strategy before the Gaussian process);
``candidates=1, radius=0`` is the plain genetic algorithm.

Measured on exhaustive recordings (``benchmarks/README.md``): within 2% of the optimum of the
686-configuration D128 recording in a median 22 evaluations over 100 seeds, against 30 for
the kernel-regression screen.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from ...space import Config, Param, Space
from .base import Folded, History, Proposal, SpaceSampler
from .gp import Encoder, GaussianProcess
from .surrogate import KernelRegression

MODELS = ("gp", "kr")
SEARCH_EVERY = 20
"""Once the process is fitted to its ``max_points`` (its cost no longer grows with the history),
its length scale and noise are searched again every this many fits, kept in between."""
_MEMO = 1 << 16  # configurations an operator's memo holds before it starts over
MAX_MUTATIONS = 192
"""Mutations (a child's first and its repairs) one proposal's breeding makes at most. As the
study fills the parents' neighbourhood, ever more mutated children are evaluated already and
repaired again (on the 6,768 configurations of the convolution recording: a median 87 per
proposal at 100-200 evaluations, 980 at 1,500-2,000); beyond this many the proposal takes the
children bred so far, with the elites' neighbours (or the model's scan when none is left)."""
SCAN_LIMIT = 2048
"""When no child or neighbour is left, the expected improvement is computed at this many unseen
configurations drawn at random (all of them in a smaller space)."""


class EvoSampler(SpaceSampler):
    """A steady-state genetic algorithm whose proposals a Gaussian process picks."""

    name = "evo"

    def __init__(
        self,
        space: Space,
        *,
        seed: int | None = None,
        population: int | None = None,
        init: int | None = None,
        tournament: int = 3,
        mutation_rate: float = 0.2,
        crossover_rate: float = 0.7,
        immigrant_rate: float = 0.1,
        candidates: int = 24,
        radius: int = 2,
        elites: int = 3,
        model: str = "gp",
        bandwidth: float = 1.0,
        max_repairs: int = 24,
        max_mutations: int = MAX_MUTATIONS,
    ) -> None:
        super().__init__(space, seed=seed)
        self.population = space.search.population if population is None else population
        self._mutable: tuple[Param, ...] = tuple(p for p in space.params if len(p.values) > 1)
        self.init = max(2, len(self._mutable)) if init is None else init
        self.tournament = tournament
        self.mutation_rate = mutation_rate
        self.crossover_rate = crossover_rate
        self.immigrant_rate = immigrant_rate
        self.candidates = candidates
        self.radius = radius
        self.elites = elites
        self.model = model
        self.max_repairs = max_repairs
        self.max_mutations = max_mutations
        self._mutations_left = max_mutations  # of the proposal under way
        if self.population < 1:
            raise ValueError(f"population must be >= 1, got {self.population}")
        if self.init < 1:
            raise ValueError(f"init must be >= 1, got {self.init}")
        if tournament < 1:
            raise ValueError(f"tournament must be >= 1, got {tournament}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        if radius < 0 or elites < 1:
            raise ValueError(f"radius must be >= 0 and elites >= 1, got {radius} and {elites}")
        if model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
        if max_repairs < 0:
            raise ValueError(f"max_repairs must be >= 0, got {max_repairs}")
        if max_mutations < 1:
            raise ValueError(f"max_mutations must be >= 1, got {max_mutations}")
        for label, rate in (("mutation_rate", mutation_rate), ("crossover_rate", crossover_rate), ("immigrant_rate", immigrant_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {rate}")
        self.surrogate = KernelRegression(space, bandwidth=bandwidth)
        self.gp = GaussianProcess()
        self._encoder = Encoder(space)
        self._tables: _Tables | None = None
        self._batch_fits: int | None = None  # fits in the batch under way (None: no batch)
        self._rows_cache: tuple[History, tuple[int, int, int], _Rows] | None = None
        self._tally: _Tally | None = None  # the reader's finished trials as rows, kept up to date
        self._fits_since_search = 0
        self._rows_of: dict[Config, tuple] = {}
        self._valid_of: dict[tuple, Config] | None = None  # a valid configuration by its canonical values
        self._steps: dict[tuple[str, object], tuple] = {}
        self._at = {name: i for i, name in enumerate(self._names)}
        self._mutable_at: tuple[tuple[int, Param], ...] = tuple((self._at[p.name], p) for p in self._mutable)
        # per path, where its unused parameters sit and their neutral values (Config.canonical)
        self._path_at = self._at.get("PATH") if space.paths else None
        self._neutral_at = {path.name: tuple((self._at[n], v) for n, v in space.unused(path.name).items())
                            for path in space.paths}

    # -- public helpers -------------------------------------------------------------------
    def parents(self, study: Study) -> list[Config]:
        """The current parent pool: the best ``population`` completed configurations."""
        return [c for c, _ in self.history(study).best(self.population)]

    def neighbours(self, config: Config, history: History, radius: int | None = None) -> list[Config]:
        """Valid configurations not in the study that change at most ``radius`` parameters of
        ``config``, an ordinal one by one step (in enumeration order)."""
        tables = self.tables
        i = tables.index.get(config)
        if i is None:
            return []
        free = tables.unseen(history)
        return [self.valid[j] for j in tables.near(i, free, self.radius if radius is None else radius)]

    @classmethod
    def opening(cls, space: Space) -> tuple[Config, ...]:
        """Generation 0 starts with the space's seeds."""
        return tuple(space.search.seeds)

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

        options: dict[Config, Proposal] = {}
        self._mutations_left = self.max_mutations
        for _ in range(2 * self.candidates):
            if self._mutations_left <= 0:  # the neighbourhood is filling up: the children so far
                break
            child = self._breed(pool, history)
            if child is not None:
                options.setdefault(child.config, child)
            if len(options) >= self.candidates:
                break
        if self.model == "kr":
            return self._screen_kr(list(options.values()), pool, history)

        tables = self.tables
        free = self._rows(history).free
        if self.radius:
            for elite in pool[: self.elites]:
                i = tables.index.get(elite)
                if i is not None:
                    for j in tables.near(i, free, self.radius):
                        options.setdefault(self.valid[j], Proposal(self.valid[j], "neighbour", (elite,)))
        if len(options) == 1:
            return next(iter(options.values()))
        if not options:  # nothing near: the whole space
            return self.best_unseen(history)
        self._fit(history)
        proposals = list(options.values())
        return proposals[self._best([tables.index[p.config] for p in proposals], history)]

    def propose_batch(self, study: Study, trial: FrozenTrial | None, history: History, k: int) -> list[Proposal]:
        """``k`` proposals from one model fit: the later ones refit the process with the same
        length scale and noise, the earlier ones pending at their predicted mean (a believer)."""
        self._batch_fits = 0
        try:
            return super().propose_batch(study, trial, history, k)
        finally:
            self._batch_fits = None

    def best_unseen(self, history: History) -> Proposal:
        """The valid configuration not in the study of highest expected improvement."""
        free = self._rows(history).free
        if not len(free):
            return Proposal(self._rng.choice(self.valid), "repeat")
        if len(free) > SCAN_LIMIT:  # a sample of a large space: the scan's cost stays bounded
            free = free[np.sort(np.asarray(self._rng.sample(range(len(free)), SCAN_LIMIT)))]
        self._fit(history)
        return Proposal(self.valid[int(free[self._best(free, history)])], "model")

    def _screen_kr(self, options: list[Proposal], pool: list[Config], history: History) -> Proposal:
        """The child the kernel regression predicts fastest; a neighbour or a random one if none."""
        if len(options) > 1:
            self.surrogate.fit(history.complete, history.failed)
            predicted = self.surrogate.predict([p.config for p in options])
            return options[int(predicted.argmin())]
        if options:
            return options[0]
        for parent in pool:
            near = self.neighbours(parent, history, radius=1)
            if near:
                return Proposal(self._rng.choice(near), "neighbour", (parent,))
        return Proposal(self.random_unseen(history), "random")

    def _rows(self, history: History) -> "_Rows":
        """``history`` as rows of the tables (computed once per history and size): from the
        reader's log, what it folded in since the last proposal, else from the whole history."""
        key = (len(history.seen), len(history.complete), len(history.failed))
        cache = self._rows_cache
        if cache is None or cache[0] is not history or cache[1] != key:
            rows = self._rows_from_log(history) or self._rows_from_history(history)
            self._rows_cache = (history, key, rows)
        return self._rows_cache[2]

    def _rows_from_history(self, history: History) -> "_Rows":
        tables = self.tables
        index = tables.index
        ok = [(index[c], v) for c, v in history.complete if v > 0 and c in index]
        done = {c for c, _ in history.complete} | set(history.failed)
        return _Rows(
            ok=np.array([i for i, _ in ok], dtype=int), values=np.array([v for _, v in ok], dtype=float),
            complete=np.array([index[c] for c, _ in history.complete if c in index], dtype=int),
            failed=np.array([index[c] for c in history.failed if c in index], dtype=int),
            pending=np.array([index[c] for c in history.seen - done if c in index], dtype=int),
            free=tables.unseen(history),
        )

    def _rows_from_log(self, history: History) -> "_Rows | None":
        """The rows from the tally of the reader's log, brought up to ``history``; None for a
        history the tally cannot describe (made by hand, or older than the tally)."""
        log = history.log
        if log is None:
            return None
        tally = self._tally
        if tally is None or tally.log is not log:
            tally = self._tally = _Tally(log, self.tables.index)
        if tally.cursor > history.logged:  # read before the last proposal's history (a background batch's)
            return None
        tally.advance(history.logged, history.maximize)
        if tally.n_complete != len(history.complete) or tally.n_failed != len(history.failed):
            return None
        index = self.tables.index
        if len(history.seen) == len(tally.folded):  # nothing under way (``folded`` is part of ``seen``)
            held: set[Config] = set()
            pending = tally.folded - tally.done if len(tally.folded) != len(tally.done) else held
        else:  # small: the trials under way, the batch's earlier proposals
            held, pending = history.seen - tally.folded, history.seen - tally.done
        mask = ~tally.seen
        mask[[index[c] for c in held if c in index]] = False
        ok, values, complete = tally.ranked()
        return _Rows(ok=ok, values=values, complete=complete, failed=np.array(tally.failed, dtype=int),
                     pending=np.array([index[c] for c in pending if c in index], dtype=int),
                     free=np.flatnonzero(mask))

    def _fit(self, history: History) -> None:
        """The Gaussian process on the study's successes and pending configurations; its length
        scale and noise searched on every fit while it holds fewer than its ``max_points``, then
        every ``SEARCH_EVERY`` fits (and once per batch)."""
        tables, rows = self.tables, self._rows(history)
        points = len(rows.ok) + (len(rows.pending) if len(rows.ok) else 0)
        keep = bool(self._batch_fits) or (
            points > self.gp.max_points and 0 < self._fits_since_search < SEARCH_EVERY)
        self.gp.fit(tables.x[rows.ok], rows.values, tables.x[rows.pending], keep_hyperparameters=keep)
        self._fits_since_search = self._fits_since_search + 1 if keep else 1
        if self._batch_fits is not None:
            self._batch_fits += 1

    def _score(self, rows: "list[int] | np.ndarray", history: History) -> np.ndarray:
        """Expected improvement times the chance to run, at valid configurations ``rows``."""
        tables, seen = self.tables, self._rows(history)
        x = tables.x[rows]
        return self.gp.expected_improvement(x) * self.gp.feasibility(x, tables.x[seen.complete], tables.x[seen.failed])

    def _best(self, rows: "list[int] | np.ndarray", history: History) -> int:
        """The position in ``rows`` of the highest ``_score`` (the first of equals, as
        ``np.argmax``). The chance to run compares a configuration with every evaluated one (its
        cost grows with the history), so it is computed in order of falling expected improvement,
        in growing chunks, up to a configuration whose improvement cannot beat the best score so
        far (the chance is at most 1): mostly a few dozen, not the thousands of a scan."""
        tables, seen = self.tables, self._rows(history)
        x = tables.x[rows]
        gain = self.gp.expected_improvement(x)
        if not len(seen.failed):  # every chance 1
            return int(np.argmax(gain))
        ok, failed = tables.x[seen.complete], tables.x[seen.failed]
        order = np.argsort(-gain, kind="stable")
        score = np.full(len(gain), -np.inf)
        best, start, size = -np.inf, 0, 8
        while start < len(order) and not (best >= 0 and gain[order[start]] < best):
            part = order[start:start + size]
            score[part] = gain[part] * self.gp.feasibility(x[part], ok, failed)
            best = max(best, float(score[part].max()))
            start, size = start + size, 2 * size
        return int(np.argmax(score))

    def warm(self) -> None:
        super().warm()
        self.tables  # noqa: B018 - the encoded valid set and its neighbourhoods
        self.valid_of  # noqa: B018

    @property
    def tables(self) -> "_Tables":
        if self._tables is None:
            self._tables = _Tables(self.space, self.valid, self._encoder)
        return self._tables

    def _breed(self, pool: list[Config], history: History) -> Proposal | None:
        """A valid, unseen child of one or two parents from ``pool``, or None after the repairs.
        The operators work on canonical values; only a valid child is looked up as a configuration."""
        rng = self._rng
        first = self._select(pool)
        parents: tuple[Config, ...] = (first,)
        child = self._values(first)
        if len(pool) > 1 and rng.random() < self.crossover_rate:
            second = self._select([c for c in pool if c != first])
            parents = (first, second)
            child = self._crossover(child, self._values(second))

        candidate = self._mutate(child, force=any(child == self._values(p) for p in parents))
        self._mutations_left -= 1
        valid_of, seen = self.valid_of, history.seen
        for attempt in range(self.max_repairs):
            config = valid_of.get(candidate)
            if config is not None and config not in seen:  # is_new
                return Proposal(config, "child", parents)
            if self._mutations_left <= 0:  # the proposal's breeding is spent
                break
            # invalid or seen: mutate again, starting over from the child now and then
            candidate = self._mutate(child if attempt % 8 == 7 else candidate, force=True)
            self._mutations_left -= 1
        config = valid_of.get(candidate)
        return Proposal(config, "child", parents) if config is not None and self.is_new(config, history) else None

    # -- operators ----------------------------------------------------------------------------
    def _select(self, pool: list[Config]) -> Config:
        """Tournament: the best of ``tournament`` distinct members (``pool`` is best first)."""
        picks = self._rng.sample(range(len(pool)), min(self.tournament, len(pool)))
        return pool[min(picks)]

    def _crossover(self, a: tuple, b: tuple) -> tuple:
        """Uniform crossover of two canonical value rows: each parameter from either with probability 1/2."""
        rng = self._rng
        # every parameter, a path's unused ones neutral
        return self._canonical(tuple(x if rng.random() < 0.5 else y for x, y in zip(a, b)))

    def _mutate(self, values: tuple, force: bool = True) -> tuple:
        """Each parameter changes with ``mutation_rate``; with ``force``, at least one does."""
        if not self._mutable:
            return values
        rng, rate = self._rng, self.mutation_rate
        out = list(values)
        changed = False
        for i, p in self._mutable_at:
            if rng.random() < rate:
                out[i] = self._step(p, out[i])
                changed = True
        if not changed and force:
            i, p = rng.choice(self._mutable_at)
            out[i] = self._step(p, out[i])
        return self._canonical(tuple(out))

    def _values(self, config: Config) -> tuple:
        """``config.canonical()``'s values in the order of the space's parameters, computed
        once per configuration."""
        values = self._rows_of.get(config)
        if values is None:
            if len(self._rows_of) >= _MEMO:
                self._rows_of.clear()
            canonical = config.canonical()
            values = self._rows_of[config] = tuple(canonical[n] for n in self._names)
        return values

    def _canonical(self, values: tuple) -> tuple:
        """``values`` with the parameters their path does not use at the neutral values, as
        ``space.config`` would hash them."""
        if self._path_at is None:
            return values
        neutral = self._neutral_at.get(values[self._path_at])
        if not neutral:
            return values
        out = list(values)
        for i, value in neutral:
            out[i] = value
        return tuple(out)

    @property
    def valid_of(self) -> dict[tuple, Config]:
        """Every valid configuration by its canonical values (built once)."""
        if self._valid_of is None:
            names = self._names
            self._valid_of = {tuple(map(canonical.__getitem__, names)): c
                              for c in self.valid for canonical in (c.canonical(),)}
        return self._valid_of

    def _step(self, param: Param, value: object) -> object:
        """An ordinal parameter moves to an adjacent value; a categorical one to another value."""
        steps = self._steps.get((param.name, value))
        if steps is None:
            steps = self._steps[(param.name, value)] = param.steps(value)
        return self._rng.choice(steps)


@dataclass(frozen=True)
class _Rows:
    """A history as row indices of the tables: successes (with values, best first), every
    completed one, failures, pending configurations, and the valid ones not in the study (sorted)."""

    ok: np.ndarray
    values: np.ndarray
    complete: np.ndarray
    failed: np.ndarray
    pending: np.ndarray
    free: np.ndarray


class _Tally:
    """A history reader's finished trials (its log) as rows of the tables, brought up to date
    by reading only the entries added since: a proposal costs what is new, not the history."""

    def __init__(self, log: list[Folded], index: dict[Config, int]) -> None:
        self.log = log
        self.index = index
        self.cursor = 0  # entries of the log tallied
        self.seen = np.zeros(len(index), dtype=bool)  # rows of every finished configuration
        self.folded: set[Config] = set()  # every finished configuration
        self.done: set[Config] = set()  # completed (with a value) or failed
        self.n_complete = self.n_failed = 0
        self.failed: list[int] = []
        self._keys: list[tuple[float, int]] = []  # the completed ones' (rank, trial number), sorted
        self._rows: list[int] = []  # their rows, in that order
        self._values: list[float] = []  # their objectives, in that order
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # ``_rows``, ``_values`` as arrays
        self._inserted: list[tuple[int, int, float]] = []  # (at, row, value) since ``_arrays``
        self._ranked: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def advance(self, upto: int, maximize: bool) -> None:
        for entry in self.log[self.cursor:upto]:
            config, row = entry.config, self.index.get(entry.config)
            self.folded.add(config)
            if row is not None:
                self.seen[row] = True
            if entry.state == TrialState.COMPLETE and entry.value is not None:
                self.n_complete += 1
                self.done.add(config)
                if row is not None:
                    key = (-entry.value if maximize else entry.value, entry.number)
                    at = bisect.bisect(self._keys, key)
                    self._keys.insert(at, key)
                    self._rows.insert(at, row)
                    self._values.insert(at, entry.value)
                    self._inserted.append((at, row, entry.value))
                    self._ranked = None
            elif entry.state == TrialState.FAIL:
                self.n_failed += 1
                self.done.add(config)
                if row is not None:
                    self.failed.append(row)
        self.cursor = max(self.cursor, upto)

    def ranked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of the successes (objective > 0) and their values, and rows of every completed
        configuration, best first (as ``History.complete``). The arrays take the entries added
        since the last call where they go (a copy in numpy), not rebuilt from the lists."""
        if self._ranked is None:
            if self._arrays is None or len(self._inserted) > 64:
                rows, values = np.array(self._rows, dtype=int), np.array(self._values, dtype=float)
            else:
                rows, values = self._arrays
                for at, row, value in self._inserted:
                    rows, values = np.insert(rows, at, row), np.insert(values, at, value)
            self._arrays, self._inserted = (rows, values), []
            positive = values > 0
            self._ranked = (rows[positive], values[positive], rows)
        return self._ranked


class _Tables:
    """The valid configurations as arrays: encoded rows, value indices, a lookup."""

    def __init__(self, space: Space, valid: list[Config], encoder: Encoder) -> None:
        params = [p for p in space.params if len(p.values) > 1]
        self.index = {c: i for i, c in enumerate(valid)}
        self.x = encoder(valid)
        rows = [c.canonical() for c in valid]
        self.codes = np.array([[p.values.index(c[p.name]) for p in params] for c in rows], dtype=int).reshape(len(valid), len(params))
        self.ordinal = np.array([p.ordinal for p in params], dtype=bool)
        self._near: dict[tuple[int, int], np.ndarray] = {}

    def unseen(self, history: History) -> np.ndarray:
        """Indices of the valid configurations the study does not hold."""
        mask = np.ones(len(self.index), dtype=bool)
        seen = [self.index[c] for c in history.seen if c in self.index]
        mask[seen] = False
        return np.flatnonzero(mask)

    def near(self, i: int, among: np.ndarray, radius: int) -> np.ndarray:
        """Those of ``among`` (sorted indices) that change at most ``radius`` parameters of ``i``,
        ordinal ones by one step. A configuration's neighbourhood is computed once."""
        found = self._near.get((i, radius))
        if found is None:
            delta = np.abs(self.codes - self.codes[i])
            found = np.flatnonzero(~((delta > 1) & self.ordinal).any(1) & ((delta > 0).sum(1) <= radius))
            if len(self._near) >= 256:
                self._near.pop(next(iter(self._near)))
            self._near[(i, radius)] = found
        if not len(among) or not len(found):
            return among[:0]
        at = np.minimum(np.searchsorted(among, found), len(among) - 1)
        return found[among[at] == found]
