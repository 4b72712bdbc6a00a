"""Shared machinery of the search strategies: a space-aware Optuna sampler base.

Every strategy proposes a whole configuration in ``sample_relative``. What the study
already holds (finished trials, and running or waiting ones of other workers) is read
back into a ``History`` so that a strategy never proposes a configuration twice while
unseen valid ones remain. A proposal is *claimed* in the study's ledger (an insert that
only one trial can win, on any RDB storage) before it is returned, so that two workers
sharing a storage never take the same configuration; a proposal whose claim is lost is
replaced. The proposal is also written to the trial's system attributes (``CLAIM_KEY``:
origin and parents), where workers see it before the trial's parameters are stored.

Randomness: each proposal draws from ``random.Random(f"{seed}:{trial number}")``, so a
proposal is a function of the seed, the trial number and the study's history, and
workers started with the same seed still draw differently.

Batches: with ``batch_size`` k > 1, a trial that finds no proposal waiting computes k at
once (``propose_batch``: each later one sees the earlier ones as pending, which a model
fantasises, so one model fit serves the batch) and the next trials take the rest, each
still claimed in the ledger when it is taken. ``prefetch(study, k)`` computes the next
batch on a background thread while the queue still holds proposals, so that an ask only
pops one: the search loop calls it with the number of devices.
"""
from __future__ import annotations

import abc
import bisect
import collections
import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import optuna
import sqlalchemy
from optuna.distributions import BaseDistribution, CategoricalDistribution, distribution_to_json
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from ...space import Config, Space
from .. import optuna_internals as internals
from ..ledger import Ledger

CLAIM_KEY = "evoengineer:proposal"
"""System attribute holding ``{"config": {...}, "origin": str, "parents": [key, ...]}``."""

_CLAIM_TRIES = 64
_ID_MARGIN = 256
_REJECTION_TRIES = 32


@dataclass(frozen=True)
class Proposal:
    """A configuration a strategy proposes, how it came about and from which parents."""

    config: Config
    origin: str
    parents: tuple[Config, ...] = ()

    def to_attr(self) -> dict[str, Any]:
        return {
            "config": self.config.canonical(),
            "origin": self.origin,
            "parents": [p.key() for p in self.parents],
        }


@dataclass
class History:
    """What a study holds, seen from one trial: configurations taken and results so far."""

    seen: set[Config] = field(default_factory=set)
    complete: list[tuple[Config, float]] = field(default_factory=list)
    failed: list[Config] = field(default_factory=list)
    n_trials: int = 0
    known: set[int] = field(default_factory=set)  # ids of finished trials already read
    log: "list[Folded] | None" = None
    """The reader's finished trials in the order it folded them in (its own list, only ever
    appended to: a strategy that keeps state per trial reads ``log[its cursor:logged]``)."""
    logged: int = 0
    """How many entries of ``log`` this history holds."""
    maximize: bool = False
    """The study's direction (``complete`` is best first)."""

    def best(self, n: int) -> list[tuple[Config, float]]:
        """The ``n`` best completed configurations, best first (``complete`` is kept sorted)."""
        return self.complete[:n]


@dataclass(frozen=True)
class Folded:
    """A finished trial as a history reader folded it in."""

    config: Config
    state: TrialState
    value: float | None
    number: int


def trial_config(trial: FrozenTrial, names: Sequence[str], space: Space | None = None) -> Config | None:
    """The configuration a trial holds or is about to evaluate, if it can be told: its
    parameters, else its enqueued values, else a sampler's claim. A trial holds every parameter
    of ``names`` (a path's unused ones at their neutral values); ``space`` keeps its path's."""
    for values in (trial.params, trial.system_attrs.get("fixed_params"), _claimed(trial)):
        if isinstance(values, dict) and all(n in values for n in names):
            picked = {n: values[n] for n in names}
            return space.config(picked) if space is not None else Config(picked)
    return None


