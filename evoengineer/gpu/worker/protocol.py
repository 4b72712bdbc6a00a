"""The wire between a worker's parent and its child: what is sent at spawn, the
messages each way, and what a job's fate is reported as.

Parent to child: the ``ChildSpec`` at spawn, then ``("jobs", seq, [job, ...])`` or
``("stop",)``. Child to parent: ``("ready", None, pid)`` or ``("init_error", None, text)``
once, then ``("ok", seq, value)`` or ``("error", seq, text)`` per job, in order (seq, seq + 1,
...), up to the first answer that ends the batch (``ends_batch``).
"""
from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

TRACEBACK_TAIL_LINES = 15


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
class ChildSpec:
    """Everything the child needs, sent to it at spawn."""

    handler: str
    init: str | None
    init_args: tuple
    env: dict[str, str]
    stderr_path: str
    parent_pid: int


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


def format_exception(exc: BaseException) -> str:
    """``Type: text`` followed by the tail of the traceback."""
    head = f"{type(exc).__qualname__}: {exc}"
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    tail = "\n".join(lines[-TRACEBACK_TAIL_LINES:])
    return f"{head}\n{tail}"


def must_restart(value: Any) -> bool:
    """Whether a handler's value asks for a fresh child (``worker_must_restart``)."""
    try:
        if isinstance(value, Mapping):
            return bool(value.get("worker_must_restart", False))
        return bool(getattr(value, "worker_must_restart", False))
    except Exception:  # noqa: BLE001 - a strange value never breaks the supervisor
        return False


def ends_batch(status: str, value: Any) -> bool:
    """Whether an answer ends a batch of jobs: an error, a value asking for a fresh child, or
    a mapping whose ``status`` is not ``"ok"`` (the jobs after it depend on it)."""
    if status != "ok" or must_restart(value):
        return True
    try:
        return isinstance(value, Mapping) and value.get("status", "ok") != "ok"
    except Exception:  # noqa: BLE001 - a strange value ends nothing
        return False
