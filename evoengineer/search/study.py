"""The study's storage as several searches share it: SQLite tuned for many small commits,
heartbeats of running trials, and re-queuing the trials of a search that died.

A search records a heartbeat for each of its running trials every ``heartbeat_s`` seconds
(RDB storages). A running trial whose heartbeat is older than ``GRACE_BEATS`` intervals
belongs to a dead search (killed, host lost): the first search to notice fails it and
re-queues it exactly once (Optuna's ``RetryHeartbeatStaleTrialCallback``), and whichever
search asks next evaluates it in the dead trial's budget slot.
"""
from __future__ import annotations

import copy
import inspect
import os
import signal
import threading
import time
import warnings
from typing import Any

import optuna
import sqlalchemy
import sqlalchemy.exc

from . import optuna_internals as internals
from .ledger import Ledger

DEFAULT_HEARTBEAT_S = 10
GRACE_BEATS = 4
MAX_RETRIES = 3
"""A trial whose search died this many times running it is not re-queued again."""

warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def retry_callback() -> Any:
    """Optuna's callback that re-queues a stale trial (named RetryFailedTrialCallback before 4.9)."""
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(max_retry=MAX_RETRIES)


def make_storage(url: str, heartbeat_s: int | None = DEFAULT_HEARTBEAT_S) -> optuna.storages.RDBStorage:
    """An RDB storage for ``url`` with heartbeats every ``heartbeat_s`` seconds (None: none).

    SQLite runs in WAL mode with ``synchronous=NORMAL``: readers do not block the writer and
    a commit does not wait for the disk, which a killed process cannot lose (a power cut
    can lose the last commits). WAL needs the processes on one host: searches on several
    hosts share a PostgreSQL (or MySQL) study instead.
    """
    sqlite = url.startswith("sqlite")
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if sqlite else {"pool_pre_ping": True}
    kwargs: dict[str, Any] = {}
    if heartbeat_s:
        params = inspect.signature(optuna.storages.RDBStorage).parameters
        name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
        kwargs = {"heartbeat_interval": int(heartbeat_s), "grace_period": int(GRACE_BEATS * heartbeat_s), name: retry_callback()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
    if sqlite and ":memory:" not in url:
        _tune_sqlite(storage)
    return storage


def prepare_storage(url: str, attempts: int = 4) -> None:
    """Make the storage's tables, if they are not there yet, ahead of the studies: searches
    that start together on a new database race to make them and the loser retries, so this is
    done before a search's slow start (its GPU workers, SDPA's timing) rather than after it.
    Best effort: a storage that cannot be reached is reported when the studies open."""
    for attempt in range(attempts):
        try:
            make_storage(url, heartbeat_s=None).engine.dispose()
            return
        except sqlalchemy.exc.SQLAlchemyError:
            time.sleep(0.2 * (attempt + 1))


def _tune_sqlite(storage: optuna.storages.RDBStorage) -> None:
    try:
        with storage.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    except sqlalchemy.exc.OperationalError:  # another process holds a lock: it set WAL already, or will
        pass

    @sqlalchemy.event.listens_for(storage.engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    storage.engine.dispose()  # later connections get the pragma


def heartbeat_enabled(study: optuna.Study) -> bool:
    storage = internals.storage(study)
    return callable(getattr(storage, "get_heartbeat_interval", None)) and storage.get_heartbeat_interval() is not None


def heartbeat_interval(study: optuna.Study) -> float | None:
    return float(internals.storage(study).get_heartbeat_interval()) if heartbeat_enabled(study) else None


class Heartbeat:
    """Records a heartbeat for each running trial of this search, from its own thread: a new
    trial's first one as soon as it is added (the search's thread does not wait for the write),
    then every trial's every ``interval`` seconds."""

    def __init__(self, study: optuna.Study) -> None:
        self.storage = internals.storage(study)
        self.interval = heartbeat_interval(study)
        self._ids: set[int] = set()
        self._new: set[int] = set()  # added, first beat not written yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    def add(self, trial_id: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._ids.add(trial_id)
            self._new.add(trial_id)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="evoengineer-heartbeat", daemon=True)
            self._thread.start()
        self._wake.set()

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)
            self._new.discard(trial_id)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        assert self.interval is not None
        due = time.monotonic() + self.interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                first, self._new = sorted(self._new), set()
            for trial_id in first:
                self._beat(trial_id)
            if time.monotonic() >= due:
                due = time.monotonic() + self.interval
                with self._lock:
                    ids = sorted(self._ids)
                for trial_id in ids:
                    self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception:  # noqa: BLE001 - a missed beat is retried next interval; grace covers several
            pass