def _claimed(trial: FrozenTrial) -> dict[str, Any] | None:
    claim = trial.system_attrs.get(CLAIM_KEY)
    return claim.get("config") if isinstance(claim, dict) else None


def read_history(study: Study, names: Sequence[str], exclude: int | None = None, space: Space | None = None) -> History:
    """Collect the study's trials (all states) except trial number ``exclude``."""
    return HistoryReader(names, space).read(study, exclude)


class HistoryReader:
    """Reads a study's history incrementally: finished trials, which no longer change, are
    folded in once; pending trials (running, waiting) are read again on every call.

    With ``intern`` (a mapping of every valid configuration to itself), the configurations it
    reads are the space's own objects, so that sets and dicts of them match by identity.

    On an RDB storage a read asks, in one query, for the trials from the oldest one still
    pending on that it has not folded in (those it has are left out by ranges of ids), with
    their first objective and their parameters; the enqueued values and claims of the ones
    without every parameter take a second. Its cost follows the trials finished since the last
    read and those under way, not the history (Optuna's own read loads every pending trial
    whole, attributes and all).
    """

    def __init__(self, names: Sequence[str], space: Space | None = None) -> None:
        self.names = tuple(names)
        self.space = space
        self.intern: dict[Config, Config] | None = None
        self.decoded = 0
        """Configurations of trials decoded so far: the finished ones once, pending ones per read."""
        self._study: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self._low = 0  # every trial of a lower id is finished and folded in
        self._newest = -1  # the highest trial id read
        self._known: set[int] = set()
        self._recent: set[int] = set()  # those of ``_known`` from ``_low`` on (the RDB read leaves them out)
        self._decoders: dict[str, BaseDistribution] = {}
        self._seen: set[Config] = set()
        self._complete: list[tuple[Config, float]] = []
        self._order: list[tuple[float, int]] = []
        self._failed: list[Config] = []
        self._log: list[Folded] = []  # a new list after a reset: a strategy's cursor into the old one is void
        self._maximize = False

    def interned(self, config: Config | None) -> Config | None:
        """The space's own object for ``config`` (sets and dicts of them then match by identity)."""
        if config is None or self.intern is None:
            return config
        return self.intern.get(config, config)

    def _history(self, n_trials: int) -> History:
        return History(seen=set(self._seen), complete=list(self._complete), failed=list(self._failed),
                       n_trials=n_trials, known=set(self._known), log=self._log, logged=len(self._log),
                       maximize=self._maximize)

    def read(self, study: Study, exclude: int | None = None) -> History:
        ident = (id(internals.storage(study)), internals.study_id(study))
        if ident != self._study:
            self._study = ident
            self._reset()
        maximize = self._maximize = study.direction == StudyDirection.MAXIMIZE
        rdb = internals.rdb_backend(study)
        if rdb is not None:
            return self._read_rdb(study, rdb, exclude, maximize)
        return self._read_trials(study, exclude, maximize)

    def _read_trials(self, study: Study, exclude: int | None, maximize: bool) -> History:
        """Any storage: every trial through Optuna (finished ones folded in once)."""
        n_trials = 0
        pending: list[FrozenTrial] = []
        for t in study.get_trials(deepcopy=False):
            if t.number == exclude:
                continue
            n_trials += 1
            if internals.trial_id(t) in self._known:
                continue
            if t.state.is_finished():
                self._fold(t, maximize)
            else:
                pending.append(t)
        history = self._history(n_trials)
        for t in pending:
            config = self.interned(trial_config(t, self.names, self.space))
            if config is not None:
                history.seen.add(config)
        return history

    def _fold(self, t: FrozenTrial, maximize: bool) -> None:
        self._fold_values(internals.trial_id(t), t.number, t.state, t.value, trial_config(t, self.names, self.space), maximize)

    def _fold_values(self, trial_id: int, number: int, state: TrialState, value: float | None,
                     config: Config | None, maximize: bool) -> None:
        self._known.add(trial_id)
        config = self.interned(config)
        if config is None:
            return
        self._log.append(Folded(config, state, value, number))
        self._seen.add(config)
        if state == TrialState.COMPLETE and value is not None:
            key = (-value if maximize else value, number)
            at = bisect.bisect(self._order, key)
            self._order.insert(at, key)
            self._complete.insert(at, (config, value))
        elif state == TrialState.FAIL:
            self._failed.append(config)

    def _read_rdb(self, study: Study, rdb: optuna.storages.RDBStorage, exclude: int | None, maximize: bool) -> History:
        from optuna.distributions import json_to_distribution

        models = internals.trial_models()
        trial_model, value_model, param_model = models.TrialModel, models.TrialValueModel, models.TrialParamModel
        session = internals.session(rdb)
        try:  # the trials from the watermark on not folded in yet, their first objective and parameters: one query
            query = session.query(trial_model.trial_id, trial_model.number, trial_model.state, value_model.value,
                                  value_model.value_type, param_model.param_name, param_model.param_value,
                                  param_model.distribution_json).outerjoin(
                value_model, (value_model.trial_id == trial_model.trial_id) & (value_model.objective == 0)).outerjoin(
                param_model, param_model.trial_id == trial_model.trial_id).filter(
                trial_model.study_id == internals.study_id(study), trial_model.trial_id >= self._low)
            runs = _runs(sorted(self._recent))
            if runs:  # those folded in already are left out by ranges of ids
                query = query.filter(~sqlalchemy.or_(*(trial_model.trial_id.between(a, b) for a, b in runs)))
            trials: dict[int, _TrialRow] = {}
            for r in query.all():
                if r.trial_id in self._known:
                    continue
                row = trials.get(r.trial_id)
                if row is None:
                    value = value_model.stored_repr_to_value(r.value, r.value_type) if r.value_type is not None else None
                    row = trials[r.trial_id] = _TrialRow(r.trial_id, r.number, r.state, value, {})
                if r.param_name is not None:
                    decoder = self._decoders.get(r.distribution_json)
                    if decoder is None:
                        decoder = self._decoders[r.distribution_json] = json_to_distribution(r.distribution_json)
                    row.params[r.param_name] = decoder.to_external_repr(r.param_value)
            fresh = [t for t in trials.values() if t.state.is_finished()]
            pending = [t for t in trials.values() if not t.state.is_finished()]
            configs = self._configs(session, fresh + [t for t in pending if t.number != exclude])
            session.commit()
        finally:
            session.close()
        for t in sorted(fresh, key=lambda t: t.number):
            self._fold_values(t.trial_id, t.number, t.state, t.value if t.state == TrialState.COMPLETE else None,
                              configs.get(t.trial_id), maximize)
            self._recent.add(t.trial_id)
        # the watermark stays _ID_MARGIN ids behind the newest trial: a trial another process
        # created (its id taken) but had not committed yet is still read once it has
        self._newest = max([self._newest, *trials])
        self._low = max(self._low, min([t.trial_id for t in pending] + [self._newest + 1 - _ID_MARGIN]))
        self._recent = {i for i in self._recent if i >= self._low}
        excluded = sum(1 for t in trials.values() if t.number == exclude)
        history = self._history(len(self._known) + len(pending) - excluded)
        history.seen.update(c for c in (self.interned(configs.get(t.trial_id)) for t in pending if t.number != exclude)
                            if c is not None)
        return history

    def _configs(self, session: Any, trials: "list[_TrialRow]") -> dict[int, Config]:
        """The configurations of ``trials``: their parameters, else their enqueued values, else
        a sampler's claim (as ``trial_config``; the attributes are read only for trials without
        every parameter)."""
        self.decoded += len(trials)
        models = internals.trial_models()
        attr_model = models.TrialSystemAttributeModel
        attrs: dict[int, dict[str, Any]] = {}
        partial = [t.trial_id for t in trials if not all(n in t.params for n in self.names)]
        if partial:
            for trial_id, key, raw in session.query(attr_model.trial_id, attr_model.key, attr_model.value_json).filter(
                    attr_model.trial_id.in_(partial), attr_model.key.in_(("fixed_params", CLAIM_KEY))):
                attrs.setdefault(trial_id, {})[key] = json.loads(raw)
        out = {}
        for t in trials:
            claim = attrs.get(t.trial_id, {}).get(CLAIM_KEY)
            for found in (t.params, attrs.get(t.trial_id, {}).get("fixed_params"),
                          claim.get("config") if isinstance(claim, dict) else None):
                if isinstance(found, dict) and all(n in found for n in self.names):
                    picked = {n: found[n] for n in self.names}
                    out[t.trial_id] = self.space.config(picked) if self.space is not None else Config(picked)
                    break
        return out


