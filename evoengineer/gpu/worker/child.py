"""The child's side of a worker: set up stderr capture and fault handlers, run the
init hook, then answer jobs until told to stop or the parent is gone."""
from __future__ import annotations

import faulthandler
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Any

from .protocol import ChildSpec, ends_batch, format_exception, resolve_callable

_WATCHDOG_PERIOD_S = 1.0


def _watch_parent(parent_pid: int) -> None:
    """Exit the child when its parent is gone, so no orphan outlives the search."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while True:
        time.sleep(_WATCHDOG_PERIOD_S)
        if os.getppid() != parent_pid:
            os._exit(70)


def child_main(conn: multiprocessing.connection.Connection, spec: ChildSpec) -> None:
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
        conn.send(("init_error", None, format_exception(exc)))
        return
    conn.send(("ready", None, os.getpid()))

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except BaseException as exc:  # noqa: BLE001 - the job could not be unpickled
            conn.send(("error", None, f"job could not be unpickled: {format_exception(exc)}"))
            continue
        if msg[0] == "stop":
            return
        _, seq, jobs = msg
        for i, job in enumerate(jobs):
            if not _answer(conn, handler, seq + i, job):
                break


def _answer(conn: multiprocessing.connection.Connection, handler: Any, seq: int, job: Any) -> bool:
    """Run one job and send its answer: whether the batch goes on after it."""
    try:
        os.ftruncate(2, 0)  # the stderr tail then belongs to this job
    except OSError:
        pass
    try:
        value = handler(job)
    except BaseException as exc:  # noqa: BLE001 - reported, the parent replaces us
        answer: tuple = ("error", seq, format_exception(exc))
    else:
        answer = ("ok", seq, value)
    _flush_stdio()
    try:
        conn.send(answer)
    except Exception as exc:  # noqa: BLE001 - pickling failed before anything was written
        answer = ("error", seq, f"answer could not be pickled: {format_exception(exc)}")
        conn.send(answer)
    return not ends_batch(answer[0], answer[2])


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass
