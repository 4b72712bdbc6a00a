"""The parent's side of a worker: spawn the child on one GPU, send it jobs, and turn
whatever happens to it (an answer, an exception, a death, silence) into a ``WorkerOutcome``."""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from .child import child_main
from .protocol import ChildSpec, WorkerOutcome, ends_batch, format_exception, must_restart

STDERR_TAIL_LINES = 20
_STDERR_TAIL_BYTES = 64 * 1024

_CTX = multiprocessing.get_context("spawn")
_SPAWN_LOCK = threading.Lock()
_LIVE_WORKERS: "weakref.WeakSet[Worker]" = weakref.WeakSet()


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
        return self.run_many([job], timeout_s)[0]

    def run_many(self, jobs: list[Any], timeout_s: float) -> list[WorkerOutcome]:
        """Run ``jobs`` in the child in one round trip, in order, each given up to ``timeout_s``
        from the answer before it. The batch ends at the first answer that ``ends_batch`` (an
        error, a status other than ok) or a death or timeout: one outcome per job answered, the
        last one saying what ended it early."""
        if not jobs:
            return []
        with self._run_lock:
            if self._closed:
                raise RuntimeError("worker is closed")
            try:
                return self._run_jobs(list(jobs), timeout_s)
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
        spec = ChildSpec(
            handler=self.handler,
            init=self.init,
            init_args=self.init_args,
            env=dict(self.env),
            stderr_path=stderr_path,
            parent_pid=os.getpid(),
        )
        process = _CTX.Process(
            target=child_main,
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

    def _run_jobs(self, jobs: list[Any], timeout_s: float) -> list[WorkerOutcome]:
        self._reap_dying(timeout=0)
        failed = self._ensure_ready()
        if failed is not None:
            return [failed]
        child = self._child
        assert child is not None
        pid = child.process.pid
        first = self._seq + 1
        self._seq += len(jobs)
        t0 = time.monotonic()
        try:
            child.conn.send(("jobs", first, jobs))
        except (BrokenPipeError, EOFError, ConnectionResetError, OSError):
            message = self._death_message(child, prefix="worker died before the job was sent: ")
            self._replace(graceful=False)
            return [WorkerOutcome("crashed", message=message, elapsed_s=0.0, pid=pid)]
        except Exception as exc:  # noqa: BLE001 - the job itself is unpicklable
            message = f"job could not be pickled: {format_exception(exc)}"
            return [WorkerOutcome("crashed", message=message, elapsed_s=0.0, pid=pid)]

        outcomes: list[WorkerOutcome] = []
        for seq in range(first, first + len(jobs)):
            outcome = self._await_answer(child, seq, t0, timeout_s)
            outcomes.append(outcome)
            t0 = time.monotonic()
            if not outcome.ok or ends_batch("ok", outcome.value):
                break
        return outcomes

    def _await_answer(self, child: _Child, seq: int, t0: float, timeout_s: float) -> WorkerOutcome:
        """The answer to job ``seq`` (sent, or the one before it answered, at ``t0``)."""
        pid = child.process.pid
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
                if must_restart(payload):
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
