"""Locate the data shipped with the package: templates and built-in search spaces.

Works from a source checkout (top-level ``templates/`` and ``search_spaces/``) and
from an installed wheel, where both are installed as ``evoengineer.templates`` and
``evoengineer.search_spaces``.
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _data_dir(name: str) -> Path:
    candidate = _SOURCE_ROOT / name
    if candidate.is_dir():
        return candidate
    return Path(str(importlib.resources.files(f"evoengineer.{name}")))


def templates_dir() -> Path:
    """Directory holding the Jinja2 kernel templates (``*.cu.j2``)."""
    return _data_dir("templates")


def spaces_dir() -> Path:
    """Directory holding the built-in search spaces (``*.yaml``)."""
    return _data_dir("search_spaces")


def builtin_spaces() -> dict[str, Path]:
    """Built-in space name (file stem) -> path."""
    return {p.stem: p for p in sorted(spaces_dir().glob("*.yaml"), key=lambda p: p.stem)}


def template_names(directory: str | Path | None = None) -> list[str]:
    """Template names (``<name>.cu.j2`` without the suffix; ``_`` includes left out) in ``directory``."""
    where = Path(directory) if directory is not None else templates_dir()
    return sorted(p.name[: -len(".cu.j2")] for p in where.glob("*.cu.j2") if not p.name.startswith("_"))