def waiting(study: optuna.Study) -> bool:
    """Whether the study holds a waiting trial (a retry, an enqueued configuration)."""
    return bool(trial_ids(study, optuna.trial.TrialState.WAITING, limit=1))


def trial_ids(study: optuna.Study, state: optuna.trial.TrialState, limit: int | None = None) -> list[int]:
    """Ids of the study's trials in ``state`` (at most ``limit``): one small query on an RDB
    storage, where Optuna's read of a study's trials reads every one it does not hold finished
    whole (all of them, for a search whose trials it never saw finish)."""
    rdb = internals.rdb_backend(study)
    if rdb is None:
        return [internals.trial_id(t) for t in study.get_trials(deepcopy=False, states=(state,))][:limit]
    model = internals.trial_models().TrialModel
    session = internals.session(rdb)
    try:
        query = session.query(model.trial_id).filter(model.study_id == internals.study_id(study), model.state == state)
        return [row.trial_id for row in (query.limit(limit) if limit is not None else query)]
    finally:
        session.close()


def requeue(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
    """Queue a retry of a failed (dead) trial with its parameters; the retry records which
    trials it retries (``retry_history``), so it takes over their budget slot. A trial
    retried ``MAX_RETRIES`` times already gets no retry: its slot is freed instead."""
    callback = getattr(internals.storage(study), "get_heartbeat_stale_trial_callback", lambda: None)() or retry_callback()
    callback(study, copy.deepcopy(frozen))
    if not _retried(study, frozen.number):
        ledger = Ledger(study)
        for index, holder in ledger.slots().items():
            if holder == frozen.number:
                ledger.release_slot(index)


def _retried(study: optuna.Study, number: int) -> bool:
    """Whether a retry of trial ``number`` exists (queued, running or finished)."""
    return any(number in (t.system_attrs.get("retry_history") or []) for t in study.get_trials(deepcopy=False))


def finish_requeues(study: optuna.Study, ledger: Ledger, by: str) -> int:
    """Finish the re-queues ``by`` began and a kill cut short: a trial marked ``requeued`` by
    ``by`` with no retry is failed if it still runs, then re-queued (or its slot freed).
    Returns how many were finished."""
    done = 0
    for number, entry in ledger.entries("requeued:").items():
        if not isinstance(entry, dict) or entry.get("by") != by or not number.isdigit() or _retried(study, int(number)):
            continue
        frozen = next((t for t in study.get_trials(deepcopy=False) if t.number == int(number)), None)
        if frozen is None:
            continue
        storage, trial_id = internals.storage(study), internals.trial_id(frozen)
        if frozen.state == optuna.trial.TrialState.RUNNING:
            try:
                storage.set_trial_user_attr(trial_id, "status", "interrupted")
                storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
        frozen = storage.get_trial(trial_id)
        if frozen.state != optuna.trial.TrialState.FAIL or frozen.user_attrs.get("status") not in (None, "interrupted"):
            continue  # its search told it after all: its result holds the slot
        requeue(study, frozen)
        done += 1
    return done


CRASH_AT = "EVOENGINEER_CRASH_AT"
"""Fault injection for tests: the process kills itself (SIGKILL) at the ``crash_point`` of
this name, so that a test can land a kill exactly between two steps of a recovery."""


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_AT) == name:
        os.kill(os.getpid(), signal.SIGKILL)


# -- the run's study: identity, and what its errors mean ---------------------------------------

RUN_ATTR = "evoengineer:run:"
"""Study user attribute ``evoengineer:run:<run id>`` -> the run's name: the runs recorded in
this study (one, or several searches sharing it); run.json holds the same id."""


def link_run(study: optuna.Study, run_id: str, run_name: str) -> None:
    """Record in the study that the run ``run_id`` writes to it."""
    if study.user_attrs.get(RUN_ATTR + run_id) != run_name:
        study.set_user_attr(RUN_ATTR + run_id, run_name)


