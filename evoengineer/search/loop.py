"""The search loop: ask, compile ahead, evaluate, tell, record; budget, resume, finalists.

Only this module knows the order of the stages. Strategies are Optuna samplers over
the study; the evaluator is anything with ``evaluate(config, report) -> EvalResult``
(the GPU ``Evaluator`` or a replay of recorded results).
"""
from __future__ import annotations

import errno
import importlib
import json
import math
import multiprocessing
import os
import queue
import secrets
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import optuna
import sqlalchemy.exc

from ..gpu import STATUSES, EvalResult
from ..kernels import StaticReport, build_config_job
from ..space import Config, Space, path_component
from . import optuna_internals as internals
from .cpus import compile_plan, restrict_to
from .ledger import Ledger
from .partition import narrow_evaluator
from .strategies import make_sampler, suggest_config
from .strategies.remote import wanted as batch_process_wanted
from .study import (
    DEFAULT_HEARTBEAT_S,
    GRACE_BEATS,
    Heartbeat,
    crash_point,
    finish_requeues,
    finish_trial,
    make_storage,
    requeue,
    requeue_stale,
    running_trial,
    store_params,
    trial_ids,
    waiting,
)

RESULTS = "results.jsonl"
RUN_META = "run.json"


class CandidateEvaluator(Protocol):
    def evaluate(self, config: Config, report: StaticReport | None = None) -> EvalResult: ...


class RunFileError(Exception):
    """A run's file is missing, damaged or cannot be written (full disk, read-only
    directory). ``str()`` is one line naming the file and what is wrong."""


DEFAULT_STORAGE = "sqlite:///study.db"
"""How run.json records the run's own SQLite study: relative to the run directory, so a
moved or copied run finds its own study."""


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``path`` into a one-line ``RunFileError``."""
    try:
        yield
    except OSError as exc:
        raise RunFileError(f"{path}: cannot write: {describe_os_error(exc, run=True)}") from None


def describe_os_error(exc: OSError, run: bool = False) -> str:
    """The reason of an ``OSError`` in words, with what to do for a full disk or a read-only
    place (``run``: the place is a run directory, which --resume continues)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return f"{reason} (the disk is full{': free space, then --resume continues the run' if run else ''})"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where = "the run directory is not writable: copy the run somewhere writable to continue it" if run else \
            "a read-only file system, or no permission"
        return f"{reason} ({where})"
    return reason


