"""What every command module shares: exit codes, the one-line usage error, loading a
space, parsing a configuration, requiring a GPU. Imports no command module."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable

from ..space import Config, Space, SpaceError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
WIDE_HELP = ("every column, however wide (default: the columns that fit an 80-column terminal, "
             "or every column when the terminal is wide enough)")


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def load_space(spec: str) -> Space:
    """The space at ``spec`` (a path or a built-in name); a mistake raises ``SpaceError``."""
    from ..space import load_space as _load

    return _load(spec)


def restrict_shapes(space: Space, shapes: list[str] | None, added: list[str] | None = None) -> Space:
    """The space cut down to ``--shape`` entries (all of its shapes when none are given), plus
    the ``--add-shape`` ones (then only those, without ``--shape``)."""
    from ..space import parse_shape

    if not shapes and not added:
        return space
    flag = "--add-shape" if added and not shapes else "--shape"
    try:
        return space.with_shapes([parse_shape(s) for s in shapes or ()], [parse_shape(s) for s in added or ()])
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def require_gpu() -> None:
    try:
        import torch
    except ImportError:
        raise UsageError("torch is not installed; `pip install torch` (see README)") from None
    if not torch.cuda.is_available():
        raise UsageError("no CUDA GPU found on this machine; `evoengineer check --space SPACE` compiles and reports resources without one")


def parse_config(text: str, space: Any) -> Config:
    try:
        config = Config.parse(text)
    except ValueError as exc:
        raise UsageError(f"--config: {exc}") from None
    unknown = [k for k in config if k not in space.param_names]
    if unknown:
        raise UsageError(f"--config: unknown parameter {unknown[0]!r}; {space.name} has {', '.join(space.param_names)}")
    # parameters left out take their (path's) first value, as in the space's seeds
    try:
        return space.complete(config, "--config")
    except SpaceError as exc:
        raise UsageError(f"{exc.key}: {exc.message}") from None


def run_path(text: str) -> Path:
    path = Path(text)
    if not (path / "run.json").exists():
        raise UsageError(f"{path}: not a run directory (no run.json); `evoengineer runs` lists them")
    return path


# -- numbers on the command line: range-checked where argparse reads them ------------------


def whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (0 never stands for "all")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


def number(minimum: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``minimum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text}")
        return value

    parse.__name__ = f"number >= {minimum:g}"
    return parse


def duration(text: str) -> float:
    """An argparse type: a positive duration such as 90s, 15m, 1h or 1h30m, in seconds."""
    from ..space import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive duration such as 90s, 15m, 1h or 1h30m, got {text!r}") from None
