"""The README and the docs pages work as typed: the install line names an extra that holds what the
tests import, every `evoengineer` command they show parses and its space resolves from any
directory, every benchmark command names a script and flags that exist, the Python snippets use
only what an export writes, every relative link resolves, and the README reads in one sitting.
(tests/gpu/test_readme_gpu.py runs the quick start and the tour on a GPU.)"""
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
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
RUN_NAMES = {"<run>": "20250301-101500-l4-3f9a1c", "<run2>": "20250302-091500-l4-77ab01"}

README_MAX_LINES = 200
README_MAX_WIDTH = 100


def sections(path: Path = README) -> dict[str, str]:
    """``## `` heading -> the text under it, up to the next ``## `` heading."""
    parts = re.split(r"^## (.+)$", path.read_text(), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)


def shell_lines(body: str) -> list[str]:
    """A shell block's commands, comments dropped and ``\\`` continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = (pending + line.strip()).strip()
        pending = ""
        if line:
            out.append(line)
    return out


def quick_start() -> tuple[list[str], str]:
    """The quick start's and the tour's first shell blocks' lines, in order, and the tour's first
    Python snippet: what a new user types on a GPU machine, from install to calling the export."""
    parts = sections()
    lines: list[str] = []
    for name in ("Quick start", "A tour"):
        lines += shell_lines(next(body for lang, body in blocks(parts[name]) if not lang))
    python = next(body for lang, body in blocks(parts["A tour"]) if lang == "python")
    return lines, python


def page_commands(path: Path) -> list[str]:
    """Every command line of a page's plain code blocks, and of its 4-space indented blocks."""
    text = path.read_text()
    lines = [line for lang, body in blocks(text) if not lang for line in shell_lines(body)]
    fenced = re.sub(r"```.*?```", "", text, flags=re.S)
    indented = "\n".join(line[4:] for line in fenced.splitlines() if line.startswith("    ") and line.strip())
    return lines + shell_lines(indented)


def _params(prefix: str) -> list:
    return [pytest.param(line, id=f"{path.relative_to(REPO)}:{line[:60]}")
            for path in PAGES for line in dict.fromkeys(page_commands(path)) if line.startswith(prefix)]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    """A distribution's normalised name; CuPy's wheels for CUDA 12 and 13 count as one (README: Install)."""
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")
    return re.sub(r"^cupy-cuda\d+x$", "cupy", name)


# -- the README's shape ---------------------------------------------------------------------------

def test_the_readme_reads_in_one_sitting() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"
    wide = [f"{i}: {len(line)}" for i, line in enumerate(lines, 1) if len(line) > README_MAX_WIDTH]
    assert wide == [], f"README.md lines over {README_MAX_WIDTH} characters (line: length): {wide}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
        out.add(slug.replace(" ", "-"))
    return out


# -- install and tests ----------------------------------------------------------------------------

def test_quick_start_installs_the_test_extra_and_install_names_its_packages() -> None:
    lines, _ = quick_start()
    assert lines[0] == 'pip install -e ".[test]"'
    extra = [_name(r) for r in pyproject()["project"]["optional-dependencies"]["test"]]
    assert {"pytest", "pytest-timeout", "matplotlib"} <= set(extra)  # pytest-timeout: pyproject's `timeout` option
    install = sections()["Install"]
    assert [name for name in extra if name not in install] == [], "README's Install lists the test extra incompletely"


def test_the_tests_section_gives_the_default_command_and_registered_markers() -> None:
    lines = [line for lang, body in blocks(sections()["Tests"]) if not lang for line in shell_lines(body)]
    assert lines[0] == "python3 -m pytest -q -n auto" and lines[1] == "python3 -m pytest -q -n auto -m slow"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert [line for line in lines if line not in ci] == [], "CI (.ci/run) runs every command of the README's Tests"
    declared = {m.split(":")[0].strip() for m in pyproject()["tool"]["pytest"]["ini_options"].get("markers", [])}
    used = {word for line in lines for expr in re.findall(r"-m\s+(\"[^\"]+\"|\S+)", line.replace("python3 -m pytest", ""))
            for word in re.findall(r"\w+", expr) if word not in ("not", "and", "or")}
    if "slow" in used and "slow" not in declared:
        pytest.skip("pyproject.toml registers no `slow` marker in this tree")
    assert used <= declared, f"markers the README uses but pyproject.toml does not register: {used - declared}"


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