@dataclass
class RunDir:
    """``runs/<date>-<space>-<id>/``: everything a search leaves behind. ``name`` is the
    run's name in its study (its directory's name when it was created; a moved or copied
    run keeps it)."""

    path: Path
    name: str = ""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.name = self.name or self.path.name

    @classmethod
    def create(cls, root: Path, space: Space) -> "RunDir":
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = root / f"{stamp}-{path_component(space.name)}-{secrets.token_hex(3)}"
        with writing(path):
            (path / "sources").mkdir(parents=True)
            (path / "space.yaml").write_text(space.source_text())
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        """An existing run, named as its run.json records."""
        run = cls(Path(path))
        recorded = run.meta().get("run_name")
        return cls(run.path, recorded) if isinstance(recorded, str) and recorded else run

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS

    def default_storage(self) -> str:
        return f"sqlite:///{(self.path / 'study.db').resolve()}"

    def storage_url(self, recorded: str | None) -> str:
        """The storage URL run.json records, a relative SQLite path taken relative to the run
        directory (the default study, which moves with the run)."""
        if not recorded:
            return self.default_storage()
        if recorded.startswith("sqlite:///") and not recorded.startswith("sqlite:////"):
            rest = recorded[len("sqlite:///"):]
            if rest and not rest.startswith(":memory:") and not rest.startswith("file:"):
                return f"sqlite:///{(self.path / rest).resolve()}"
        return recorded

    def sqlite_file(self, url: str) -> Path | None:
        """The file of a SQLite storage URL (None for other storages and in-memory SQLite)."""
        if url.startswith("sqlite:///") and ":memory:" not in url and "mode=memory" not in url:
            return Path(url[len("sqlite:///"):].split("?")[0])
        return None

    def read_json(self, name: str, default: Any = None, kind: type = dict) -> Any:
        """The JSON file ``name`` of the run (``default`` when it does not exist); a file that
        is cut, not JSON or not a ``kind`` raises ``RunFileError``."""
        path = self.path / name
        try:
            text = path.read_text()
        except FileNotFoundError:
            if default is not None:
                return default
            raise RunFileError(f"{path}: missing") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            cut = " (cut short: a kill or a full disk while it was written?)" if exc.pos >= len(text.rstrip()) else ""
            raise RunFileError(f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}{cut}") from None
        if not isinstance(data, kind):
            raise RunFileError(f"{path}: expected a JSON {'object' if kind is dict else kind.__name__}, got {type(data).__name__}")
        return data

    def meta(self) -> dict:
        return self.read_json(RUN_META)

    def write_meta(self, meta: dict) -> None:
        self.write_json(RUN_META, meta)

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.path / (name + ".tmp")
        with writing(tmp):
            with tmp.open("w") as fh:
                fh.write(json.dumps(data, indent=2))
                fh.flush()
                os.fsync(fh.fileno())  # a full disk fails here, not silently at close
            tmp.replace(self.path / name)

    def append_result(self, result: EvalResult, partition: str | None = None) -> None:
        """Append ``result``'s record, tagged with the search ``partition`` it belongs to (if any)."""
        record = result.to_json()
        if partition is not None:
            record["partition"] = partition
        with writing(self.results_path), self.results_path.open("ab+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line cut by a kill stays alone on its line
                    fh.write(b"\n")
            fh.write((json.dumps(record) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())

    def results(self) -> list[dict]:
        """The run's records; a record of the wrong shape raises ``RunFileError`` naming its line."""
        return self.read_results()[0]

    def read_results(self) -> tuple[list[dict], list[int]]:
        """(the records, the numbers of lines cut by a kill). A cut line is one that starts a
        record and does not parse; any other line that is not a record is damage."""
        path = self.results_path
        try:
            text = path.read_text()
        except FileNotFoundError:
            return [], []
        except (OSError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        out, cut = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if line.startswith("{"):
                    cut.append(number)
                    continue
                raise RunFileError(f"{path}: line {number}: not a JSON record") from None
            problem = _record_problem(record)
            if problem:
                raise RunFileError(f"{path}: line {number}: {problem}")
            out.append(record)
        return out, cut

    def save_sources(self, report: StaticReport) -> None:
        for build in report.builds:
            if build.rendered is not None:
                target = self.path / "sources" / f"{report.config.key()}-{build.variant.label()}.cu"
                with writing(target):
                    target.write_text(build.rendered.source)


def _record_problem(record: Any) -> str:
    """What is wrong with one line of results.jsonl ('' when it is a record)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for name, kind in (("key", str), ("status", str), ("config", dict)):
        if not isinstance(record.get(name), kind):
            return f"{name!r} is {_kind(record.get(name))}, expected a {kind.__name__}"
    if record["status"] not in STATUSES:
        return f"status {record['status'][:40]!r} is not one of {', '.join(STATUSES)}"
    value = record.get("objective_us")
    if record["status"] == "ok" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        return f"an ok record's 'objective_us' is {_kind(value)}, expected a finite number"
    if not isinstance(record.get("cases", []), list):
        return f"'cases' is {_kind(record.get('cases'))}, expected a list"
    if not isinstance(record.get("partition", ""), str):
        return f"'partition' is {_kind(record.get('partition'))}, expected a string"
    return ""


def _kind(value: Any) -> str:
    name = type(value).__name__
    return "missing" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


PHASES = ("strategy", "compile", "load", "gate", "timing", "ipc", "storage")
"""Where an evaluation's time goes: asking the strategy, waiting for its ahead-compiled
build, loading the module in the worker, the gate, the timing, the worker round trips'
remainder, and telling the study plus writing the record."""
DEVICE_PHASES = ("compile", "load", "gate", "timing", "ipc", "idle", "samples")
"""Phases spent on a device's lane (``idle``: the lane waited for a candidate; ``samples``: a
part of ``timing``, its samples' device time); their share is of the devices' time (wall
time times devices), the others' of the wall time."""


@dataclass
class SearchStats:
    started: float = field(default_factory=time.perf_counter)
    started_unix: float = field(default_factory=time.time)  # the same instant on the host's clock (searches compared)
    evaluated: int = 0
    gpu_busy_s: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STATUSES})
    best: EvalResult | None = None
    phases: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    devices: int = 1
    per_device: dict[str, int] = field(default_factory=dict)
    finished: float | None = None

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def add(self, result: EvalResult) -> None:
        self.evaluated += 1
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        self.gpu_busy_s += result.eval_s
        device = str(result.device if result.device is not None else 0)
        self.per_device[device] = self.per_device.get(device, 0) + 1
        if result.ok and (self.best is None or result.objective_us < self.best.objective_us):
            self.best = result

    def add_phases(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def profile(self) -> dict[str, dict[str, float]]:
        """Per phase: total seconds, mean milliseconds per evaluation, share of the wall time
        (of the devices' time for the phases spent on a device's lane)."""
        wall, n = self.elapsed_s, max(1, self.evaluated)
        out = {}
        for name, total in self.phases.items():
            span = wall * (self.devices if name in DEVICE_PHASES else 1)
            out[name] = {"total_s": round(total, 3), "mean_ms": round(1000 * total / n, 2),
                         "share": round(total / span, 4) if span else 0.0}
        return out

    def summary(self) -> dict:
        wall = self.elapsed_s
        device_s = wall * self.devices
        return {
            "evaluated": self.evaluated,
            "elapsed_s": round(wall, 1),
            "started_unix": round(self.started_unix, 3),
            "evaluations_per_minute": round(self.evaluated / (wall / 60), 2) if wall else None,
            "devices": self.devices,
            "per_device": dict(sorted(self.per_device.items())),
            "gpu_busy_share": round(self.gpu_busy_s / device_s, 3) if device_s else None,
            "overhead_ms_per_evaluation": round(1000 * (device_s - self.gpu_busy_s) / self.evaluated, 1) if self.evaluated else None,
            "counts": self.counts,
            "best": self.best.to_json() if self.best else None,
            "phases": self.profile(),
        }


def tell(study: optuna.Study, trial: optuna.Trial, result: EvalResult, unless: str | None = None) -> bool:
    """Finish ``trial`` with ``result`` (one transaction on an RDB storage); with ``unless`` (a
    study system attribute's key), nothing when the study holds it (then False)."""
    attrs = {"status": result.status, "config_key": result.key, **({"reason": result.reason[:500]} if result.reason else {})}
    timed = {c["label"]: c["time"]["median_us"] for c in result.cases if isinstance(c.get("time"), dict)
             and c["time"].get("median_us") is not None}
    if result.ok and timed:
        attrs[CASE_TIMES_KEY] = timed  # the racing table of other searches on the study reads them
    if result.ok:
        return finish_trial(study, trial, optuna.trial.TrialState.COMPLETE, result.objective_us, attrs, unless)
    return finish_trial(study, trial, optuna.trial.TrialState.FAIL, None, attrs, unless)


CASE_TIMES_KEY = "case_us"
"""The user attribute of a successful trial holding its timed cases' median µs by label."""


class RacingBests:
    """The best median per case timed by any search on a study, read into the racing table the
    lanes of this search share (``Evaluator.best_case_us``): a candidate far behind what another
    search (another process or host) has already timed is cut as early as one behind this
    search's own. Read incrementally, at most every ``interval`` seconds."""

    def __init__(self, study: optuna.Study, table: dict[str, float], interval: float = 1.0) -> None:
        self.study, self.table, self.interval = study, table, interval
        self._after = 0  # the last attribute row read (RDB storages)
        self._read = -math.inf

    def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._read < self.interval:
            return
        self._read = time.monotonic()
        self._after, bests = case_times_since(self.study, self._after)
        for label, us in bests.items():
            if us < self.table.get(label, math.inf):
                self.table[label] = us


def case_times_since(study: optuna.Study, after: int) -> tuple[int, dict[str, float]]:
    """(the last attribute row read, the best median per case label of the study's successful
    trials whose case times were written past row ``after``); without an RDB storage, every trial's."""
    bests: dict[str, float] = {}

    def fold(times: Any) -> None:
        if isinstance(times, dict):
            for label, us in times.items():
                if isinstance(us, (int, float)) and us > 0 and us < bests.get(label, math.inf):
                    bests[str(label)] = float(us)

    rdb = internals.rdb_backend(study)
    if rdb is None:
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            fold(trial.user_attrs.get(CASE_TIMES_KEY))
        return after, bests
    models = internals.trial_models()
    attr, trial = models.TrialUserAttributeModel, models.TrialModel
    with internals.transaction(rdb) as session:
        rows = (session.query(attr.trial_user_attribute_id, attr.value_json)
                .join(trial, trial.trial_id == attr.trial_id)
                .filter(trial.study_id == internals.study_id(study), attr.key == CASE_TIMES_KEY,
                        attr.trial_user_attribute_id > after)
                .order_by(attr.trial_user_attribute_id).all())
    for row_id, value in rows:
        after = max(after, row_id)
        try:
            fold(json.loads(value))
        except ValueError:
            continue
    return after, bests


def open_study(space: Space, run: RunDir, *, strategy: str, seed: int | None, storage: str | None,
               study_name: str | None, resume: bool, heartbeat_s: int | None = DEFAULT_HEARTBEAT_S) -> optuna.Study:
    """Create (or with ``resume`` load) the run's study in ``storage`` (default: SQLite in the
    run directory), with heartbeats of running trials every ``heartbeat_s`` seconds."""
    sampler = make_sampler(strategy, space, seed=seed)
    url = storage or run.default_storage()
    name = study_name or run.name
    for attempt in range(6):
        try:
            return optuna.create_study(study_name=name, storage=make_storage(url, heartbeat_s), sampler=sampler,
                                       direction="minimize", load_if_exists=resume)
        except sqlalchemy.exc.SQLAlchemyError:  # workers that start together race to create the storage's tables
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _config_of(frozen: optuna.trial.FrozenTrial, space: Space) -> Config | None:
    if not all(k in frozen.params for k in space.param_names):
        return None
    return space.config({k: frozen.params[k] for k in space.param_names})


def recover_interrupted(study: optuna.Study, run: RunDir, space: Space, partition: str | None = None) -> int:
    """After a kill: trials this run left RUNNING are told from their record if it was
    written, else failed and re-queued once (the retry keeps their budget slot); results
    told to the study but not yet written to ``results.jsonl`` are written from the study.

    Idempotent: a re-queue this run began and a kill cut short (the trial marked, or
    failed, but no retry queued) is finished first, so a kill at any point of a recovery
    loses no budget slot. ``partition``: the search partition the study belongs to (its records'
    tag)."""
    ledger = Ledger(study)
    recorded = {r["key"]: r for r in run.results() if r.get("partition") == partition}
    recovered = finish_requeues(study, ledger, run.name)
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if frozen.user_attrs.get("run", run.name) != run.name:
            continue  # another search sharing the study is evaluating it
        config = _config_of(frozen, space)
        trial = optuna.Trial(study, internals.trial_id(frozen))
        record = recorded.get(config.key()) if config is not None else None
        try:
            if record:
                tell(study, trial, EvalResult(**{k: record[k] for k in EvalResult.__dataclass_fields__ if k in record}))
            else:
                if not ledger.mark_requeued(frozen.number, run.name):
                    continue  # another search found it dead and re-queued it
                crash_point("recover:marked")
                trial.set_user_attr("status", "interrupted")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                crash_point("recover:failed")
                requeue(study, internals.storage(study).get_trial(internals.trial_id(frozen)))
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # finished by another search meanwhile
        recovered += 1
    for frozen in study.get_trials(deepcopy=False, states=_FINISHED):
        status = frozen.user_attrs.get("status")
        key = frozen.user_attrs.get("config_key")
        if frozen.user_attrs.get("run") != run.name or status not in STATUSES or key in recorded:
            continue
        config = _config_of(frozen, space)
        if config is None:
            continue
        run.append_result(EvalResult(config=config.to_dict(), key=key, status=status,
                                     reason=frozen.user_attrs.get("reason", ""), objective_us=frozen.value), partition)
        recorded[key] = {}
    return recovered


_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
_COUNTED = (*_FINISHED, optuna.trial.TrialState.RUNNING)


def counted_trials(study: optuna.Study) -> int:
    """Evaluations that count against the budget: done (with a status) or under way in any
    worker sharing the study; interrupted ones, trials of dead workers and skipped
    duplicates do not. The search loop counts budget slots instead (``Ledger``)."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=_COUNTED)
               if t.state == optuna.trial.TrialState.RUNNING or t.user_attrs.get("status") in STATUSES)


# -- the loop -----------------------------------------------------------------------------------


@dataclass
class _Build:
    """A configuration's build, one compile job per variant (so the first candidate of a
    search waits for one compile, not for all its variants in a row)."""

    config: Config
    arch: str
    futures: tuple[Future, ...]

    def result(self) -> StaticReport:
        return StaticReport(self.config, self.arch, tuple(b for f in self.futures for b in f.result().builds))

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


@dataclass
class _Candidate:
    """An asked trial on its way to a device: its configuration, build and budget slot, and the
    search (partition) that asked it."""

    trial: optuna.Trial
    config: Config
    future: _Build | None
    slot: int
    strategy_s: float
    search: "_Search | None" = None


class _Ready:
    """Candidates waiting for a lane, in the order they were asked. A lane takes the first
    whose build is done, else waits for one: a slow compile (a large kernel) does not hold
    up the candidates asked after it that are ready to run."""

    def __init__(self) -> None:
        self._items: list[_Candidate | None] = []
        self._changed = threading.Condition()

    def _notify(self, _: Any = None) -> None:
        with self._changed:
            self._changed.notify_all()

    def put(self, candidate: _Candidate | None) -> None:
        with self._changed:
            self._items.append(candidate)
            self._changed.notify_all()
        if candidate is not None and candidate.future is not None:
            for f in candidate.future.futures:
                f.add_done_callback(self._notify)

    def get(self) -> tuple[_Candidate | None, float, float]:
        """(the candidate, or None to stop; seconds waited with nothing asked; seconds waited
        for a build while candidates were asked)."""
        idle = building = 0.0
        with self._changed:
            while True:
                for i, item in enumerate(self._items):
                    if item is None or item.future is None or item.future.done():
                        return self._items.pop(i), idle, building
                asked, waited = bool(self._items), time.perf_counter()
                self._changed.wait(timeout=0.5)
                if asked:
                    building += time.perf_counter() - waited
                else:
                    idle += time.perf_counter() - waited

    def get_nowait(self) -> _Candidate | None:
        with self._changed:
            if not self._items:
                raise queue.Empty
            return self._items.pop(0)


class _Lanes:
    """One thread per evaluator (one per device): take the next built candidate, evaluate it,
    hand the result back. Nothing here touches the study."""

    def __init__(self, evaluators: Sequence[CandidateEvaluator], narrow: Callable[[Any, Space], None] | None = None) -> None:
        self.ready = _Ready()
        self.narrow = narrow  # points an evaluator at a candidate's partition (partitions searched side by side)
        self.done: queue.Queue[tuple[_Candidate, EvalResult | BaseException, StaticReport | None]] = queue.Queue()
        self.idle_s = 0.0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._lane, args=(i, ev), name=f"evoengineer-lane-{i}", daemon=True)
                        for i, ev in enumerate(evaluators)]
        for t in self.threads:
            t.start()

    def _lane(self, index: int, evaluator: CandidateEvaluator) -> None:
        device = getattr(evaluator, "device", None)
        warm = getattr(evaluator, "info", None)
        if warm is not None:
            try:
                warm()  # start the GPU worker (torch import, CUDA context) while the first candidates compile
            except Exception:  # noqa: BLE001 - a worker that cannot start fails its first evaluation, with a status
                pass
        narrowed_to: Space | None = None
        while True:
            candidate, idle_s, building_s = self.ready.get()
            with self._lock:
                self.idle_s += idle_s
            if candidate is None:
                return
            report = None
            try:
                space = candidate.search.space if candidate.search is not None else None
                if self.narrow is not None and space is not None and space is not narrowed_to:
                    self.narrow(evaluator, space)
                    narrowed_to = space
                started = time.perf_counter()
                report = candidate.future.result() if candidate.future is not None else None
                compile_s = building_s + time.perf_counter() - started
                result = evaluator.evaluate(candidate.config, report)
                result.phases = {**result.phases, "compile": round(result.phases.get("compile", 0.0) + compile_s, 4)}
                result.device = device if device is not None else index
                self.done.put((candidate, result, report))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
                self.done.put((candidate, exc, report))

    def take_back(self) -> list[_Candidate]:
        """Candidates no lane has started."""
        out = []
        while True:
            try:
                candidate = self.ready.get_nowait()
            except queue.Empty:
                return out
            if candidate is not None:
                out.append(candidate)

    def close(self, wait: bool = True) -> None:
        for _ in self.threads:
            self.ready.put(None)
        if wait:
            for t in self.threads:
                t.join(timeout=60)


class _Search:
    """The loop's state: the study, its ledger, the budget, what is under way."""

    def __init__(self, space: Space, run: RunDir, study: optuna.Study, budget: int, build: bool, arch: str,
                 partition: str | None = None) -> None:
        self.space, self.run, self.study, self.budget = space, run, study, budget
        self.partition = partition  # the search partition whose records this writes (their tag)
        self.build, self.arch = build, arch
        self.ahead: AheadBuilds | None = None  # builds submitted before the loop, for its asks to reuse
        self.ledger = Ledger(study)
        self.heartbeat = Heartbeat(study)
        self.name = run.name
        self.in_flight: dict[int, _Candidate] = {}  # trial id -> candidate
        self.taken = len(self.ledger.slots())  # budget slots taken (by any search), as this one last saw them
        self.full = self.taken >= budget  # every budget slot is taken
        self.exhausted = False  # no configuration is left to propose
        self.seen = {t.user_attrs.get("config_key") for t in study.get_trials(deepcopy=False, states=_FINISHED)
                     if t.user_attrs.get("status") in STATUSES}
        self._first_seen: dict[int, float] = {}
        self._dead_since: dict[int, float] = {}
        self.checked_stale = 0.0  # when dead searches' trials were last looked for
        self._probed = time.monotonic()
        self._repeats = 0
        self._maybe_queued = True
        self._queue_probed = -math.inf
        self._queue_seen = False
        self._distributions = {p.name: optuna.distributions.CategoricalDistribution(list(p.values)) for p in space.params}

    def _new_trial(self) -> optuna.Trial | None:
        """A queued trial (a retry, an enqueued configuration) if one is waiting, else a new
        one (created with this search's name in one transaction) unless the budget is full."""
        storage = internals.storage(self.study)
        if (self._maybe_queued or self.full) and self.queued():  # a small query before Optuna's read
            for queued in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
                waiting_id = internals.trial_id(queued)
                try:
                    if not storage.set_trial_state_values(waiting_id, state=optuna.trial.TrialState.RUNNING):
                        continue
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue
                if not self.ledger.own_trial(queued.number, self.name):
                    continue  # another search popped it at the same time (SQLite has no row locks)
                storage.set_trial_user_attr(waiting_id, "run", self.name)
                return optuna.Trial(self.study, waiting_id)
        self._maybe_queued = False
        if self.full:
            return None
        if hasattr(self.study.sampler, "claim_params"):  # a strategy that proposes whole configurations
            return running_trial(self.study, {"run": self.name})
        template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, user_attrs={"run": self.name})
        return optuna.Trial(self.study, storage.create_new_trial(internals.study_id(self.study), template_trial=template))

    def _configure(self, trial: optuna.Trial, frozen: optuna.trial.FrozenTrial) -> Config:
        """The trial's configuration: its parameters (a retry), its enqueued values, or the
        strategy's proposal; stored in one transaction."""
        names = self.space.param_names
        for values in (frozen.params, frozen.system_attrs.get("fixed_params")):
            if isinstance(values, dict) and all(n in values for n in names):
                config = self.space.config({n: values[n] for n in names})
                break
        else:
            proposed = trial.relative_params  # the strategy proposes (and claims) a whole configuration
            if not all(n in proposed for n in names):
                return suggest_config(trial, self.space)
            config = self.space.config({n: proposed[n] for n in names})
        stored = getattr(self.study.sampler, "params_stored", lambda t: False)(trial)  # with the claim
        if not stored and any(n not in frozen.params for n in names):  # every parameter, a path's unused ones neutral
            store_params(self.study, trial, config.canonical(), self._distributions)
        return config

    def ask(self, pool: ProcessPoolExecutor | None) -> _Candidate | None:
        """Ask the strategy for the next trial, take its budget slot, submit its build.
        None when no slot is free, the space is exhausted, or another search took the trial."""
        started = time.perf_counter()
        trial = self._new_trial()
        if trial is None:
            return None
        trial_id = internals.trial_id(trial)
        frozen = internals.frozen_trial(trial)
        system = frozen.system_attrs
        self.heartbeat.add(trial_id)
        slot = None
        retried = system.get("retry_history") or []
        if retried:
            slot = self.ledger.hand_over_slot(retried[-1], trial.number)
        if slot is None:
            slot = self.ledger.take_slot(self.budget, trial.number)
            self.full = self.ledger.free_after == 0  # ask no new trial for nothing
        if slot is None:
            self._drop(trial, "over budget")
            return None
        config = self._configure(trial, frozen)
        proposal = getattr(self.study.sampler, "proposal_for", lambda t: None)(trial)
        if (proposal is not None and proposal.origin == "repeat") or config.key() in self.seen:
            # every valid configuration is taken (or, for a retry, its dead trial was told after all):
            # record the repeat, never time it; a retry's slot stays taken, by the evaluation it repeats
            self._repeats += 1
            self.exhausted = (proposal is not None and proposal.origin == "repeat") or self._repeats > 16
            self._drop(trial, "duplicate", slot=None if retried else slot)
            return None
        self._repeats = 0
        self.taken += 1
        self.seen.add(config.key())
        future = None
        if self.build and pool is not None:
            future = _Build(config, self.arch, tuple(build_ahead(pool, self.space, [config], self.arch, self.ahead)))
        candidate = _Candidate(trial, config, future, slot, time.perf_counter() - started, self)
        self.in_flight[trial_id] = candidate
        return candidate

    def cancel(self, candidate: _Candidate) -> None:
        """Give back a candidate no lane started (out of time): its slot and its configuration."""
        if candidate.future is not None:
            candidate.future.cancel()
        self.in_flight.pop(internals.trial_id(candidate.trial), None)
        self.taken -= 1
        self.seen.discard(candidate.config.key())
        self.ledger.release_config(candidate.config.key())
        self._drop(candidate.trial, "cancelled", slot=candidate.slot)

    def _drop(self, trial: optuna.Trial, status: str, slot: int | None = None) -> None:
        self.heartbeat.discard(internals.trial_id(trial))
        if slot is not None:
            self.ledger.release_slot(slot)
        try:
            finish_trial(self.study, trial, optuna.trial.TrialState.PRUNED, None, {"status": status})
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    def record(self, candidate: _Candidate, result: EvalResult, report: StaticReport | None, stats: SearchStats) -> bool:
        """Tell the study, then write the record (a kill in between is repaired on resume).
        False when another search took the trial for dead meanwhile: its retry counts."""
        started = time.perf_counter()
        trial = candidate.trial
        self.in_flight.pop(internals.trial_id(trial), None)
        self.heartbeat.discard(internals.trial_id(trial))
        if report is not None:
            self.run.save_sources(report)
        # another search took the trial for dead (its heartbeats stopped) and re-queued it: read in the tell's transaction
        requeued = self.ledger.requeued_key(trial.number) if self.heartbeat.enabled else None
        try:
            if not tell(self.study, trial, result, unless=requeued):
                return False
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        result.phases = {**result.phases, "strategy": round(candidate.strategy_s, 4),
                         "storage": round(time.perf_counter() - started, 4)}
        self.run.append_result(result, self.partition)
        stats.add(result)
        stats.add_phases({**result.phases, "storage": time.perf_counter() - started})
        return True

    def may_ask(self) -> bool:
        """Whether a trial may be asked: a budget slot is free, or a retry waits in the queue."""
        if self.exhausted:
            return False
        if self.full and time.monotonic() - self._probed > (self.heartbeat.interval or 1.0):
            self._probed = time.monotonic()  # another search may have given a slot back
            self.taken = len(self.ledger.slots())
            self.full = self.taken >= self.budget
        if not self.full:
            return True
        if self._maybe_queued or time.monotonic() - self._queue_probed > QUEUE_PROBE_S:
            self._queue_probed = time.monotonic()  # while the budget is full, a retry may still come
            self._queue_seen = self.queued()
        return self._queue_seen

    def queued(self) -> bool:
        return waiting(self.study)

    def progress(self) -> float:
        """The share of its budget this search has taken: the loop asks the least advanced first."""
        return self.taken / max(1, self.budget)

    def check_stale(self, force: bool = False) -> None:
        """Re-queue dead searches' trials (at most once per heartbeat interval)."""
        interval = self.heartbeat.interval
        if interval is None or (not force and time.monotonic() - self.checked_stale < interval):
            return
        self.checked_stale = time.monotonic()
        requeue_stale(self.study, self.ledger, self.name)
        self._maybe_queued = self._maybe_queued or self.queued()

    def others_running(self) -> bool:
        """Whether another search runs a trial that may still end or be found dead: with
        heartbeats on, this search waits for those before it ends, to retry them if needed.
        A running trial that records no heartbeat for a grace period belongs to a search that
        died before its first one: it is re-queued like a stale one."""
        interval = self.heartbeat.interval
        if interval is None:
            return False
        if self.queued():
            return True
        running = [i for i in trial_ids(self.study, optuna.trial.TrialState.RUNNING) if i not in self.in_flight]
        if not running:
            return False
        beating = self.ledger.heartbeats(running)
        now, grace = time.monotonic(), GRACE_BEATS * interval
        silent = [i for i in running if i not in beating and now - self._first_seen.setdefault(i, now) > grace]
        dead = set(silent) | set(internals.stale_trial_ids(self.study))
        if dead:
            requeue_stale(self.study, self.ledger, self.name, silent)
            self._maybe_queued = True
        for trial_id in dead:
            self._dead_since.setdefault(trial_id, now)
        # a dead trial still running two grace periods on cannot be re-queued (whoever took it on
        # died too): waiting for it would never end
        return any(now - self._dead_since.get(i, now) <= 2 * grace for i in running)


