"""The Optuna internals the search uses (evoengineer/search/optuna_internals.py): each on a real SQLite study,
the supported range, and a scan that no other module touches a private Optuna name."""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy.exc
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

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



def test_trial_ids_snapshots_and_suggest_through_the_adapter(sqlite_study: optuna.Study) -> None:
    trial = sqlite_study.ask()
    assert internals.trial_id(trial) == trial._trial_id == internals.trial_id(sqlite_study.trials[0])
    assert internals.frozen_trial(trial).number == trial.number and internals.frozen_trial(trial).state == TrialState.RUNNING
    choice = CategoricalDistribution(["a", "b"])
    value = internals.suggest(trial, "x", choice)
    assert value in ("a", "b") and internals.storage(sqlite_study).get_trial(internals.trial_id(trial)).params == {"x": value}
    assert internals.distribution_contains(choice, 1) and not internals.distribution_contains(choice, 2)


def test_a_trial_made_from_its_snapshot_is_the_one_optuna_makes_by_reading_it(sqlite_study: optuna.Study) -> None:
    asked = sqlite_study.ask()
    read = optuna.Trial(sqlite_study, internals.trial_id(asked))
    made = internals.trial_of(sqlite_study, internals.frozen_trial(read))
    assert set(vars(made)) == set(vars(read)) and internals.frozen_trial(made) == internals.frozen_trial(read)
    assert made.number == asked.number and made.relative_params == {}
    assert made.suggest_categorical("x", ["a", "b"]) in ("a", "b")
    sqlite_study.tell(made, 1.0)
    assert sqlite_study.trials[0].state == TrialState.COMPLETE and sqlite_study.trials[0].params.keys() == {"x"}


def test_a_trial_whose_heartbeat_went_stale_is_found(sqlite_study: optuna.Study) -> None:
    beating, stale = sqlite_study.ask(), sqlite_study.ask()
    rdb = internals.rdb_backend(sqlite_study)
    for trial in (beating, stale):
        rdb.record_heartbeat(internals.trial_id(trial))
    model = internals.heartbeat_model()
    with internals.transaction(rdb) as session:  # its search died long ago
        session.query(model).filter(model.trial_id == internals.trial_id(stale)).update({"heartbeat": datetime(2000, 1, 1)})
    assert internals.stale_trial_ids(sqlite_study) == [internals.trial_id(stale)]


def test_a_transaction_commits_on_leaving_and_rolls_back_on_an_error(sqlite_study: optuna.Study) -> None:
    rdb, model, study_id = internals.rdb_backend(sqlite_study), internals.study_attribute_model(), internals.study_id(sqlite_study)
    with internals.transaction(rdb) as session:
        session.add(model(study_id=study_id, key="kept", value_json="1"))
    with pytest.raises(KeyError):
        with internals.transaction(rdb) as session:
            session.add(model(study_id=study_id, key="dropped", value_json="2"))
            session.flush()
            raise KeyError("dropped")
    with pytest.raises(sqlalchemy.exc.IntegrityError):  # the key is taken: the insert fails, as the ledger's do
        with internals.transaction(rdb) as session:
            session.add(model(study_id=study_id, key="kept", value_json="3"))
    assert internals.storage(sqlite_study).get_study_system_attrs(study_id) == {"kept": 1}


# -- the supported range ---------------------------------------------------------------------


def test_an_unsupported_optuna_is_named_with_the_supported_range() -> None:
    (low_major, low_minor), (high_major, high_minor) = internals.SUPPORTED
    assert internals.unsupported_reason() is None and internals.unsupported_reason(f"{low_major}.{low_minor}.0") is None
    for version in ("3.6.1", f"{high_major}.0.0", f"{high_major}.{high_minor}.0.dev0"):
        reason = internals.unsupported_reason(version)
        assert reason is not None and "\n" not in reason
        assert f"optuna {version} is installed" in reason and f"optuna>={low_major}.{low_minor},<{high_major}.{high_minor}" in reason


