"""The Optuna internals the search relies on, in one place, with the versions they are known for.

Optuna's public API has no compare-and-set on study attributes, so the ledger reaches under
it: a study's storage (``Study._storage``, ``Study._study_id``), the RDB storage behind the
cached one (``_CachedStorage._backend``), and the SQLAlchemy models of the RDB schema
(``optuna.storages._rdb.models``). Each is read here only; ``tests/test_optuna_internals.py``
runs every operation on a real SQLite study and checks the installed Optuna is in ``SUPPORTED``.
"""
from __future__ import annotations

import re
from typing import Any

import optuna

SUPPORTED = ((4, 0), (6, 0))
"""Optuna versions known to work: at least the first, below the second (4.x and 5.x)."""


def version_tuple(text: str) -> tuple[int, int]:
    """``'5.0.0'`` -> (5, 0); ``'4.1.0.dev'`` -> (4, 1)."""
    major, minor = (re.match(r"(\d+)\.(\d+)", text) or re.match(r"(\d+)()", text)).groups()
    return int(major), int(minor or 0)


def supported(version: str | None = None) -> bool:
    """Whether ``version`` (the installed Optuna's by default) is within ``SUPPORTED``."""
    low, high = SUPPORTED
    return low <= version_tuple(version or optuna.__version__) < high


def storage(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The study's storage (a cached wrapper around an RDB one, or an in-memory one)."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    return study._study_id


def rdb_backend(study: optuna.Study) -> optuna.storages.RDBStorage | None:
    """The RDB storage under a study's (cached) storage, if it has one."""
    store = storage(study)
    backend = getattr(store, "_backend", store)
    return backend if isinstance(backend, optuna.storages.RDBStorage) else None


def session(rdb: optuna.storages.RDBStorage) -> Any:
    """A new SQLAlchemy session on the RDB storage's engine (the caller commits and closes it)."""
    return rdb.scoped_session()


def study_attribute_model() -> Any:
    """The table of study system attributes: unique on (study_id, key), ``value_json`` text."""
    from optuna.storages._rdb import models

    return models.StudySystemAttributeModel


def heartbeat_model() -> Any:
    """The table of trial heartbeats (``trial_id``, ``heartbeat``)."""
    from optuna.storages._rdb import models

    return models.TrialHeartbeatModel


def trial_models() -> Any:
    """The RDB schema's models (``TrialModel``, ``TrialValueModel``, ``TrialParamModel``,
    ``TrialSystemAttributeModel``), which the history reader queries for trials under way."""
    from optuna.storages._rdb import models

    return models