@dataclass(frozen=True)
class SearchPart:
    """One partition of a search as the loop runs it: its space (narrowed to its cases), its
    study, its share of the budget and its name (``None``: a search of one part)."""

    space: Space
    study: optuna.Study
    trials: int
    name: str | None = None


def run_search(
    space: Space,
    evaluator: CandidateEvaluator | Sequence[CandidateEvaluator],
    run: RunDir,
    study: optuna.Study,
    *,
    arch: str,
    trials: int,
    partition: str | None = None,
    **options: Any,
) -> SearchStats:
    """``run_parts`` of one part: ``space`` searched in ``study`` for ``trials`` evaluations."""
    return run_parts([SearchPart(space, study, trials, partition)], evaluator, run, arch=arch, **options)


def run_parts(
    parts: Sequence[SearchPart],
    evaluator: CandidateEvaluator | Sequence[CandidateEvaluator],
    run: RunDir,
    *,
    arch: str,
    time_s: float | None = None,
    prefetch: int | None = None,
    on_result: Callable[[EvalResult, SearchStats, str | None], None] | None = None,
    compile_workers: int | None = None,
    build: bool = True,
    stats: SearchStats | None = None,
    pool: ProcessPoolExecutor | None = None,
    ahead: AheadBuilds | None = None,
) -> SearchStats:
    """Evaluate until each part's ``trials`` evaluations are recorded in its study (or time
    runs out).

    ``evaluator`` is one evaluator or one per device; each device gets a lane (a thread)
    that evaluates one candidate after another. This thread asks the strategies ahead (up
    to ``prefetch`` candidates beyond one per device), compiles them in parallel processes
    while the devices work, and tells the studies as results come back. The budget is
    counted in budget slots of each study's ledger, so every search sharing a study stops
    at exactly its ``trials`` evaluations; a configuration is never evaluated twice.

    The parts are searched side by side: each ask goes to the part that has taken the least of
    its budget, and a lane points its evaluator at each candidate's part
    (``partition.narrow_evaluator``), so that one part's long evaluations cover another's
    compiles. Each part keeps its own strategy, study and budget; its name tags its records.
    ``on_result(result, stats, part name)`` follows each recorded evaluation; ``stats``: a
    search's statistics to add to, its clock going on; ``pool``: the compile processes to use
    (``compile_pool``, started before the search; left running), else the loop starts its own;
    ``ahead``: builds submitted to ``pool`` before the search (``AheadBuilds``).
    """
    evaluators = list(evaluator) if isinstance(evaluator, (list, tuple)) else [evaluator]
    workers = compile_workers or max(1, (os.cpu_count() or 2) - 1)
    if prefetch is None:
        prefetch = workers + len(evaluators) if build else len(evaluators)
    depth = len(evaluators) + max(0, prefetch)
    searches = []
    for part in parts:
        valid = getattr(part.study.sampler, "valid", None)  # a SpaceSampler enumerates the space once, before the clock starts
        budget = min(part.trials, len(valid) if valid is not None else part.space.valid_size())
        searches.append(_Search(part.space, run, part.study, budget, build, arch, part.name))
        searches[-1].ahead = ahead
    if ahead is not None:
        ahead.start()
    if stats is None:
        stats = SearchStats(devices=len(evaluators))
    began = stats.elapsed_s
    stats.finished = None
    own_pool = pool is None and build
    if own_pool:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_compile_process_init)
    elif not build:
        pool = None
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, SWITCH_INTERVAL_S))
    if len(searches) > 1:
        for ev in evaluators:
            narrow_evaluator(ev, searches[0].space)
    lanes = _Lanes(evaluators, narrow=narrow_evaluator if len(searches) > 1 else None)
    proposers = [_Proposer(s.study.sampler, s.study, len(evaluators), s.name) for s in searches]
    table = getattr(evaluators[0], "best_case_us", None)  # the lanes' one racing table (GPU evaluators)
    racing = [RacingBests(s.study, table) for s in searches] if isinstance(table, dict) else []
    for bests in racing:
        bests.refresh(force=True)  # a resumed search, or others on the study, timed these cases already
    done: set[int] = set()  # indices of the searches that have finished
    failure: BaseException | None = None
    try:
        while len(done) < len(searches):
            out_of_time = time_s is not None and stats.elapsed_s - began >= time_s
            live = [i for i in range(len(searches)) if i not in done]
            stopped: set[int] = set()  # the live searches that cannot ask this round
            if out_of_time:
                for candidate in lanes.take_back():
                    candidate.search.cancel(candidate)  # type: ignore[union-attr]
                stopped = set(live)
            else:
                for i in live:
                    searches[i].check_stale()
                for bests in racing:
                    bests.refresh()
                asking = [i for i in live if searches[i].may_ask()]
                stopped = set(live) - set(asking)
                while asking and sum(len(s.in_flight) for s in searches) < depth:
                    i = min(asking, key=lambda k: (searches[k].progress(), len(searches[k].in_flight)))
                    candidate = searches[i].ask(pool)
                    if candidate is not None:
                        lanes.ready.put(candidate)
                    if candidate is None or not searches[i].may_ask():
                        # no slot, nothing new, or another search took the queued trial: next round
                        asking.remove(i)
                        stopped.add(i)
                for i in live:
                    if i not in stopped:
                        proposers[i].prefetch()
            waiting = []
            for i in live:
                search = searches[i]
                if search.in_flight or i not in stopped:
                    continue
                if out_of_time or search.exhausted or not search.others_running():
                    done.add(i)
                else:
                    waiting.append(search)  # for other searches' last trials on its study
            if not any(s.in_flight for s in searches):
                if waiting:
                    time.sleep(OTHERS_POLL_S)  # the others' last trials end within an evaluation or so
                    for search in waiting:
                        search.check_stale(force=time.monotonic() - search.checked_stale >= STALE_POLL_S)
                continue
            try:
                candidate, result, report = lanes.done.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(result, BaseException):
                failure = result
                break
            search = candidate.search
            assert search is not None
            if search.record(candidate, result, report, stats) and on_result:
                on_result(result, stats, search.partition)
    finally:
        stats.finished = time.perf_counter()
        for proposer in proposers:
            proposer.close()
        # after a failure or an interrupt, trials under way stay RUNNING: resume (or another
        # search, once their heartbeats stop) re-queues them
        lanes.close(wait=failure is None and not any(s.in_flight for s in searches))
        for search in searches:
            search.heartbeat.close()
        if own_pool and pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        sys.setswitchinterval(switch_interval)
        stats.add_phases({"idle": lanes.idle_s})
    if failure is not None:
        raise failure
    return stats