@pytest.mark.parametrize("version", ["3.6.1", f"{internals.SUPPORTED[1][0]}.0.0"])
def test_the_search_stops_with_one_line_under_an_unsupported_optuna(
        version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from evoengineer.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(optuna, "__version__", version)
    assert main(["search", "--replay", "demo", "--trials", "3", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {internals.unsupported_reason(version)}\n" and f"optuna {version}" in err
    assert list(tmp_path.iterdir()) == []  # stopped before anything was written
    assert main(["demo", "--trials", "3", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == err and list(tmp_path.iterdir()) == []


def test_the_search_runs_under_a_supported_optuna(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evoengineer.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(optuna, "__version__", "{}.{}.0".format(*internals.SUPPORTED[0]))
    assert main(["search", "--replay", "demo", "--trials", "3", "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    assert (tmp_path / "run" / "run.json").exists()


# -- no module but the adapter touches a private Optuna name ---------------------------------

REPO = Path(__file__).resolve().parent.parent
ADAPTER = REPO / "evoengineer" / "search" / "optuna_internals.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _names_defined_in(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, attributes set on objects, and
    assignments at module or class level."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else \
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


@functools.lru_cache(maxsize=None)
def optuna_private_names() -> frozenset[str]:
    """Every private name the installed Optuna defines, its private modules' names included."""
    root = Path(optuna.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        names.update(part for part in path.relative_to(root).with_suffix("").parts if _private(part))
        names |= _names_defined_in(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


def _optuna_class_private_names(cls: type) -> set[str]:
    """Private names an Optuna class and its Optuna bases define (what ``self._x`` in a
    subclass would reach)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "optuna":
            names.update(n for n in vars(base) if _private(n))
            names |= _names_defined_in(ast.parse(textwrap.dedent(inspect.getsource(base))))
    return names


def _optuna_object(dotted: str) -> Any:
    """``optuna.samplers.BaseSampler`` -> the class (None if it is not an Optuna object)."""
    parts = dotted.split(".")
    if parts[0] != "optuna":
        return None
    obj: Any = optuna
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i + 1]))
        except ImportError:
            return None
    return obj


def optuna_private_uses(sources: dict[str, str]) -> list[str]:
    """``file:line: what`` for each touch of a private Optuna name in ``sources`` (path ->
    text): an import of a private Optuna module or name, ``x._name`` for a name Optuna
    defines (``self``/``cls`` aside, unless the class derives from an Optuna class that
    defines it), ``getattr``/``hasattr``/``setattr`` with such a name, and a string naming a
    private Optuna module."""
    private = optuna_private_names()
    trees = {path: ast.parse(text) for path, text in sources.items()}
    imported: dict[str, dict[str, str]] = {}  # path -> local name -> dotted Optuna origin
    bases: dict[str, list[str]] = {}  # class name -> its bases as written (any scanned file)
    for path, tree in trees.items():
        names = imported.setdefault(path, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "optuna":
                names.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names})
            elif isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).extend(ast.unparse(b) for b in node.bases)

    def optuna_bases(class_name: str, path: str, seen: frozenset[str] = frozenset()) -> list[type]:
        found = []
        for base in bases.get(class_name, []):
            dotted = imported[path].get(base.split(".")[0], base.split(".")[0]) + "".join(
                "." + p for p in base.split(".")[1:])
            obj = _optuna_object(dotted)
            if isinstance(obj, type):
                found.append(obj)
            elif base.split(".")[-1] not in seen:
                found += optuna_bases(base.split(".")[-1], path, seen | {class_name})
        return found

    uses = []
    for path, tree in trees.items():
        def visit(node: ast.AST, own: set[str]) -> None:
            if isinstance(node, ast.ClassDef):
                own = set().union(*map(_optuna_class_private_names, optuna_bases(node.name, path)))
            what = None
            if isinstance(node, ast.Import):
                what = next((a.name for a in node.names if a.name.split(".")[0] == "optuna"
                             and any(map(_private, a.name.split(".")))), None)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "optuna":
                if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                    what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
            elif isinstance(node, ast.Attribute) and node.attr in private:
                mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not mine or node.attr in own:
                    what = ast.unparse(node)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in private:
                    what = ast.unparse(node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                    r"\boptuna(\.\w+)*\._\w", node.value):
                what = repr(node.value)
            if what:
                uses.append(f"{path}:{node.lineno}: {what}")
            for child in ast.iter_child_nodes(node):
                visit(child, own)

        visit(tree, set())
    return uses


def _sources(*folders: str) -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for folder in folders
            for p in sorted((REPO / folder).rglob("*.py")) if p != ADAPTER}


def test_no_module_but_the_adapter_touches_a_private_optuna_name() -> None:
    uses = optuna_private_uses(_sources("evoengineer", "benchmarks"))
    assert not uses, "reach these through evoengineer/search/optuna_internals.py:\n" + "\n".join(uses)


def test_the_scan_finds_each_way_of_touching_a_private_optuna_name() -> None:
    source = '''
import optuna
import optuna.storages._rdb.models
from optuna.storages._rdb import models
from optuna.storages import _CachedStorage
from optuna.samplers import BaseSampler
import importlib

class Sampler(BaseSampler):
    def f(self, study):
        self._raise_error_if_multi_objective(study)
        return study._storage, getattr(study, "_study_id"), importlib.import_module("optuna.trial._trial")

class Mine:
    def __init__(self, study):
        self._storage, self._rng = study.storage, None  # names of our own, on our own object

def g(trial, torch):
    return trial._trial_id, torch._C, Mine(None)._rng
'''
    uses = [use.split(": ", 1)[1] for use in optuna_private_uses({"m.py": source})]
    assert uses == ["optuna.storages._rdb.models", "from optuna.storages._rdb import models",
                    "from optuna.storages import _CachedStorage", "self._raise_error_if_multi_objective",
                    "study._storage", "getattr(study, '_study_id')", "'optuna.trial._trial'", "trial._trial_id",
                    "Mine(None)._rng"]