def study_problem(url: str, study_name: str, run_id: str | None, sqlite_file: Any, recorded: int, linked: bool) -> str:
    """Why the run ``run_id`` cannot resume on ``study_name`` in ``url`` ('' when it can):
    the study is missing or empty while the run has ``recorded`` evaluations (or had linked
    a study), or the study names other runs and not this one. Opens nothing it would create."""
    where = str(sqlite_file) if sqlite_file is not None else url
    lost = f"resuming would repeat its {recorded} recorded evaluation(s)" if recorded else "its study is lost"
    if sqlite_file is not None and not sqlite_file.exists():
        if not recorded and not linked:
            return ""
        return f"the run's study {where} is missing: {lost}; restore the file, or start a new run"
    storage = make_storage(url, None)
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        if not recorded and not linked:
            return ""
        return f"{where} holds no study {study_name!r}: {lost}; give the run's --storage, or start a new run"
    trials = storage.get_all_trials(study_id, deepcopy=False)
    runs = {k[len(RUN_ATTR):]: v for k, v in storage.get_study_user_attrs(study_id).items() if k.startswith(RUN_ATTR)}
    if run_id and runs and run_id not in runs:
        others = ", ".join(sorted(str(v) for v in runs.values()))[:120]
        return f"the study {study_name!r} in {where} belongs to another run ({others}), not this one; start a new run"
    if not trials and recorded:
        return f"the study {study_name!r} in {where} is empty: {lost}; restore it, or start a new run"
    return ""


def storage_error(exc: BaseException) -> str:
    """A storage failure in words (the database's own message, found under Optuna's and
    SQLAlchemy's wrappers), with what to do for a full disk or a read-only file; '' when
    ``exc`` is no storage failure."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    if not any(isinstance(e, (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)) for e in chain):
        return ""
    orig = next((e.orig for e in chain if isinstance(e, sqlalchemy.exc.DBAPIError) and e.orig is not None), None)
    text = str(orig if orig is not None else chain[-1]).strip().splitlines()
    message = text[0] if text else type(chain[-1]).__name__
    lower = message.lower()
    if "disk is full" in lower or "no space" in lower:
        message += " (the disk is full: free space, then --resume continues the run)"
    elif "readonly" in lower or "read-only" in lower or "unable to open" in lower:
        message += " (the study's file or its directory is not writable)"
    elif "not a database" in lower or "malformed" in lower:
        message += " (the study's file is damaged)"
    return message[:400]


def requeue_stale(study: optuna.Study, ledger: Ledger, by: str, silent: list[int] = ()) -> int:
    """Fail and re-queue, once across all searches, every running trial whose heartbeat went
    stale (its search died), and the trials in ``silent`` (running, and without a heartbeat
    for a grace period: their search died before the first one). Returns how many this
    search re-queued."""
    if not heartbeat_enabled(study):
        return 0
    storage = internals.storage(study)
    done = 0
    for trial_id in [*internals.stale_trial_ids(study), *silent]:
        frozen = storage.get_trial(trial_id)
        if frozen.state != optuna.trial.TrialState.RUNNING or not ledger.mark_requeued(frozen.number, by):
            continue  # finished, or another search is on it
        try:
            storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # its search told it after all
        requeue(study, storage.get_trial(trial_id))
        done += 1
    return done


# -- batched writes ------------------------------------------------------------------------
# Optuna writes each parameter and attribute of a trial in its own transaction, each looking
# the trial up again: an evaluation took some twenty commits. On an RDB storage the search
# loop writes a trial's parameters in one transaction and its result (attributes, value,
# state) in another, with Optuna's own table models; other storages take the
# one-call-per-item path.


def _batching(study: optuna.Study) -> optuna.storages.RDBStorage | None:
    rdb = internals.rdb_backend(study)
    return rdb if rdb is not None and hasattr(rdb, "scoped_session") and hasattr(rdb, "check_trial_is_updatable") else None


def store_params(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any],
                 distributions: dict[str, optuna.distributions.BaseDistribution]) -> None:
    """Set the parameters of a running trial that it does not hold yet, all at once (as
    ``suggest`` would, one by one)."""
    rdb = _batching(study)
    if rdb is None:
        for name in params:
            internals.suggest(trial, name, distributions[name])
        return
    from optuna.distributions import distribution_to_json

    models, trial_id = internals.trial_models(), internals.trial_id(trial)
    with internals.transaction(rdb) as session:
        row = models.TrialModel.find_or_raise_by_id(trial_id, session)
        rdb.check_trial_is_updatable(trial_id, row.state)
        have = {p.param_name for p in session.query(models.TrialParamModel).filter(models.TrialParamModel.trial_id == trial_id)}
        session.add_all([
            models.TrialParamModel(trial_id=trial_id, param_name=name, param_value=distributions[name].to_internal_repr(value),
                                   distribution_json=distribution_to_json(distributions[name]))
            for name, value in params.items() if name not in have
        ])


def create_running_trial(study: optuna.Study, user_attrs: dict[str, Any]) -> int:
    """A new running trial holding ``user_attrs``, numbered as Optuna numbers them; its id. On an
    RDB storage one transaction of table inserts (Optuna's ``create_new_trial`` does the same
    through its ORM: ~5 ms of CPU a trial). Optuna's cache of the study learns of the trial as
    of one another process created, so that a sampler suggesting parameter by parameter (which
    writes through that cache) gets its trials from ``create_new_trial``."""
    made = _create_running(study, user_attrs)
    return made if isinstance(made, int) else internals.trial_id(made)


def running_trial(study: optuna.Study, user_attrs: dict[str, Any]) -> optuna.Trial:
    """``create_running_trial`` as an ``optuna.Trial``: on an RDB storage made from what was
    written (no read of the trial back, ~3 ms of CPU a trial)."""
    made = _create_running(study, user_attrs)
    return optuna.Trial(study, made) if isinstance(made, int) else internals.trial_of(study, made)


def _create_running(study: optuna.Study, user_attrs: dict[str, Any]) -> "int | optuna.trial.FrozenTrial":
    """The new trial's id (a storage other than RDB), else its snapshot as written."""
    storage, study_id = internals.storage(study), internals.study_id(study)
    rdb = _batching(study)
    if rdb is None:
        template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, user_attrs=user_attrs)
        return storage.create_new_trial(study_id, template_trial=template)
    import json
    from datetime import datetime

    models = internals.trial_models()
    trials, studies = models.TrialModel.__table__, models.StudyModel.__table__
    started = datetime.now()
    with internals.transaction(rdb) as session:
        # the study's row locked first, as Optuna does: trial numbers are counts of the trials before
        session.execute(sqlalchemy.select(studies.c.study_id).where(studies.c.study_id == study_id).with_for_update())
        # numbered in the insert: with the study locked, the trials before it are the study's trials
        before = sqlalchemy.select(sqlalchemy.literal(study_id, trials.c.study_id.type),
                                   sqlalchemy.func.count(trials.c.trial_id),
                                   sqlalchemy.literal(optuna.trial.TrialState.RUNNING, trials.c.state.type),
                                   sqlalchemy.literal(started, trials.c.datetime_start.type)
                                   ).where(trials.c.study_id == study_id)
        trial_id, number = session.execute(sqlalchemy.insert(trials).from_select(
            ["study_id", "number", "state", "datetime_start"], before).returning(trials.c.trial_id, trials.c.number)).one()
        if user_attrs:
            session.execute(sqlalchemy.insert(models.TrialUserAttributeModel.__table__), [
                {"trial_id": trial_id, "key": key, "value_json": json.dumps(value)} for key, value in user_attrs.items()])
    return optuna.trial.FrozenTrial(
        number=int(number), state=optuna.trial.TrialState.RUNNING, value=None, datetime_start=started,
        datetime_complete=None, params={}, distributions={}, user_attrs=json.loads(json.dumps(user_attrs)),
        system_attrs={}, intermediate_values={}, trial_id=int(trial_id))