class _Proposer:
    """The strategy's proposals in batches, off the loop's thread: a sampler that computes
    them in batches (``SpaceSampler``) proposes one per device at once, and computes the
    next batch on its own thread while the devices work, so that an ask only pops one; on
    several devices with the study in an RDB storage, in a process of its own
    (``SpaceSampler.use_process``)."""

    def __init__(self, sampler: Any, study: optuna.Study, devices: int, identity: str = "") -> None:
        self.sampler, self.study, self.devices = sampler, study, max(1, devices)
        self.enabled = callable(getattr(sampler, "prefetch", None))
        if self.enabled:
            sampler.batch_size = self.devices
            sampler.identity = identity  # another search on the study, of the same seed, draws other batches
        rdb = internals.rdb_backend(study)
        if self.enabled and batch_process_wanted(self.devices) and rdb is not None and hasattr(sampler, "use_process"):
            sampler.use_process(rdb.url, study.study_name)  # off this process's interpreter lock
        if hasattr(sampler, "claim_params"):
            sampler.claim_params = True  # the ask stores the parameters with the claim: one transaction

    def prefetch(self) -> None:
        if self.enabled:
            self.sampler.prefetch(self.study, self.devices)

    def close(self) -> None:
        if self.enabled:
            self.sampler.wait_prefetch(timeout=30)
        if hasattr(self.sampler, "close_process"):
            self.sampler.close_process()
        if hasattr(self.sampler, "claim_params"):
            self.sampler.claim_params = False


