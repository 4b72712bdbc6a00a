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
from optuna.distributions import BaseDistribution, CategoricalDistribution
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

    def best(self, n: int) -> list[tuple[Config, float]]:
        """The ``n`` best completed configurations, best first (``complete`` is kept sorted)."""
        return self.complete[:n]


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

    On an RDB storage a read asks only for the trials from the oldest one still pending on
    (their id, number and state), then the configurations and values of those finished since
    and of the pending ones, in three small queries: its cost follows the trials under way,
    not the history (Optuna's own read loads every pending trial whole, attributes and all).
    """

    def __init__(self, names: Sequence[str], space: Space | None = None) -> None:
        self.names = tuple(names)
        self.space = space
        self._study: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self._low = 0  # every trial of a lower id is finished and folded in
        self._below = 0  # how many trials have an id below ``_low``
        self._known: set[int] = set()
        self._seen: set[Config] = set()
        self._complete: list[tuple[Config, float]] = []
        self._order: list[tuple[float, int]] = []
        self._failed: list[Config] = []

    def read(self, study: Study, exclude: int | None = None) -> History:
        ident = (id(internals.storage(study)), internals.study_id(study))
        if ident != self._study:
            self._study = ident
            self._reset()
        maximize = study.direction == StudyDirection.MAXIMIZE
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
        history = History(
            seen=set(self._seen),
            complete=list(self._complete),
            failed=list(self._failed),
            n_trials=n_trials,
            known=set(self._known),
        )
        for t in pending:
            config = trial_config(t, self.names, self.space)
            if config is not None:
                history.seen.add(config)
        return history

    def _fold(self, t: FrozenTrial, maximize: bool) -> None:
        self._fold_values(internals.trial_id(t), t.number, t.state, t.value, trial_config(t, self.names, self.space), maximize)

    def _fold_values(self, trial_id: int, number: int, state: TrialState, value: float | None,
                     config: Config | None, maximize: bool) -> None:
        self._known.add(trial_id)
        if config is None:
            return
        self._seen.add(config)
        if state == TrialState.COMPLETE and value is not None:
            key = (-value if maximize else value, number)
            at = bisect.bisect(self._order, key)
            self._order.insert(at, key)
            self._complete.insert(at, (config, value))
        elif state == TrialState.FAIL:
            self._failed.append(config)

    def _read_rdb(self, study: Study, rdb: optuna.storages.RDBStorage, exclude: int | None, maximize: bool) -> History:
        models = internals.trial_models()
        trial_model = models.TrialModel
        session = internals.session(rdb)
        try:
            rows = session.query(trial_model.trial_id, trial_model.number, trial_model.state).filter(
                trial_model.study_id == internals.study_id(study), trial_model.trial_id >= self._low).all()
            fresh = [r for r in rows if r.state.is_finished() and r.trial_id not in self._known]
            pending = [r for r in rows if not r.state.is_finished() and r.number != exclude]
            configs = self._configs(session, [r.trial_id for r in fresh + pending])
            complete = [r.trial_id for r in fresh if r.state == TrialState.COMPLETE]
            values: dict[int, float] = {}
            if complete:
                value_model = models.TrialValueModel
                for trial_id, value, kind in session.query(value_model.trial_id, value_model.value, value_model.value_type).filter(
                        value_model.trial_id.in_(complete), value_model.objective == 0):
                    values[trial_id] = value_model.stored_repr_to_value(value, kind)
            session.commit()
        finally:
            session.close()
        for r in sorted(fresh, key=lambda r: r.number):
            self._fold_values(r.trial_id, r.number, r.state, values.get(r.trial_id), configs.get(r.trial_id), maximize)
        # the watermark stays _ID_MARGIN ids behind the newest trial: a trial another process
        # created (its id taken) but had not committed yet is still read once it has
        newest = max((r.trial_id for r in rows), default=self._low - 1)
        low = min([r.trial_id for r in rows if not r.state.is_finished()] + [newest + 1 - _ID_MARGIN])
        excluded = sum(1 for r in rows if r.number == exclude)
        n_trials = self._below + len(rows) - excluded
        self._below += sum(1 for r in rows if r.trial_id < low)
        self._low = max(self._low, low)
        history = History(seen=set(self._seen), complete=list(self._complete), failed=list(self._failed),
                          n_trials=n_trials, known=set(self._known))
        history.seen.update(c for c in (configs.get(r.trial_id) for r in pending) if c is not None)
        return history

    def _configs(self, session: Any, trial_ids: list[int]) -> dict[int, Config]:
        """The configurations of trials ``trial_ids``: their parameters, else their enqueued
        values, else a sampler's claim (as ``trial_config``)."""
        if not trial_ids:
            return {}
        from optuna.distributions import json_to_distribution

        models = internals.trial_models()
        param_model, attr_model = models.TrialParamModel, models.TrialSystemAttributeModel
        values: dict[int, dict[str, Any]] = {i: {} for i in trial_ids}
        decoders: dict[str, BaseDistribution] = {}
        for trial_id, name, value, dist in session.query(param_model.trial_id, param_model.param_name, param_model.param_value,
                                                         param_model.distribution_json).filter(param_model.trial_id.in_(trial_ids)):
            if dist not in decoders:
                decoders[dist] = json_to_distribution(dist)
            values[trial_id][name] = decoders[dist].to_external_repr(value)
        attrs: dict[int, dict[str, Any]] = {}
        for trial_id, key, raw in session.query(attr_model.trial_id, attr_model.key, attr_model.value_json).filter(
                attr_model.trial_id.in_(trial_ids), attr_model.key.in_(("fixed_params", CLAIM_KEY))):
            attrs.setdefault(trial_id, {})[key] = json.loads(raw)
        out = {}
        for trial_id in trial_ids:
            claim = attrs.get(trial_id, {}).get(CLAIM_KEY)
            for found in (values[trial_id], attrs.get(trial_id, {}).get("fixed_params"),
                          claim.get("config") if isinstance(claim, dict) else None):
                if isinstance(found, dict) and all(n in found for n in self.names):
                    picked = {n: found[n] for n in self.names}
                    out[trial_id] = self.space.config(picked) if self.space is not None else Config(picked)
                    break
        return out


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
        self._queue: collections.deque[Proposal] = collections.deque()
        self._compute = threading.Lock()  # one batch computation at a time (they share the model and the rng)
        self._reading = threading.Lock()  # the history reader is not re-entrant
        self._background: threading.Thread | None = None
        self._background_runs = 0
        self.batch_stats = {"batches": 0, "proposals": 0, "seconds": 0.0, "background": 0}

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.space.name})"

    # -- the space -------------------------------------------------------------
    @property
    def valid(self) -> list[Config]:
        """Every valid configuration, in the space's enumeration order (computed once)."""
        if self._valid is None:
            valid = list(self.space.valid_configs())
            if not valid:
                raise ValueError(f"space {self.space.name!r} has no valid configuration")
            self._valid, self._valid_set = valid, frozenset(valid)
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
        label = f"{self._base_seed}:background:{self._background_runs}"
        self._background = threading.Thread(target=self._fill, args=(study, k, label),
                                            name="evoengineer-proposals", daemon=True)
        self._background.start()

    def wait_prefetch(self, timeout: float | None = None) -> None:
        """Wait for the background batch (tests, the loop's end)."""
        if self._background is not None:
            self._background.join(timeout)

    def _fill(self, study: Study, k: int, label: str) -> None:
        try:
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
            if ledger.atomic:
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
        self._claim(study, trial, proposal)
        self._remember(trial, proposal)
        values = proposal.config.canonical()  # a trial holds every parameter, a path's unused ones neutral
        return {n: values[n] for n in search_space if n in values}

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
            self._proposals.pop(next(iter(self._proposals)))
