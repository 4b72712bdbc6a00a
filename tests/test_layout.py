"""The package layout: one subpackage per pipeline stage, no import cycles.

Every ``import`` in the package is read (module level and inside functions alike), so a
cycle that today only closes at run time still fails here.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import evoengineer

PACKAGE_DIR = Path(evoengineer.__file__).parent
STAGES = ("runtime", "paths", "space", "kernels", "gpu", "bench", "search", "results", "cli")
"""Pipeline order. ``runtime`` (what an export copies verbatim) comes first: it imports no
other stage, and any stage may import it. ``paths`` (each kernel path's rules, plain functions
of numbers) comes before ``space``, which evaluates them, and ``kernels``, which renders with them."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a ``from pkg import submodule`` counts as the submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[: len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "evoengineer"


def test_no_module_imports_itself_back() -> None:
    assert _cycles(import_graph()) == []


def test_stages_import_each_other_without_cycles() -> None:
    stage_graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in import_graph().items():
        for target in targets:
            if _stage(module) != _stage(target):
                stage_graph[_stage(module)].add(_stage(target))
    assert _cycles(stage_graph) == []
    # the pipeline's order: a stage never imports a later one
    order = ["resources", "evoengineer", *STAGES, "__main__"]
    for stage, targets in stage_graph.items():
        for target in targets:
            assert order.index(target) < order.index(stage), f"{stage} imports the later stage {target}"


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_stage_is_a_package_with_a_public_surface() -> None:
    for stage in STAGES:
        init = PACKAGE_DIR / stage / "__init__.py"
        assert init.exists(), stage
        module = __import__(f"evoengineer.{stage}", fromlist=["__all__"])
        for name in module.__all__:
            assert hasattr(module, name), f"evoengineer.{stage}.__all__ names {name}, which it lacks"


RUNTIME_THIRD_PARTY = {"torch", "cupy", "transformers"}
"""What the runtime may import besides the standard library (transformers only inside ``register_hf``)."""


def test_the_runtime_imports_only_itself_torch_cupy_and_the_standard_library() -> None:
    """An export copies ``evoengineer/runtime/`` as a package of another name: it reaches its own
    modules by relative imports only, and needs nothing but torch and cupy."""
    import sys

    for path in sorted((PACKAGE_DIR / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1, f"{path.name}: reaches outside the runtime package"
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in RUNTIME_THIRD_PARTY, f"{path.name} imports {name}"
    assert not list((PACKAGE_DIR / "runtime").glob("*/*.py"))  # flat: an export copies its files as they are