COMPILE_NICENESS = 10
"""How much lower the compile processes run than the search and its GPU workers: when the
ahead-compiles fill every core, a GPU worker or the search thread waiting for a core leaves
its GPU idle."""
QUEUE_PROBE_S = 0.5
"""While every budget slot is taken, how often the loop looks for a queued trial (a retry of
another search's dead trial): a look is a query, and the loop goes round once per result."""
OTHERS_POLL_S = 0.05
"""When a search's own trials are done and others on its study still run theirs, how often it
looks whether they have ended (two small queries): it ends within this of the last one."""
STALE_POLL_S = 1.0
"""Meanwhile, how often it looks for their dead trials to re-queue (a larger query)."""
SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval during a search (Python's default is 5 ms): a
lane thread whose worker has answered waits at most this long for the search thread to let
it hand over the next job."""


def compile_pool(workers: int | None = None, devices: Sequence[int] = ()) -> ProcessPoolExecutor:
    """The search's compile processes, started now and warmed (their imports done, NVRTC loaded)
    while the GPU workers start and SDPA is timed, so that no partition's first candidates wait
    for a process to start. They run on ``cpus.compile_plan(devices)`` (the host's CPUs but
    cores kept for the GPU workers and the search), ``workers`` of them (default: one per
    CPU there, or one per CPU but one where none is kept). The caller shuts it down."""
    cpus, default = compile_plan(devices)
    workers = workers or default
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_compile_process_init, initargs=(cpus,))
    for _ in range(workers):
        pool.submit(_warm_compile_process)
    return pool


class AheadBuilds:
    """Builds submitted before the search asks for them (a strategy's opening, while the GPU
    workers start and SDPA is timed): an ask reuses a build under way instead of compiling the
    configuration again, and when the loop starts the builds not yet begun are cancelled
    (``start``), so that the candidates compile in the order they are asked and none waits
    behind an opening configuration another search on the study has taken."""

    def __init__(self) -> None:
        self._futures: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple, future: Future) -> None:
        with self._lock:
            self._futures[key] = future

    def take(self, key: tuple) -> Future | None:
        """The build of ``key`` submitted ahead, unless it was cancelled (each is taken once)."""
        with self._lock:
            future = self._futures.pop(key, None)
        return None if future is None or future.cancelled() else future

    def start(self) -> int:
        """Cancel the builds not begun; the number cancelled."""
        with self._lock:
            cancelled = [key for key, future in self._futures.items() if future.cancel()]
            for key in cancelled:
                del self._futures[key]
        return len(cancelled)


def build_ahead(pool: ProcessPoolExecutor, space: Space, configs: Sequence[Config], arch: str,
                ahead: AheadBuilds | None = None, *, keep: bool = False) -> list[Future]:
    """Submit the builds of ``configs``, one job per variant of ``space`` (a candidate's, or a
    strategy's opening while the GPU workers start and SDPA is timed: the compile cache then holds
    them when the search asks for them, so that no device waits for the first compiles). With
    ``ahead``: a build it holds is reused (``keep``: each new one is put there for a later ask)."""
    futures = []
    for config in configs:
        for variant in space.variants:
            key = (space.template, config.key(), variant, arch)
            future = ahead.take(key) if ahead is not None and not keep else None
            if future is None:
                future = pool.submit(build_config_job, (space.template, config, (variant,), arch,
                                                        space.target.smem_per_block))
                if ahead is not None and keep:
                    ahead.put(key, future)
            futures.append(future)
    return futures


def _warm_compile_process() -> None:
    """A compile process's first job: the builds' modules imported and NVRTC loaded."""
    from ..kernels.compile import nvrtc_version

    importlib.import_module("evoengineer.kernels.static")  # the builds' module, the templates' environment with it
    nvrtc_version()


def _compile_process_init(cpus: set[int] | None = None) -> None:
    """Each compile process of the search's pool: below the search in CPU priority, on ``cpus``."""
    try:
        os.nice(COMPILE_NICENESS)
    except OSError:  # not permitted: same priority, as before
        pass
    restrict_to(cpus)


def check_records(run: RunDir) -> str:
    """Check results.jsonl against the run's study before a command answers from it: a
    disagreement (a search killed between telling the study and writing the record, a
    record the study never saw) or a damaged study raises ``RunFileError``; where the
    study cannot be consulted (gone, unreachable) the answer is a note saying so ('' when
    the two agree)."""
    from collections import Counter

    from .study import storage_error

    meta = run.meta()
    records, cut = run.read_results()
    url = run.storage_url(meta.get("storage") if isinstance(meta.get("storage"), str) else None)
    name = meta.get("study_name") if isinstance(meta.get("study_name"), str) else run.name
    file = run.sqlite_file(url)
    results = run.results_path
    last_cut = bool(cut) and results.read_text().rstrip("\n").count("\n") + 1 == cut[-1]
    if file is not None and not file.exists():
        if last_cut:
            raise RunFileError(f"{results}: its last line is cut (a search killed while writing it) and the run's study "
                               f"{file} is missing: its records are incomplete")
        if not meta.get("study_linked"):  # a run that never recorded its study's link (an older one)
            return ""
        return f"note: the run's study {file} is missing; {results.name} was not checked against it"
    if file is not None and not os.access(file.parent, os.W_OK) and not file.with_name(file.name + "-wal").exists():
        url = f"sqlite:///file:{file}?mode=ro&immutable=1&uri=true"  # a read-only run: SQLite may not even create its lock file
    studies = [(name, None)]  # (study name, the partition whose records it holds)
    if isinstance(meta.get("partitions"), list):
        studies = [(p["study"], p["name"]) for p in meta["partitions"]
                   if isinstance(p, dict) and isinstance(p.get("study"), str) and isinstance(p.get("name"), str)]
    trials: list[tuple[str | None, optuna.trial.FrozenTrial]] = []
    try:
        storage = make_storage(url, None)
        for name, partition in studies:
            study_id = storage.get_study_id_from_name(name)
            trials += [(partition, t) for t in storage.get_all_trials(study_id, deepcopy=False, states=_FINISHED)]
    except KeyError:
        return f"note: {file or url} holds no study {name!r}; {results.name} was not checked against it"
    except Exception as exc:  # noqa: BLE001 - a storage failure in words, or a bug raised as is
        message = storage_error(exc)
        if not message:
            raise
        if file is not None and "damaged" in message:
            raise RunFileError(f"{file}: {message}") from None
        return f"note: could not read the study {name!r} ({message}); {results.name} was not checked against it"
    in_study = Counter((partition, t.user_attrs.get("config_key")) for partition, t in trials
                       if t.user_attrs.get("run", run.name) == run.name and t.user_attrs.get("status") in STATUSES)
    in_file = Counter((r.get("partition"), r["key"]) for r in records)
    missing, extra = sum((in_study - in_file).values()), sum((in_file - in_study).values())
    resume = f"`evoengineer search --space {run.path / 'space.yaml'} --resume --run-dir {run.path}`"
    if missing:
        raise RunFileError(f"{results}: lacks {missing} of the {sum(in_study.values())} evaluations its study holds (a search "
                           f"killed between the two, or one still running); {resume} writes them")
    if extra:
        raise RunFileError(f"{results}: holds {extra} record(s) its study {name!r} does not; the study is not this run's, "
                           "or lost evaluations")
    return ""


def best_results(run: RunDir, top_k: int, partition: str | None = None) -> list[dict]:
    """The ``top_k`` fastest ok records of a run, one per configuration (of one search
    ``partition``: its objective is a geometric mean over that partition's cases only)."""
    best: dict[str, dict] = {}
    for r in run.results():
        if partition is not None and r.get("partition") != partition:
            continue
        if r["status"] == "ok" and (r["key"] not in best or r["objective_us"] < best[r["key"]]["objective_us"]):
            best[r["key"]] = r
    return sorted(best.values(), key=lambda r: r["objective_us"])[:top_k]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan
