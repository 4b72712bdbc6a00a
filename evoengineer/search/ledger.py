"""A study's ledger: race-free claims that every search sharing the study sees alike.

Each entry is a study system attribute. An RDB storage (SQLite, PostgreSQL, MySQL) keeps
those under a unique (study, key) constraint, so inserting a key either creates it or fails
for everybody but one inserter, whatever the isolation level: a compare-and-set across
processes and hosts. In-memory storages live in one process, where a lock does the same.

What the search keeps here (``evoengineer:`` keys):

* ``slot:<i>`` -> ``{"trial": number}``: the budget. An evaluation takes one of the slots
  ``0 .. budget-1`` before it starts; a retry of a dead worker's trial takes over its slot.
* ``config:<hash>`` -> ``{"trial": number}``: a configuration is proposed to one trial only.
* ``owner:<number>``: the one search that runs a trial taken from the queue.
* ``requeued:<number>``: the one search that re-queues a dead worker's trial.

A search killed between claiming a configuration and storing it in its trial leaves that
configuration claimed and unevaluated (its retry proposes another one): the budget is still
met, with one candidate fewer to choose from.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Sequence

import optuna
import sqlalchemy
import sqlalchemy.exc

from . import optuna_internals as internals

PREFIX = "evoengineer:"
_RETRIES = 8


class _Taken(Exception):
    """Another holder has the entry (raised inside a transaction, which is then rolled back)."""



class Ledger:
    """Insert-if-absent entries of one study (see the module's docstring)."""

    _local_locks: dict[int, threading.Lock] = {}

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self._storage = internals.storage(study)
        self._study_id = internals.study_id(study)
        self._rdb = internals.rdb_backend(study)
        self.free_after = 0
        self._low: int | None = None  # every slot below it was seen taken (``take_slot``; None: not read yet)
        self._above: set[int] = set()  # the slots from ``_low`` on seen taken
        key = id(self._storage)
        self._lock = Ledger._local_locks.setdefault(key, threading.Lock())

    @property
    def atomic(self) -> bool:
        """Whether ``insert`` is a compare-and-set for every process on the storage (RDB),
        or at least within this process (in-memory storage)."""
        return self._rdb is not None or isinstance(self._storage, optuna.storages.InMemoryStorage)

    # -- entries --------------------------------------------------------------------
    def insert(self, key: str, value: Any) -> bool:
        """Create ``key`` with ``value``; False if it exists already."""
        key = PREFIX + key
        if self._rdb is None:
            with self._lock:
                if self._storage.get_study_system_attrs(self._study_id).get(key) is not None:
                    return False
                self._storage.set_study_system_attr(self._study_id, key, value)
                return True
        model = internals.study_attribute_model()

        def add(session: Any) -> None:
            session.execute(sqlalchemy.insert(model.__table__).values(study_id=self._study_id, key=key,
                                                                      value_json=json.dumps(value)))

        try:
            self._session(add)
        except sqlalchemy.exc.IntegrityError:
            return False
        return True

    def put(self, key: str, value: Any) -> None:
        """Create or overwrite ``key`` (for entries only their holder writes)."""
        self._storage.set_study_system_attr(self._study_id, PREFIX + key, value)

    def delete(self, key: str) -> None:
        key = PREFIX + key
        if self._rdb is None:
            with self._lock:
                self._storage.set_study_system_attr(self._study_id, key, None)
            return
        model = internals.study_attribute_model()
        self._session(lambda s: s.query(model).filter(model.study_id == self._study_id, model.key == key).delete())

    def entries(self, prefix: str) -> dict[str, Any]:
        """Every entry whose key starts with ``prefix`` (the key without the prefixes)."""
        full = PREFIX + prefix
        if self._rdb is None:
            attrs = self._storage.get_study_system_attrs(self._study_id)
            return {k[len(full):]: v for k, v in attrs.items() if k.startswith(full) and v is not None}
        model = internals.study_attribute_model()
        rows = self._session(lambda s: [(r.key, r.value_json) for r in s.query(model).filter(
            model.study_id == self._study_id, model.key.like(full.replace("_", "\\_") + "%", escape="\\"))])
        return {k[len(full):]: json.loads(v) for k, v in rows}

    def get(self, key: str) -> Any:
        """The entry ``key``, or None."""
        key = PREFIX + key
        if self._rdb is None:
            return self._storage.get_study_system_attrs(self._study_id).get(key)
        model = internals.study_attribute_model()
        rows = self._session(lambda s: [r.value_json for r in s.query(model).filter(
            model.study_id == self._study_id, model.key == key)])
        return json.loads(rows[0]) if rows else None

    def _session(self, work: Any) -> Any:
        """Run ``work(session)`` in one transaction; a locked SQLite database is retried."""
        assert self._rdb is not None
        for attempt in range(_RETRIES):
            session = internals.session(self._rdb)
            try:
                out = work(session)
                session.commit()
                return out
            except sqlalchemy.exc.IntegrityError:
                session.rollback()
                raise
            except sqlalchemy.exc.OperationalError:
                session.rollback()
                if attempt == _RETRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
            finally:
                session.close()
        raise AssertionError("unreachable")

    # -- the budget -----------------------------------------------------------------------
    def slots(self) -> dict[int, int | None]:
        """Taken budget slots: index -> the trial number holding it."""
        out = {}
        for index, value in self.entries("slot:").items():
            try:
                out[int(index)] = value.get("trial") if isinstance(value, dict) else None
            except ValueError:
                continue
        return out

    def take_slot(self, budget: int, trial_number: int) -> int | None:
        """The lowest free slot below ``budget`` for ``trial_number``; None when all are taken.
        ``free_after`` then holds how many were still free at most.

        The slots this ledger saw taken are remembered (all below a mark, and the few above it),
        so that a take is one insert, not a read of every slot nor a walk over them: an insert
        another search beat is the next slot's turn, and only when every slot looks taken are
        they read again (another search may have given one back)."""
        for fresh in (self._low is None, True):
            if fresh:
                self._low, self._above = 0, set(self.slots())
                self._seen_taken(-1)
            index = self._low
            assert index is not None
            while index < budget:
                if index in self._above:
                    index += 1
                    continue
                self._seen_taken(index)
                if self.insert(f"slot:{index}", {"trial": trial_number}):
                    self.free_after = budget - index - 1 - sum(1 for i in self._above if index < i < budget)
                    return index
                index += 1
            if fresh:
                break
        self.free_after = 0
        return None

    def _seen_taken(self, index: int) -> None:
        """Remember slot ``index`` as taken (-1: none), and move the mark past the taken ones."""
        assert self._low is not None
        if index >= self._low:
            self._above.add(index)
        while self._low in self._above:
            self._above.discard(self._low)
            self._low += 1

    def hand_over_slot(self, from_trial: int, to_trial: int) -> int | None:
        """Move ``from_trial``'s slot (a dead worker's trial) to its retry ``to_trial``."""
        for index, holder in self.slots().items():
            if holder == from_trial:
                self.put(f"slot:{index}", {"trial": to_trial})
                return index
        return None

    def release_slot(self, index: int) -> None:
        self.delete(f"slot:{index}")
        if self._low is not None:
            if index < self._low:  # those between it and the mark are still taken
                self._above.update(range(index + 1, self._low))
                self._low = index
            self._above.discard(index)

    # -- configurations and trials ----------------------------------------------------
    def claim_config(self, key: str, trial_number: int) -> bool:
        return self.insert(f"config:{key}", {"trial": trial_number})

    def claim_config_for(self, key: str, trial_number: int, trial_id: int, attr: str, value: Any,
                         params: Sequence[tuple[str, float, str]] = ()) -> tuple[bool, bool]:
        """``claim_config``, and on an RDB storage the trial's system attribute ``attr`` (which it
        must not hold yet) written in the same transaction: one commit for both. Returns whether
        the claim was won and whether the attribute was written with it. ``params`` (name,
        internal value, distribution JSON), parameters the trial does not hold yet, are written
        with the attribute."""
        if self._rdb is None:
            return self.claim_config(key, trial_number), False
        models = internals.trial_models()
        entry_model, attribute_model = internals.study_attribute_model(), models.TrialSystemAttributeModel
        entry, attribute = json.dumps({"trial": trial_number}), json.dumps(value)

        def add(session: Any) -> None:  # table inserts, not the ORM's unit of work: a proposal's critical path
            try:
                session.execute(sqlalchemy.insert(entry_model.__table__).values(
                    study_id=self._study_id, key=f"{PREFIX}config:{key}", value_json=entry))
            except sqlalchemy.exc.IntegrityError:
                raise _Taken from None
            session.execute(sqlalchemy.insert(attribute_model.__table__).values(trial_id=trial_id, key=attr, value_json=attribute))
            if params:
                session.execute(sqlalchemy.insert(models.TrialParamModel.__table__), [
                    {"trial_id": trial_id, "param_name": name, "param_value": internal, "distribution_json": distribution}
                    for name, internal, distribution in params])

        try:
            self._session(add)
        except _Taken:
            return False, False
        except sqlalchemy.exc.IntegrityError:  # the trial held the attribute after all: the claim alone
            return self.claim_config(key, trial_number), False
        return True, True

    def release_config(self, key: str) -> None:
        self.delete(f"config:{key}")

    def own_trial(self, trial_number: int, run: str) -> bool:
        """Become the one search that runs ``trial_number`` (taken from the study's queue)."""
        return self.insert(f"owner:{trial_number}", {"run": run})

    def mark_requeued(self, trial_number: int, by: str) -> bool:
        """Become the one search that re-queues the dead trial ``trial_number``."""
        return self.insert(f"requeued:{trial_number}", {"by": by})

    def requeued(self, trial_number: int) -> bool:
        return self.get(f"requeued:{trial_number}") is not None

    @staticmethod
    def requeued_key(trial_number: int) -> str:
        """The study system attribute ``mark_requeued`` creates for ``trial_number``."""
        return f"{PREFIX}requeued:{trial_number}"

    def heartbeats(self, trial_ids: list[int]) -> set[int]:
        """Which of ``trial_ids`` ever recorded a heartbeat (RDB storages only)."""
        if self._rdb is None or not trial_ids:
            return set()
        model = internals.heartbeat_model()
        return set(self._session(lambda s: [r.trial_id for r in s.query(model).filter(model.trial_id.in_(trial_ids))]))
