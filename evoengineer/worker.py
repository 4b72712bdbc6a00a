"""Crash-isolating evaluation workers: one child process per GPU, supervised by the parent.

Evaluating a CUDA kernel can hit an illegal memory access (which poisons the CUDA
context of its process for good), a launch failure, an endless loop or a segfault.
Each of these must cost one candidate, never the search. So every evaluation runs
in a child process (``multiprocessing`` *spawn* context) bound to one GPU, and the
parent turns whatever happens to it into a :class:`WorkerOutcome`:

* ``ok``: the handler returned; ``value`` holds its (picklable) return value.
* ``crashed``: the handler raised, or the child died (signal, ``os._exit``,
  abort), or its answer could not be pickled. ``message`` says how, followed by
  the tail of the child's stderr (fd 2 of the child goes to a temp file, so
  messages written by native code and ``faulthandler`` tracebacks are kept).
* ``timeout``: no answer within the time limit; the child is dumped
  (``faulthandler`` on SIGUSR1), sent SIGTERM, then SIGKILL after a short grace.

After anything but ``ok`` the child is replaced, since its state is suspect. An
``ok`` value carrying a truthy ``worker_must_restart`` attribute or mapping key
(for instance a sticky CUDA error was seen) is delivered, and the child is
replaced before the next job.

Handlers are named ``"package.module:function"`` (``"module:Class.method"`` also
works) and imported by the child itself. The child starts with the parent's
``sys.path`` and working directory as they are when it starts (the spawn context
copies both), so any module importable in the parent at that time is importable
in the child; put a directory on ``sys.path`` (or ``PYTHONPATH``) before the
worker starts to make handlers living there reachable. As with any spawn-based
``multiprocessing``, a script that starts workers must guard its entry point with
``if __name__ == "__main__":``.

``device`` binds the child to one GPU: ``CUDA_VISIBLE_DEVICES`` is in the
environment the child's interpreter is started with (the parent sets it around
the spawn, under a lock, and restores its own environment right after), so it is
in place before the child imports anything; the child sets it again on entry.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["WorkerOutcome", "Worker", "WorkerPool", "resolve_callable"]

STDERR_TAIL_LINES = 20
TRACEBACK_TAIL_LINES = 15
_STDERR_TAIL_BYTES = 64 * 1024
_WATCHDOG_PERIOD_S = 1.0

_CTX = multiprocessing.get_context("spawn")
_SPAWN_LOCK = threading.Lock()
_LIVE_WORKERS: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@dataclass(frozen=True)
class WorkerOutcome:
    """What became of one job sent to a worker."""

    status: str  # "ok" | "crashed" | "timeout"
    value: Any = None
    message: str = ""
    elapsed_s: float = 0.0
    pid: int | None = None  # the child that ran (or died running) the job

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class _ChildSpec:
    """Everything the child needs, sent to it at spawn."""

    handler: str
    init: str | None
    init_args: tuple
    env: dict[str, str]
    stderr_path: str
    parent_pid: int


# --------------------------------------------------------------------------- child side


def resolve_callable(name: str) -> Callable[..., Any]:
    """Import ``"package.module:attr.path"`` (or ``"package.module.attr"``) and return it."""
    if ":" in name:
        module_name, _, attr_path = name.partition(":")
    else:
        module_name, _, attr_path = name.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"expected 'package.module:function', got {name!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{name!r} is not callable")
    return obj


def _format_exception(exc: BaseException) -> str:
    """``Type: text`` followed by the tail of the traceback."""
    head = f"{type(exc).__qualname__}: {exc}"
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    tail = "\n".join(lines[-TRACEBACK_TAIL_LINES:])
    return f"{head}\n{tail}"


def _watch_parent(parent_pid: int) -> None:
    """Exit the child when its parent is gone, so no orphan outlives the search."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while True:
        time.sleep(_WATCHDOG_PERIOD_S)
        if os.getppid() != parent_pid:
            os._exit(70)


def _child_main(conn: multiprocessing.connection.Connection, spec: _ChildSpec) -> None:
    """Body of the child process: set up, run init, then answer jobs until told to stop."""
    os.environ.update(spec.env)
    try:
        sys.stderr.flush()
    except Exception:
        pass
    fd = os.open(spec.stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    if sys.stderr is None or sys.stderr.fileno() != 2:  # pragma: no cover - unusual stdio
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    # Fatal signals are delivered to the faulting thread; SIGUSR1 (the parent's "dump
    # before kill" on a timeout) reaches the main thread, since the watchdog blocks it.
    faulthandler.enable(file=sys.stderr, all_threads=False)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C means
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()

    try:
        handler = resolve_callable(spec.handler)
        if spec.init:
            resolve_callable(spec.init)(*spec.init_args)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        conn.send(("init_error", None, _format_exception(exc)))
        return
    conn.send(("ready", None, os.getpid()))

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except BaseException as exc:  # noqa: BLE001 - the job could not be unpickled
            conn.send(("error", None, f"job could not be unpickled: {_format_exception(exc)}"))
            continue
        if msg[0] == "stop":
            return
        _, seq, job = msg
        try:
            os.ftruncate(2, 0)  # the stderr tail then belongs to this job
        except OSError:
            pass
        try:
            value = handler(job)
        except BaseException as exc:  # noqa: BLE001 - reported, the parent replaces us
            answer: tuple = ("error", seq, _format_exception(exc))
        else:
            answer = ("ok", seq, value)
        _flush_stdio()
        try:
            conn.send(answer)
        except Exception as exc:  # noqa: BLE001 - pickling failed before anything was written
            conn.send(("error", seq, f"answer could not be pickled: {_format_exception(exc)}"))


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- parent side


def _describe_exit(exitcode: int | None) -> str:
    """``killed by SIGSEGV`` / ``exited with code 3``."""
    if exitcode is None:
        return "died (exit status unknown)"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _read_tail(path: str | None, lines: int = STDERR_TAIL_LINES) -> str:
    """Last ``lines`` lines of a file, or "" if it is missing or empty."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _STDERR_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:]).strip("\n")


def _with_tail(message: str, tail: str) -> str:
    if not tail:
        return message
    return f"{message}\n--- child stderr (last lines) ---\n{tail}"


def _must_restart(value: Any) -> bool:
    """Whether a handler's value asks for a fresh child (``worker_must_restart``)."""
    try:
        if isinstance(value, Mapping):
            return bool(value.get("worker_must_restart", False))
        return bool(getattr(value, "worker_must_restart", False))
    except Exception:  # noqa: BLE001 - a strange value never breaks the supervisor
        return False


@dataclass
class _Child:
    """One live child process and the parent's ends of its plumbing."""

    process: Any  # multiprocessing.context.SpawnProcess
    conn: multiprocessing.connection.Connection
    stderr_path: str
    ready: bool = False
    init_error: str = ""


class Worker:
    """One child process bound to one GPU, running `handler(job)` for each job it is sent."""

    def __init__(
        self,
        handler: str,
        *,
        device: int | None = None,
        init: str | None = None,
        init_args: tuple = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
        kill_grace_s: float = 1.0,
        restart_eagerly: bool = True,
    ) -> None:
        self.handler = handler
        self.device = device
        self.init = init
        self.init_args = tuple(init_args)
        self.env: dict[str, str] = dict(env or {})
        if device is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = str(device)
        self.start_timeout_s = start_timeout_s
        self.kill_grace_s = kill_grace_s
        self.restart_eagerly = restart_eagerly
        self._child: _Child | None = None
        self._dying: list[Any] = []
        self._restarts = 0
        self._seq = 0
        self._closed = False
        self._run_lock = threading.Lock()  # one job at a time
        self._state_lock = threading.RLock()  # guards _child, _dying, _closed
        _LIVE_WORKERS.add(self)

    # ----------------------------------------------------------------- public

    @property
    def restarts(self) -> int:
        """How many times the child was replaced."""
        return self._restarts

    @property
    def pid(self) -> int | None:
        """Pid of the current child, or None when none is running."""
        child = self._child
        return child.process.pid if child is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Spawn the child now (without waiting for its init); `run` would do it lazily."""
        with self._state_lock:
            if self._closed:
                raise RuntimeError("worker is closed")
            if self._child is None:
                self._child = self._spawn()

    def run(self, job: Any, timeout_s: float) -> WorkerOutcome:
        """Run `handler(job)` in the child, waiting up to `timeout_s` for the answer.

        A child that is not up yet is started first; its start and `init` are
        waited for separately, up to `start_timeout_s`.
        """
        with self._run_lock:
            if self._closed:
                raise RuntimeError("worker is closed")
            try:
                return self._run(job, timeout_s)
            finally:
                if self._closed:
                    self._discard_child(graceful=False)

    def close(self) -> None:
        """Stop the child (gracefully if idle, killed if busy) and reap everything; idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        if self._run_lock.acquire(blocking=False):
            try:
                self._discard_child(graceful=True)
            finally:
                self._run_lock.release()
        else:
            # A job is in flight in another thread: kill the child; that run notices
            # the death and cleans up the pipe and temp file itself.
            child = self._child
            if child is not None:
                self._kill(child.process, release=False)
        self._reap_dying(timeout=self.kill_grace_s + 1.0)
        _LIVE_WORKERS.discard(self)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter teardown
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- internals

    def _spawn(self) -> _Child:
        fd, stderr_path = tempfile.mkstemp(prefix="evoengineer-worker-", suffix=".stderr")
        os.close(fd)
        parent_conn, child_conn = _CTX.Pipe(duplex=True)
        spec = _ChildSpec(
            handler=self.handler,
            init=self.init,
            init_args=self.init_args,
            env=dict(self.env),
            stderr_path=stderr_path,
            parent_pid=os.getpid(),
        )
        process = _CTX.Process(
            target=_child_main,
            args=(child_conn, spec),
            name=f"evoengineer-worker-{self.device if self.device is not None else 'any'}",
            daemon=False,  # a daemonic child could not start processes of its own
        )
        try:
            with _SPAWN_LOCK:
                saved = {k: os.environ.get(k) for k in self.env}
                os.environ.update(self.env)
                try:
                    process.start()
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
        except BaseException:
            parent_conn.close()
            child_conn.close()
            _unlink(stderr_path)
            raise
        child_conn.close()  # so a dead child reads as EOF here
        return _Child(process=process, conn=parent_conn, stderr_path=stderr_path)

    def _await(self, child: _Child, deadline: float) -> tuple[str, Any]:
        """Wait for one message: ("msg", msg) | ("dead", None) | ("timeout", None)."""
        waitables = [child.conn, child.process.sentinel]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ("timeout", None)
            ready = multiprocessing.connection.wait(waitables, timeout=remaining)
            if not ready:
                continue
            if child.conn in ready or child.conn.poll(0):
                try:
                    return ("msg", child.conn.recv())
                except (EOFError, OSError):
                    return ("dead", None)
            return ("dead", None)

    def _death_message(self, child: _Child, prefix: str = "") -> str:
        child.process.join(timeout=self.kill_grace_s + 1.0)
        how = _describe_exit(child.process.exitcode)
        return _with_tail(prefix + how, _read_tail(child.stderr_path))

    def _ensure_ready(self) -> WorkerOutcome | None:
        """Start the child if needed and wait for its init; an outcome if that failed."""
        with self._state_lock:
            if self._child is None:
                self._child = self._spawn()
            child = self._child
        if child.ready:
            return None
        t0 = time.monotonic()
        kind, msg = self._await(child, t0 + self.start_timeout_s)
        elapsed = time.monotonic() - t0
        pid = child.process.pid
        if kind == "msg" and msg[0] == "ready":
            child.ready = True
            return None
        if kind == "msg" and msg[0] == "init_error":
            message = _with_tail(f"worker init failed: {msg[2]}", _read_tail(child.stderr_path))
            self._replace(graceful=False)
            return WorkerOutcome("crashed", message=message, elapsed_s=elapsed, pid=pid)
        if kind == "timeout":
            self._dump_stacks(child)
            tail = _read_tail(child.stderr_path)
            self._replace(graceful=False)
            message = _with_tail(f"worker did not start within {self.start_timeout_s:g} s", tail)
            return WorkerOutcome("timeout", message=message, elapsed_s=elapsed, pid=pid)
        if self._closed:
            return WorkerOutcome("crashed", message="worker was closed", elapsed_s=elapsed, pid=pid)
        message = self._death_message(child, prefix="worker died during start: ")
        self._replace(graceful=False)
        return WorkerOutcome("crashed", message=message, elapsed_s=elapsed, pid=pid)

    def _run(self, job: Any, timeout_s: float) -> WorkerOutcome:
        self._reap_dying(timeout=0)
        failed = self._ensure_ready()
        if failed is not None:
            return failed
        child = self._child
        assert child is not None
        pid = child.process.pid
        self._seq += 1
        seq = self._seq
        t0 = time.monotonic()
        try:
            child.conn.send(("job", seq, job))
        except (BrokenPipeError, EOFError, ConnectionResetError, OSError):
            message = self._death_message(child, prefix="worker died before the job was sent: ")
            self._replace(graceful=False)
            return WorkerOutcome("crashed", message=message, elapsed_s=0.0, pid=pid)
        except Exception as exc:  # noqa: BLE001 - the job itself is unpicklable
            message = f"job could not be pickled: {_format_exception(exc)}"
            return WorkerOutcome("crashed", message=message, elapsed_s=0.0, pid=pid)

        deadline = t0 + timeout_s
        while True:
            kind, msg = self._await(child, deadline)
            elapsed = time.monotonic() - t0
            if kind == "timeout":
                self._dump_stacks(child)
                tail = _read_tail(child.stderr_path)
                self._replace(graceful=False)
                message = _with_tail(f"no answer within {timeout_s:g} s", tail)
                return WorkerOutcome("timeout", message=message, elapsed_s=elapsed, pid=pid)
            if kind == "dead":
                if self._closed:
                    return WorkerOutcome("crashed", message="worker was closed", elapsed_s=elapsed, pid=pid)
                message = self._death_message(child)
                self._replace(graceful=False)
                return WorkerOutcome("crashed", message=message, elapsed_s=elapsed, pid=pid)
            status, got_seq, payload = msg
            if got_seq is not None and got_seq != seq:
                continue  # a stale answer; cannot happen with one job in flight, but be safe
            if status == "ok":
                if _must_restart(payload):
                    self._replace(graceful=True)
                return WorkerOutcome("ok", value=payload, elapsed_s=elapsed, pid=pid)
            message = _with_tail(str(payload), _read_tail(child.stderr_path))
            self._replace(graceful=True)
            return WorkerOutcome("crashed", message=message, elapsed_s=elapsed, pid=pid)

    def _dump_stacks(self, child: _Child) -> None:
        """Ask a hung child to write its Python stacks to its stderr (faulthandler)."""
        if not child.ready:
            return  # the SIGUSR1 handler may not be installed yet
        try:
            os.kill(child.process.pid, signal.SIGUSR1)
        except (OSError, TypeError):
            return
        time.sleep(0.1)

    def _replace(self, *, graceful: bool) -> None:
        """Drop the current child and, unless closed, spawn the next one."""
        self._restarts += 1
        self._discard_child(graceful=graceful)
        with self._state_lock:
            if self.restart_eagerly and not self._closed and self._child is None:
                try:
                    self._child = self._spawn()
                except Exception:  # noqa: BLE001 - the next run retries lazily
                    self._child = None

    def _discard_child(self, *, graceful: bool) -> None:
        """Stop the current child (politely first if `graceful`) and release its resources."""
        with self._state_lock:
            child, self._child = self._child, None
        if child is None:
            return
        process = child.process
        try:
            if graceful and process.is_alive():
                try:
                    child.conn.send(("stop", None, None))
                except Exception:  # noqa: BLE001
                    pass
                process.join(timeout=self.kill_grace_s + 1.0)
        except (OSError, ValueError):
            pass
        self._kill(process)
        try:
            child.conn.close()
        except Exception:  # noqa: BLE001
            pass
        _unlink(child.stderr_path)

    def _kill(self, process: Any, *, release: bool = True) -> None:
        """SIGTERM, a short grace, SIGKILL; a process that still will not go is reaped later."""
        try:
            if process.is_alive():
                process.terminate()
                process.join(timeout=self.kill_grace_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
            exitcode = process.exitcode
        except (OSError, ValueError):  # already released by another thread
            return
        if exitcode is None:
            with self._state_lock:
                self._dying.append(process)
        elif release:
            _release(process)

    def _reap_dying(self, timeout: float) -> None:
        with self._state_lock:
            dying, self._dying = self._dying, []
        still: list[Any] = []
        for process in dying:
            try:
                if process.is_alive():
                    process.kill()
                process.join(timeout=timeout)
            except (OSError, ValueError):
                continue
            if process.exitcode is None:
                still.append(process)
            else:
                _release(process)
        if still:
            with self._state_lock:
                self._dying.extend(still)


def _release(process: Any) -> None:
    try:
        process.close()
    except (ValueError, OSError):
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@atexit.register
def _close_all_workers() -> None:
    """Kill leftover children at interpreter exit (runs before multiprocessing joins them)."""
    for worker in list(_LIVE_WORKERS):
        try:
            worker.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass
class _MapState:
    """Shared state of one `WorkerPool.map_unordered` call."""

    jobs: Iterator[Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: "queue.Queue[tuple[str, Any, Any]]" = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)


class WorkerPool:
    """One Worker per device; `run(job, timeout_s)` uses a free worker (thread-safe), `map_unordered(jobs, timeout_s)` yields (job, outcome) as they finish."""

    def __init__(
        self,
        handler: str,
        devices: Sequence[int | None],
        *,
        init: str | None = None,
        init_args: tuple = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
        kill_grace_s: float = 1.0,
    ) -> None:
        if not devices:
            raise ValueError("a WorkerPool needs at least one device")
        self.workers: list[Worker] = [
            Worker(
                handler,
                device=d,
                init=init,
                init_args=init_args,
                env=env,
                start_timeout_s=start_timeout_s,
                kill_grace_s=kill_grace_s,
            )
            for d in devices
        ]
        self._idle: "queue.Queue[Worker]" = queue.Queue()
        for w in self.workers:
            self._idle.put(w)
        self._closed = False

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def restarts(self) -> int:
        """Child replacements over all workers."""
        return sum(w.restarts for w in self.workers)

    def start(self) -> None:
        """Spawn every worker's child now, so their inits overlap."""
        for w in self.workers:
            w.start()

    def run(self, job: Any, timeout_s: float) -> WorkerOutcome:
        """Run one job on the first free worker (blocks while all are busy)."""
        worker = self._acquire()
        try:
            return worker.run(job, timeout_s)
        finally:
            self._idle.put(worker)

    def map_unordered(self, jobs: Iterable[Any], timeout_s: float) -> Iterator[tuple[Any, WorkerOutcome]]:
        """Yield (job, outcome) pairs in completion order, keeping every worker busy."""
        state = _MapState(jobs=iter(jobs))
        threads = [
            threading.Thread(target=self._feed, args=(state, timeout_s), daemon=True, name=f"evoengineer-pool-{i}")
            for i in range(len(self.workers))
        ]
        for t in threads:
            t.start()
        done = 0
        try:
            while done < len(threads):
                kind, a, b = state.out.get()
                if kind == "done":
                    done += 1
                elif kind == "exc":
                    raise a
                else:
                    yield a, b
        finally:
            state.stop.set()

    def _feed(self, state: _MapState, timeout_s: float) -> None:
        try:
            while not state.stop.is_set():
                with state.lock:
                    try:
                        job = next(state.jobs)
                    except StopIteration:
                        return
                outcome = self.run(job, timeout_s)
                state.out.put(("item", job, outcome))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            state.stop.set()
            state.out.put(("exc", exc, None))
        finally:
            state.out.put(("done", None, None))

    def _acquire(self) -> Worker:
        while True:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            try:
                return self._idle.get(timeout=0.1)
            except queue.Empty:
                continue

    def close(self) -> None:
        """Close every worker; idempotent."""
        self._closed = True
        for w in self.workers:
            w.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