# -- commands -------------------------------------------------------------------------------------

def test_quick_start_and_tour_run_search_then_leaderboard_report_export() -> None:
    lines, _ = quick_start()
    commands = [shlex.split(_with_runs(line)) for line in lines if line.startswith("evoengineer ")]
    assert [c[1] for c in commands] == ["search", "leaderboard", "report", "export"]
    parser = build_parser()
    export = parser.parse_args(commands[-1][1:])
    assert export.out == "best/" and export.rank == 1  # the snippet imports from best/
    assert Path(parser.parse_args(commands[0][1:]).space).name == "l4.yaml"


def _with_runs(line: str) -> str:
    for placeholder, name in RUN_NAMES.items():
        line = line.replace(placeholder, name)
    return line


def _subcommands() -> set[str]:
    parser = build_parser()
    return set(next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices)


@pytest.mark.parametrize("line", _params("evoengineer "))
def test_every_evoengineer_command_shown_parses_and_its_space_resolves(line: str, tmp_path: Path) -> None:
    argv = shlex.split(_with_runs(line))[1:]
    if argv[0] not in _subcommands() and argv[0] == "demo":
        pytest.skip("this tree has no `evoengineer demo` command")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`{line}` does not parse (exit {exc.code})")
    assert args.func is not None
    if getattr(args, "space", None):
        resolve_space_path(args.space, cwd=tmp_path)  # a built-in name, or spaces/NAME.yaml falling back to one


@pytest.mark.parametrize("line", _params("python benchmarks/") + _params("python3 benchmarks/"))
def test_every_benchmark_command_shown_names_a_script_and_its_flags(line: str) -> None:
    argv = shlex.split(line)[1:]
    script = REPO / argv[0]
    assert script.is_file(), f"`{line}`: no {argv[0]}"
    source = script.read_text()
    flags = {word.strip("[]").split("=")[0] for word in argv[1:] if word.strip("[]").startswith("--")}
    unknown = sorted(f for f in flags if f'"{f}"' not in source)
    assert unknown == [], f"`{line}`: {argv[0]} takes no {unknown}"


# -- Python snippets -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_module(tmp_path_factory: pytest.TempPathFactory):
    """A module as `evoengineer export` writes it, from a hand-written run (no GPU)."""
    from run_fixtures import load_module, make_run

    from evoengineer.results import export_runs

    root = tmp_path_factory.mktemp("readme-export")
    export_runs([make_run(root / "run")], root / "out")
    return load_module(root / "out")


def _snippets() -> list:
    return [pytest.param(body, id=f"{page.relative_to(REPO)}#{i}")
            for page in (README, REPO / "docs" / "export.md")
            for i, body in enumerate(b for lang, b in blocks(page.read_text()) if lang == "python")]


@pytest.mark.parametrize("snippet", _snippets())
def test_python_snippets_use_only_what_an_export_provides(snippet: str, exported_module) -> None:
    tree = ast.parse(snippet)
    used = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == MODULE_NAME for a in n.names}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == MODULE_NAME}
    assert used, "a snippet that does not use the exported module"
    assert sorted(name for name in used if not hasattr(exported_module, name)) == []


def test_quick_start_python_imports_attention_from_the_export_directory() -> None:
    _, python = quick_start()
    tree = ast.parse(python)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == MODULE_NAME and [a.name for a in n.names] == ["attention"] for n in imports)
    assert 'sys.path.insert(0, "best")' in python
