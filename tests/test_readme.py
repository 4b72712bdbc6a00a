"""The README's quick start works as typed: the install line names an extra that holds what
the tests import, every command parses and its space resolves from any directory, and the
PyTorch snippet imports what export writes. (tests/gpu/test_readme_gpu.py runs it on a GPU.)"""
from __future__ import annotations

import ast
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

import pytest

from evoengineer.cli.main import build_parser
from evoengineer.results import MODULE_NAME
from evoengineer.space import resolve_space_path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def quick_start() -> tuple[list[str], str]:
    """The quick start's shell lines (comments dropped) and its Python snippet."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 3)]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    shell = next(body for lang, body in blocks if not lang)
    python = next(body for lang, body in blocks if lang == "python")
    lines = [line.split(" #")[0].strip() for line in shell.splitlines()]
    return [line for line in lines if line], python


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    """A distribution's normalised name; CuPy's wheels for CUDA 12 and 13 count as one (README: Install)."""
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")
    return re.sub(r"^cupy-cuda\d+x$", "cupy", name)


def test_quick_start_installs_the_test_extra_and_runs_the_tests() -> None:
    lines, _ = quick_start()
    assert lines[0] == 'pip install -e ".[test]"'
    assert lines[-1] == "python3 -m pytest -q"
    extra = {_name(r) for r in pyproject()["project"]["optional-dependencies"]["test"]}
    assert {"pytest", "pytest-timeout", "matplotlib"} <= extra  # pytest-timeout: pyproject's `timeout` option


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` pull in, transitively, as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_the_test_extra_holds_every_package_the_tests_import() -> None:
    """Every package a test imports is installed by the test extra, or the test skips
    without it (``pytest.importorskip``)."""
    project = pyproject()["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    available = _closure(declared)
    local = {p.stem for p in TESTS.rglob("*.py")} | {"evoengineer", MODULE_NAME}
    owners = metadata.packages_distributions()
    missing = {}
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        optional = {node.args[0].value.split(".")[0] for node in ast.walk(tree)  # skipped with a reason where missing
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in local or top in optional or top == "__future__":
                    continue
                dists = {_name(d) for d in owners.get(top, [])}
                if not dists & available:
                    missing[top] = f"{path.relative_to(REPO)} (installed here from {sorted(dists) or 'nothing'})"
    assert missing == {}, f"imported by the tests but neither a dependency nor in the test extra: {missing}"


def test_quick_start_commands_parse_and_their_space_resolves_anywhere(tmp_path: Path) -> None:
    lines, _ = quick_start()
    commands = [shlex.split(line.replace("<run>", "20250301-101500-l4-3f9a1c")) for line in lines if line.startswith("evoengineer ")]
    assert [c[1] for c in commands] == ["search", "leaderboard", "report", "export"]
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])
        assert args.func is not None
        if getattr(args, "space", None):
            assert resolve_space_path(args.space, cwd=tmp_path).name == "l4.yaml"  # no spaces/ here: the built-in
    export = parser.parse_args(commands[-1][1:])
    assert export.out == "best/" and export.rank == 1


def test_quick_start_python_imports_what_export_writes() -> None:
    _, python = quick_start()
    tree = ast.parse(python)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == MODULE_NAME and [a.name for a in n.names] == ["attention"] for n in imports)
    assert 'sys.path.insert(0, "best")' in python
