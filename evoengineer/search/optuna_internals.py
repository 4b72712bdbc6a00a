"""The Optuna internals the search relies on, in one place, with the versions they are known for.

Optuna's public API has no compare-and-set on study attributes, no batched trial writes and
no handle on a trial's storage id, so the search reaches under it: a study's storage and id
(``Study._storage``, ``Study._study_id``), a trial's id and snapshot (``_trial_id``,
``Trial._cached_frozen_trial``) and a ``Trial`` made from a snapshot (its attributes, as its
constructor sets them), ``Trial._suggest`` and ``BaseDistribution._contains``, the
RDB storage behind the cached one (``_CachedStorage._backend``), its stale-trial query
(``_get_stale_trial_ids``), and the RDB schema (``optuna.storages._rdb``: its models and
``_create_scoped_session``). No other module touches a private Optuna name:
``tests/test_optuna_internals.py`` scans the sources for one, runs every function here on a
real SQLite study, and checks the installed Optuna is in ``SUPPORTED``; ``evoengineer
search`` stops with ``unsupported_reason`` outside it.
"""
from __future__ import annotations

import re
from contextlib import AbstractContextManager
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


def unsupported_reason(version: str | None = None) -> str | None:
    """None if ``version`` (the installed Optuna's by default) is within ``SUPPORTED``, else one
    line naming it and the supported range."""
    version = version or optuna.__version__
    if supported(version):
        return None
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED
    wanted = f"optuna>={low_major}.{low_minor},<{high_major}.{high_minor}"
    return f"optuna {version} is installed, outside the versions the search is tested with ({wanted}): pip install '{wanted}'"


def storage(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The study's storage (a cached wrapper around an RDB one, or an in-memory one)."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """The study's id in its storage (what the storage's methods take)."""
    return study._study_id


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """The trial's id in its storage (unique across the storage's studies, unlike ``number``)."""
    return trial._trial_id


def frozen_trial(trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    """The snapshot of a running trial that ``optuna.Trial`` read when it was made (no new read)."""
    return trial._cached_frozen_trial


def trial_of(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> optuna.Trial:
    """What ``optuna.Trial(study, trial_id)`` makes of a running trial, from the snapshot
    ``frozen`` the caller holds (a trial it has just created), without reading the trial back."""
    trial = optuna.Trial.__new__(optuna.Trial)
    trial.study = study
    trial._trial_id = frozen._trial_id
    trial.storage = study._storage
    trial._cached_frozen_trial = frozen
    filtered = optuna.pruners._filter_study(study, frozen)
    study.sampler.before_trial(filtered, frozen)
    trial.relative_search_space = study.sampler.infer_relative_search_space(filtered, frozen)
    trial._relative_params = None
    trial._fixed_params = frozen.system_attrs.get("fixed_params", {})
    return trial


def suggest(trial: optuna.Trial, name: str, distribution: optuna.distributions.BaseDistribution) -> Any:
    """``suggest_*`` for any distribution: the trial's value of ``name``, sampled and stored if new."""
    return trial._suggest(name, distribution)


def distribution_contains(distribution: optuna.distributions.BaseDistribution, internal_value: float) -> bool:
    """Whether ``distribution`` holds a value given in its internal representation."""
    return distribution._contains(internal_value)


def stale_trial_ids(study: optuna.Study) -> list[int]:
    """Ids of the study's running trials whose heartbeat went stale (storages with heartbeats)."""
    return storage(study)._get_stale_trial_ids(study_id(study))


def rdb_backend(study: optuna.Study) -> optuna.storages.RDBStorage | None:
    """The RDB storage under a study's (cached) storage, if it has one."""
    store = storage(study)
    backend = getattr(store, "_backend", store)
    return backend if isinstance(backend, optuna.storages.RDBStorage) else None


def session(rdb: optuna.storages.RDBStorage) -> Any:
    """A new SQLAlchemy session on the RDB storage's engine (the caller commits and closes it)."""
    return rdb.scoped_session()


def transaction(rdb: optuna.storages.RDBStorage) -> AbstractContextManager[Any]:
    """A session on the RDB storage, committed on leaving and closed; on an error rolled back
    and raised, a database error other than an integrity one as Optuna's
    ``StorageInternalError`` (as the storage's own writes do)."""
    from optuna.storages._rdb.storage import _create_scoped_session

    return _create_scoped_session(rdb.scoped_session)


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
    ``TrialSystemAttributeModel``, ``TrialUserAttributeModel``), which the history reader
    queries and the batched trial writes fill."""
    from optuna.storages._rdb import models

    return models