def finish_trial(study: optuna.Study, trial: optuna.Trial, state: optuna.trial.TrialState, value: float | None,
                 user_attrs: dict[str, Any], unless: str | None = None) -> bool:
    """Write a trial's user attributes, value and final state in one transaction; raises
    ``UpdateFinishedTrialError`` if the trial is finished already. With ``unless`` (a study
    system attribute's key), write nothing and return False when the study holds it, read in
    the same transaction."""
    rdb = _batching(study)
    if unless is not None and rdb is None and internals.storage(study).get_study_system_attrs(
            internals.study_id(study)).get(unless) is not None:
        return False
    if rdb is None:
        for key, item in user_attrs.items():
            trial.set_user_attr(key, item)
        if state == optuna.trial.TrialState.COMPLETE:
            study.tell(trial, value)
        else:
            study.tell(trial, state=state)
        return True
    import json
    from datetime import datetime

    models, trial_id = internals.trial_models(), internals.trial_id(trial)
    attr = models.TrialUserAttributeModel
    with internals.transaction(rdb) as session:
        if unless is not None:
            entry = internals.study_attribute_model()
            if session.query(entry.study_system_attribute_id).filter(entry.study_id == internals.study_id(study),
                                                              entry.key == unless).first() is not None:
                return False
        row = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
        rdb.check_trial_is_updatable(trial_id, row.state)
        have = {a.key: a for a in session.query(attr).filter(attr.trial_id == trial_id)}
        for key, item in user_attrs.items():
            if key in have:
                have[key].value_json = json.dumps(item)
            else:
                session.add(attr(trial_id=trial_id, key=key, value_json=json.dumps(item)))
        if value is not None:
            stored, kind = models.TrialValueModel.value_to_stored_repr(value)
            session.add(models.TrialValueModel(trial_id=trial_id, objective=0, value=stored, value_type=kind))
        row.state = state
        row.datetime_complete = datetime.now()
    return True
