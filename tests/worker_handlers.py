"""Job handlers for tests/test_worker.py, imported by the worker children.

The children start with the parent's ``sys.path``; test_worker.py puts this
directory on it, so ``worker_handlers:<name>`` resolves in the child.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

_STATE: dict[str, Any] = {}


def echo(job: Any) -> Any:
    """Return the job unchanged."""
    return job


def square(job: int) -> int:
    return job * job


def pid(job: Any = None) -> int:
    return os.getpid()


def dispatch(job: dict[str, Any]) -> Any:
    """Do what ``job["do"]`` names; lets one child exercise several behaviours."""
    what = job["do"]
    if what == "ok":
        return {"pid": os.getpid(), "value": job.get("value")}
    if what == "raise":
        raise ValueError(f"bad candidate {job.get('value')}")
    if what == "abort":
        os.abort()
    if what == "segfault":
        ctypes.string_at(0)
    if what == "exit":
        os._exit(job.get("code", 3))
    if what == "hang":
        while True:
            time.sleep(0.05)
    if what == "stderr_abort":
        sys.stderr.write(f"{job['line']}\n")
        sys.stderr.flush()
        os.abort()
    if what == "sleep":
        time.sleep(job["s"])
        return {"pid": os.getpid()}
    if what == "status":
        return {"pid": os.getpid(), "status": job["status"]}
    if what == "must_restart":
        return {"pid": os.getpid(), "worker_must_restart": True}
    if what == "unpicklable":
        return lambda: None
    if what == "env":
        with open("/proc/self/environ", "rb") as f:  # the environment the interpreter started with
            initial = dict(
                item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item
            )
        start = initial.get(b"CUDA_VISIBLE_DEVICES")
        return {
            "now": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "at_start": start.decode() if start is not None else None,
            "extra": os.environ.get("EVO_TEST_EXTRA"),
        }
    if what == "state":
        return _STATE.get("init")
    raise KeyError(what)


def init_state(tag: str, count: int) -> None:
    """Worker init: remember the arguments so jobs can see init ran."""
    _STATE["init"] = (tag, count)


def init_fails() -> None:
    raise RuntimeError("warm-up failed on purpose")


def fake_gpu(job: dict[str, Any]) -> dict[str, Any]:
    """Answers an ``Evaluator``'s jobs as the GPU handler would, without a GPU: every case
    passes the gate and times 100 us; a timing job echoes the racing limit it was given."""
    if job["kind"] == "info":
        return {"status": "ok", "gpu": "fake", "arch": "sm_90"}
    if job["kind"] == "jobs_run":
        return {"status": "ok", **_STATE.get("kinds", {})}
    kinds = _STATE.setdefault("kinds", {})
    kinds[job["kind"]] = kinds.get(job["kind"], 0) + 1
    if job["kind"] == "gate":
        fail = job["key"] in _STATE.get("failing", ()) or os.environ.get("EVO_TEST_FAIL_GATE") == "1"
        return {"status": "incorrect" if fail else "ok",
                "cases": [{"label": case.label(), "status": "ok", "reason": ""} for case, _ in job["cases"]]}
    limit = job["timing"].get("give_up_above_us")
    return {"status": "ok", "time": {"median_us": 100.0, "give_up_above_us": limit}, "tflops": 1.0}
