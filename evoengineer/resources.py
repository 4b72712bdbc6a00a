"""Locate the data shipped with the package: templates, built-in search spaces and recordings.

Works from a source checkout (top-level ``templates/``, ``search_spaces/`` and
``recordings/``) and from an installed wheel, where they are installed as
``evoengineer.templates``, ``evoengineer.search_spaces`` and ``evoengineer.recordings``.
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


DEMO_RECORDING = "h100_mma_seed"
"""The recording ``--replay demo`` and ``evoengineer demo`` replay: every valid configuration
of the h100 space's mma path on B1 H8 S512 D64, timed on an H100."""


def recordings_dir() -> Path:
    """Directory holding the shipped recordings (``NAME.jsonl``, each beside its space ``NAME.yaml``)."""
    return _data_dir("recordings")


def builtin_recordings() -> dict[str, Path]:
    """Shipped recording name (file stem; ``demo`` for ``DEMO_RECORDING``) -> path."""
    found = {p.stem: p for p in sorted(recordings_dir().glob("*.jsonl"), key=lambda p: p.stem)}
    if DEMO_RECORDING in found:
        found["demo"] = found[DEMO_RECORDING]
    return found


def template_names(directory: str | Path | None = None) -> list[str]:
    """Template names (``<name>.cu.j2`` without the suffix; ``_`` includes left out) in ``directory``."""
    where = Path(directory) if directory is not None else templates_dir()
    return sorted(p.name[: -len(".cu.j2")] for p in where.glob("*.cu.j2") if not p.name.startswith("_"))
