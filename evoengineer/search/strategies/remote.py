"""A sampler's background batches, computed in a process of their own.

The search's process runs its loop, a thread per device and the study's storage under one
interpreter lock; a strategy's batch (breeding, a Gaussian process's fit) takes it 5-15 ms a
proposal, which on many devices is what the devices wait for. ``BatchProcess`` computes the
batches in a child process instead, with a sampler of its own (made as the parent's was) that
reads the same study from its storage. The parent's sampler still claims each proposal when
a trial takes it, so nothing else changes: a batch is the same function of the seed, the
label and the study's history.
"""
from __future__ import annotations

import multiprocessing
import random
import threading
from typing import Any, Sequence

from ...space import Config, Space

_CTX = multiprocessing.get_context("spawn")

Recipe = tuple[type, Space, "int | None", dict]
"""How the sampler was made: ``cls(space, seed=seed, **options)`` (``make_sampler``)."""


class BatchProcess:
    """A child process that computes batches of proposals for a sampler made from ``recipe``,
    reading the study ``study_name`` from the storage at ``url``."""

    def __init__(self, recipe: Recipe, url: str, study_name: str, batch_size: int) -> None:
        self.recipe, self.url, self.study_name, self.batch_size = recipe, url, study_name, batch_size
        parent, child = _CTX.Pipe()
        self._conn = parent
        self._lock = threading.Lock()
        self._process = _CTX.Process(target=_serve, args=(child, recipe, url, study_name, batch_size),
                                     name="evoengineer-proposals", daemon=True)
        self._process.start()
        child.close()
        self._ready = False

    @property
    def ready(self) -> bool:
        """Whether the child has started (its imports done, the space enumerated, the storage open)."""
        if not self._ready:
            with self._lock:
                try:
                    self._ready = self._conn.poll(0) and self._conn.recv() == "ready"
                except (EOFError, OSError):
                    return False
        return self._ready

    def batch(self, want: int, skip: Sequence[Config], label: str) -> list[tuple[dict, str, list[dict]]] | None:
        """``want`` proposals not in the study nor in ``skip``, as (configuration, origin,
        parents) rows; None if the process failed, is gone or has not started yet."""
        if not self.ready:
            return None
        with self._lock:
            try:
                self._conn.send((want, [c.to_dict() for c in skip], label))
                return self._conn.recv()
            except (EOFError, OSError):
                return None

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()


def wanted(devices: int) -> bool:
    """Whether a search on ``devices`` devices computes its strategies' batches in a process
    (with its study in an RDB storage): on one device the batches keep up in the search's own."""
    return devices > 1


_STARTED: dict[str, BatchProcess] = {}
"""Batch processes started ahead of their search (``start_ahead``), by study name."""


def start_ahead(recipe: Recipe, url: str, study_name: str, batch_size: int) -> None:
    """Start the batch process of the study ``study_name`` before the search needs it (the
    study may not exist yet): its imports and the space's enumeration then overlap the GPU
    workers' start and SDPA's timing, and ``adopt`` hands it to the sampler."""
    if study_name not in _STARTED:
        _STARTED[study_name] = BatchProcess(recipe, url, study_name, batch_size)


def adopt(recipe: Recipe, url: str, study_name: str, batch_size: int) -> BatchProcess | None:
    """The batch process started ahead for this sampler and study, if one was (each is adopted once)."""
    started = _STARTED.pop(study_name, None)
    if started is None:
        return None
    cls, space, seed, options = started.recipe
    if (cls, seed, options, started.url, started.batch_size) == (recipe[0], recipe[2], recipe[3], url, batch_size) \
            and space is recipe[1]:
        return started
    started.close()  # made for another sampler
    return None


def close_started() -> None:
    """Stop the batch processes started ahead that no search adopted (a search that could not start)."""
    while _STARTED:
        _STARTED.popitem()[1].close()


def _serve(conn: Any, recipe: Recipe, url: str, study_name: str, batch_size: int) -> None:
    """The child: answer each request with a batch, until told to stop or the parent is gone.
    The study is loaded at the first request (a process started ahead may start before it exists)."""
    import optuna

    from ..study import make_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cls, space, seed, options = recipe
    sampler = cls(space, seed=seed, **options)
    sampler.recipe = recipe
    sampler.batch_size = batch_size
    sampler.warm()  # the space enumerated, the strategy's tables built, before the first request
    try:
        storage = make_storage(url, heartbeat_s=None)  # its engine made and the schema checked, too
    except Exception:  # noqa: BLE001 - made again at the first request, whose failure is answered
        storage = None
    conn.send("ready")
    study = None
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        want, skip, label = request
        try:
            if study is None:
                study = optuna.load_study(study_name=study_name, storage=storage or make_storage(url, heartbeat_s=None),
                                          sampler=sampler)
            history = sampler.history(study)
            history.seen.update(space.config(c) for c in skip)
            batch = [] if sampler.exhausted(history) else sampler.compute_batch(study, history, want, random.Random(label))
            conn.send([(p.config.to_dict(), p.origin, [q.to_dict() for q in p.parents]) for p in batch])
        except Exception:  # noqa: BLE001 - the parent computes its own batch instead
            conn.send(None)