@dataclass
class _TrialRow:
    """A trial as the RDB read gets it: id, number, state, first objective, parameters."""

    trial_id: int
    number: int
    state: TrialState
    value: float | None
    params: dict[str, Any]


_MAX_RUNS = 32


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ``ids`` as ranges of consecutive ids, at most ``_MAX_RUNS`` (the longest)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    if len(runs) > _MAX_RUNS:
        runs = sorted(runs, key=lambda r: r[0] - r[1])[:_MAX_RUNS]
    return runs


class SpaceSampler(optuna.samplers.BaseSampler, abc.ABC):
    """Base of every strategy: whole-configuration proposals over one ``Space``.

    Subclasses implement ``propose``; it must return a valid configuration that is not in
    ``history.seen`` (the base only calls it while such a configuration exists) and draw
    its randomness from ``self._rng``.
    """

    name = "base"

    def __init__(self, space: Space, *, seed: int | None = None) -> None:
        self.space = space
        self.seed = seed
        self._base_seed = seed if seed is not None else random.SystemRandom().getrandbits(64)
        self._rng = random.Random(self._base_seed)
        self._names = space.param_names
        self._distributions = {p.name: CategoricalDistribution(list(p.values)) for p in space.params}
        self._valid: list[Config] | None = None
        self._valid_set: frozenset[Config] | None = None
        self._proposals: dict[int, Proposal] = {}
        self._reader = HistoryReader(self._names, space)
        self._fallback = optuna.samplers.RandomSampler(seed=seed)
        self.batch_size = 1
        """Proposals computed at once when none is waiting (the search loop sets it)."""
        self.claim_params = False
        """Whether a won claim also writes the trial's parameters, in its transaction (the search
        loop sets it, and then stores no parameter of a trial for which ``params_stored``)."""
        self._stored: set[int] = set()  # trial ids whose parameters the claim wrote
        self._param_json = {name: distribution_to_json(d) for name, d in self._distributions.items()}
        self._queue: collections.deque[Proposal] = collections.deque()
        self._compute = threading.Lock()  # one batch computation at a time (they share the model and the rng)
        self._reading = threading.Lock()  # the history reader is not re-entrant
        self._background: threading.Thread | None = None
        self._background_runs = 0
        self.identity = ""
        """Tells this search's background batches from those of another search on the study with
        the same seed (the search loop sets its run's name): else both propose the same batches,
        and one loses every claim."""
        self.recipe: tuple[type, Space, int | None, dict] | None = None
        """How ``make_sampler`` made this sampler (a batch process makes its own from it)."""
        self._remote: Any = None  # a BatchProcess computing the background batches, if any
        self.batch_stats = {"batches": 0, "proposals": 0, "seconds": 0.0, "background": 0}

    @classmethod
    def opening(cls, space: Space) -> tuple[Config, ...]:
        """The configurations this strategy proposes first on ``space`` whatever the results
        (a search builds them while it starts); none unless a strategy says so."""
        return ()

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.space.name})"

    # -- the space -------------------------------------------------------------
    @property
    def valid(self) -> list[Config]:
        """Every valid configuration, in the space's enumeration order (computed once)."""
        if self._valid is None:
            valid = list(self.space.valid_list)
            if not valid:
                raise ValueError(f"space {self.space.name!r} has no valid configuration")
            self._valid, self._valid_set = valid, frozenset(valid)
            self._reader.intern = {c: c for c in valid}  # the history's configurations are these objects
        return self._valid

    @property
    def valid_set(self) -> frozenset[Config]:
        if self._valid_set is None:
            self.valid  # noqa: B018 - fills the cache
        assert self._valid_set is not None
        return self._valid_set

    def is_new(self, config: Config, history: History) -> bool:
        """Valid under the space's constraints and not yet in the study."""
        return config in self.valid_set and config not in history.seen

    def warm(self) -> None:
        """Build what the first proposal would (the valid set; a strategy adds its tables), so
        that a search does it before its clock starts, not on its first asks."""
        self.valid  # noqa: B018 - fills the cache

    def random_unseen(self, history: History) -> Config:
        """A uniformly drawn valid configuration the study does not hold."""
        valid = self.valid
        for _ in range(_REJECTION_TRIES):
            config = self._rng.choice(valid)
            if config not in history.seen:
                return config
        unseen = [c for c in valid if c not in history.seen]
        return self._rng.choice(unseen) if unseen else self._rng.choice(valid)

    def exhausted(self, history: History) -> bool:
        """Every valid configuration is in the study."""
        return history.seen.issuperset(self.valid_set)

    def history(self, study: Study, exclude: int | None = None) -> History:
        self.valid  # noqa: B018 - the reader hands back the space's own configuration objects
        with self._reading:
            return self._reader.read(study, exclude)

    # -- what a strategy implements ----------------------------------------------
    @abc.abstractmethod
    def propose(self, study: Study, trial: FrozenTrial, history: History) -> Proposal:
        """A valid configuration not in ``history.seen``."""

    def propose_batch(self, study: Study, trial: FrozenTrial | None, history: History, k: int) -> list[Proposal]:
        """Up to ``k`` distinct valid configurations not in ``history.seen``; each is added to
        ``history.seen`` before the next is proposed, so that a model counts it as pending (a
        strategy with a model overrides this to fit it once per batch)."""
        out: list[Proposal] = []
        for _ in range(k):
            if self.exhausted(history):
                break
            proposal = self.propose(study, trial, history)  # type: ignore[arg-type]
            out.append(proposal)
            history.seen.add(proposal.config)
            history.n_trials += 1  # a trial will hold it
        return out

    # -- batches ----------------------------------------------------------------------------
    def prefetch(self, study: Study, k: int) -> None:
        """Keep about ``k`` proposals waiting: when half or fewer are left, compute the next
        batch on a background thread (no-op while one is under way)."""
        k = max(1, k)
        if len(self._queue) > k // 2 or (self._background is not None and self._background.is_alive()):
            return
        self._background_runs += 1
        label = f"{self._base_seed}:{self.identity + ':' if self.identity else ''}background:{self._background_runs}"
        self._background = threading.Thread(target=self._fill, args=(study, k, label),
                                            name="evoengineer-proposals", daemon=True)
        self._background.start()

    def wait_prefetch(self, timeout: float | None = None) -> None:
        """Wait for the background batch (tests, the loop's end)."""
        if self._background is not None:
            self._background.join(timeout)

    def use_process(self, url: str, study_name: str) -> None:
        """Compute the background batches in a process of their own (``BatchProcess``), which
        reads the study ``study_name`` from the storage at ``url``."""
        from .remote import BatchProcess, adopt

        if self.recipe is not None and self._remote is None:
            self._remote = (adopt(self.recipe, url, study_name, self.batch_size)
                            or BatchProcess(self.recipe, url, study_name, self.batch_size))

    def close_process(self) -> None:
        if self._remote is not None:
            self.wait_prefetch(timeout=30)
            self._remote.close()
            self._remote = None

    def compute_batch(self, study: Study, history: History, k: int, rng: random.Random) -> list[Proposal]:
        """A background batch of up to ``k`` proposals from ``history`` (a batch process's work)."""
        with self._compute:
            return self._batch(study, None, history, k, rng, background=True)

    def _fill_remote(self, k: int, label: str) -> bool:
        """The next batch from the batch process: False if it failed (then computed here). The
        wait for the process holds no lock: an ask that finds the queue empty meanwhile computes
        its own batch rather than wait (a process's first batch, which loads the study, can take
        a second); proposals the study holds by then are skipped when taken."""
        with self._compute:
            queued = [p.config for p in self._queue]
        want = k - len(queued)
        if want <= 0:
            return True
        rows = self._remote.batch(want, queued, label)
        if rows is None:
            return False
        with self._compute:
            self.valid  # noqa: B018 - the reader's table of the space's own configuration objects
            own = lambda values: self._reader.interned(self.space.config(values))  # noqa: E731
            self._queue.extend(Proposal(own(c), origin, tuple(own(p) for p in parents)) for c, origin, parents in rows)
        return True

    def _fill(self, study: Study, k: int, label: str) -> None:
        try:
            if self._remote is not None and self._fill_remote(k, label):
                return
            history = self.history(study)
            with self._compute:
                for queued in self._queue:
                    history.seen.add(queued.config)
                want = k - len(self._queue)
                if want <= 0 or self.exhausted(history):
                    return
                self._queue.extend(self._batch(study, None, history, want, random.Random(label), background=True))
        except Exception:  # noqa: BLE001 - a failed prefetch leaves the next ask to compute its own
            return

    def _batch(self, study: Study, trial: FrozenTrial | None, history: History, k: int, rng: random.Random,
               background: bool = False) -> list[Proposal]:
        """``propose_batch`` with ``rng`` (call with ``_compute`` held), counted in ``batch_stats``."""
        import time

        started = time.perf_counter()
        self._rng = rng
        batch = self.propose_batch(study, trial, history, k)
        stats = self.batch_stats
        stats["batches"] += 1
        stats["proposals"] += len(batch)
        stats["seconds"] += time.perf_counter() - started
        stats["background"] += int(background)
        return batch

    def _pop(self, skip: set[Config]) -> Proposal | None:
        """The next waiting proposal not in ``skip``, if any."""
        while self._queue:
            try:
                proposal = self._queue.popleft()
            except IndexError:
                return None
            if proposal.config not in skip:
                return proposal
        return None

    def _take(self, study: Study, trial: FrozenTrial, history: History, rng: random.Random) -> Proposal:
        """The next waiting proposal the study does not hold yet, else a new batch's first."""
        if self.exhausted(history):
            return Proposal(rng.choice(self.valid), "repeat")
        while True:
            while self._queue:
                proposal = self._queue.popleft()
                if proposal.config not in history.seen:
                    return proposal
            with self._compute:
                if self._queue:  # a background batch came in meanwhile
                    continue
                batch = self._batch(study, trial, history, max(1, self.batch_size), rng)
                if not batch:
                    return Proposal(rng.choice(self.valid), "repeat")
                self._queue.extend(batch[1:])
                return batch[0]

    # -- Optuna's sampler interface -----------------------------------------------
    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._distributions)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        fixed = trial.system_attrs.get("fixed_params") or {}
        if all(n in fixed for n in self._names):  # an enqueued trial: its values win
            return {n: fixed[n] for n in search_space if n in fixed}
        rng = random.Random(f"{self._base_seed}:{trial.number}")
        ledger = Ledger(study)
        history: History | None = None
        lost: set[Config] = set()
        marked = False  # the claim attribute written with the ledger's claim
        for attempt in range(1, _CLAIM_TRIES + 1):
            # a waiting proposal needs no read of the study: the claim decides whether it is still free
            proposal = self._pop(lost) if ledger.atomic else None
            if proposal is None:
                if history is None:
                    history = self.history(study, exclude=trial.number)
                    history.seen.update(lost)
                proposal = self._take(study, trial, history, rng)
            if proposal.origin == "repeat":
                break
            if ledger.atomic and CLAIM_KEY not in trial.system_attrs:
                params = self._param_rows(proposal.config, trial) if self.claim_params else ()
                won, marked = ledger.claim_config_for(proposal.config.key(), trial.number, internals.trial_id(trial),
                                                      CLAIM_KEY, proposal.to_attr(), params)
                if marked and params:
                    self._stored.add(internals.trial_id(trial))
            elif ledger.atomic:
                won = ledger.claim_config(proposal.config.key(), trial.number)
            else:  # a storage without compare-and-set: claim, then look for another holder
                assert history is not None
                self._claim(study, trial, proposal)
                won = not self._taken_meanwhile(study, trial, proposal.config, history)
            if won:
                break
            lost.add(proposal.config)
            if history is not None:
                history.seen.add(proposal.config)
            rng = random.Random(f"{self._base_seed}:{trial.number}:{attempt}")
        else:  # every claim lost: nothing new could be had
            proposal = Proposal(proposal.config, "repeat")
            marked = False
        if not marked:
            self._claim(study, trial, proposal)
        self._remember(trial, proposal)
        values = proposal.config.canonical()  # a trial holds every parameter, a path's unused ones neutral
        return {n: values[n] for n in search_space if n in values}

    def _param_rows(self, config: Config, trial: FrozenTrial) -> list[tuple[str, float, str]]:
        """``config``'s parameters the trial does not hold, as the claim writes them (every
        parameter: a path's unused ones at their neutral values)."""
        values = config.canonical()
        return [(name, self._distributions[name].to_internal_repr(values[name]), self._param_json[name])
                for name in self._names if name in values and name not in trial.params]

    def params_stored(self, trial: FrozenTrial | optuna.trial.BaseTrial) -> bool:
        """Whether the claim wrote ``trial``'s parameters (``claim_params``)."""
        return internals.trial_id(trial) in self._stored

    def proposal_for(self, trial: FrozenTrial | optuna.trial.BaseTrial) -> Proposal | None:
        """What this sampler proposed to ``trial`` (None for an enqueued or retried trial)."""
        return self._proposals.get(internals.trial_id(trial))

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        proposal = self._proposals.get(internals.trial_id(trial))
        config = proposal.config.canonical() if proposal is not None else None
        if config is not None and param_name in config:
            value = config[param_name]
            try:
                if internals.distribution_contains(param_distribution, param_distribution.to_internal_repr(value)):
                    return value
            except (ValueError, TypeError):
                pass
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def reseed_rng(self) -> None:
        self._base_seed = random.SystemRandom().getrandbits(64)
        self._fallback.reseed_rng()

    # -- internals ----------------------------------------------------------------------
    def _claim(self, study: Study, trial: FrozenTrial, proposal: Proposal) -> None:
        internals.storage(study).set_trial_system_attr(internals.trial_id(trial), CLAIM_KEY, proposal.to_attr())

    def _taken_meanwhile(self, study: Study, trial: FrozenTrial, config: Config, history: History) -> bool:
        """Whether another trial, new or pending since ``history`` was read, holds ``config``."""
        trials = internals.storage(study).get_all_trials(internals.study_id(study), deepcopy=False)
        return any(
            internals.trial_id(t) not in history.known
            and t.number != trial.number
            and trial_config(t, self._names, self.space) == config
            for t in trials
        )

    def _remember(self, trial: FrozenTrial, proposal: Proposal) -> None:
        self._proposals[internals.trial_id(trial)] = proposal
        while len(self._proposals) > 256:
            oldest = next(iter(self._proposals))
            del self._proposals[oldest]
            self._stored.discard(oldest)
