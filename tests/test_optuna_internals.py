"""The Optuna internals the ledger uses (evoengineer/search/optuna_internals.py), on a real SQLite study."""
from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from evoengineer.search import optuna_internals as internals
from evoengineer.search.ledger import Ledger


def test_the_installed_optuna_is_within_the_supported_range() -> None:
    low, high = internals.SUPPORTED
    assert internals.supported(), f"optuna {optuna.__version__} is outside {low} <= version < {high}: check the adapter"
    assert internals.version_tuple("4.1.0.dev0") == (4, 1) and not internals.supported("3.6.1")
    assert not internals.supported(f"{high[0]}.0.0")


@pytest.fixture
def sqlite_study(tmp_path: Path) -> optuna.Study:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=60)
    return optuna.create_study(study_name="adapter", storage=storage)


def test_the_adapter_reaches_the_rdb_tables_of_a_real_sqlite_study(sqlite_study: optuna.Study) -> None:
    rdb = internals.rdb_backend(sqlite_study)
    assert isinstance(rdb, optuna.storages.RDBStorage) and internals.study_id(sqlite_study) == sqlite_study._study_id
    model = internals.study_attribute_model()
    session = internals.session(rdb)
    try:
        session.add(model(study_id=internals.study_id(sqlite_study), key="k", value_json="1"))
        session.commit()
    finally:
        session.close()
    assert internals.storage(sqlite_study).get_study_system_attrs(internals.study_id(sqlite_study))["k"] == 1  # Optuna reads it
    trial = sqlite_study.ask()
    rdb.record_heartbeat(trial._trial_id)
    session = internals.session(rdb)
    try:
        beats = session.query(internals.heartbeat_model()).filter_by(trial_id=trial._trial_id).all()
    finally:
        session.close()
    assert len(beats) == 1


def test_ledger_compare_and_set_on_sqlite(sqlite_study: optuna.Study) -> None:
    first, second = Ledger(sqlite_study), Ledger(optuna.load_study(study_name="adapter", storage=sqlite_study._storage))
    assert first.atomic and first.insert("config:abc", {"trial": 0})
    assert not second.insert("config:abc", {"trial": 1})  # the second inserter loses
    assert second.get("config:abc") == {"trial": 0} and first.entries("config:") == {"abc": {"trial": 0}}
    second.delete("config:abc")
    assert first.get("config:abc") is None and second.insert("config:abc", {"trial": 2})
    trial = sqlite_study.ask()
    internals.rdb_backend(sqlite_study).record_heartbeat(trial._trial_id)
    assert first.heartbeats([trial._trial_id, trial._trial_id + 99]) == {trial._trial_id}


def test_an_in_memory_study_has_no_rdb_backend() -> None:
    study = optuna.create_study()
    assert internals.rdb_backend(study) is None and Ledger(study).atomic


def test_the_history_reader_queries_the_trial_tables_through_the_adapter(sqlite_study: optuna.Study) -> None:
    trial = sqlite_study.ask()
    sqlite_study.tell(trial, 1.5)
    models = internals.trial_models()
    session = internals.session(internals.rdb_backend(sqlite_study))
    try:
        rows = session.query(models.TrialModel.trial_id, models.TrialModel.state).filter(
            models.TrialModel.study_id == internals.study_id(sqlite_study)).all()
        values = session.query(models.TrialValueModel.value).filter(models.TrialValueModel.trial_id == trial._trial_id).all()
        for table in (models.TrialParamModel, models.TrialSystemAttributeModel):
            session.query(table.trial_id).filter(table.trial_id == trial._trial_id).all()
    finally:
        session.close()
    assert [r.state.is_finished() for r in rows] == [True] and [v.value for v in values] == [1.5]
