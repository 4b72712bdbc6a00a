"""Each kernel path's rules in one place: the parameters it uses, the validity of a
configuration, its shared-memory and register budget, its launch shape and its label tokens.

A path is a value of the ``PATH`` parameter and one include of the ``flash_attention``
template (``scalar``, ``wmma``, ``mma``, ``wgmma``). The space applies a path's rules to every
configuration of it (a space file restates none of them) and lets constraints call its budgets
(``smem_bytes()``, ``threads()``); the renderer hands the budgets to the template; the tests
compare the template's launches with them.

This is the first stage of the package: it imports no other.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from . import mma, scalar, wgmma, wmma
from .base import KernelPath, Rule, Scope

PATHS: dict[str, KernelPath] = {p.PATH.name: p.PATH for p in (scalar, wmma, mma, wgmma)}
"""Every path, by its ``PATH`` value."""

NEUTRAL: dict[str, Any] = {
    "WARPS": 1, "VEC": 1, "STAGES": 1, "SMEM_LAYOUT": "swizzle", "Q_IN_REGS": 0, "P_IN_REGS": 0, "SPLITS": 1,
    "KV_GROUPS": 1, "PACK_GQA": 0, "CONSUMER_WGS": 1, "PRODUCER": 0, "REG_PRODUCER": 0, "REG_CONSUMER": 0,
    "INTRA_WG_OVERLAP": 0, "PINGPONG": 0, "LOAD": "cpasync", "PERSISTENT": 0, "O_TMA": 0, "SPLIT_TAIL": 0,
    "SOFTMAX_PIN": 0,
}
"""The value a parameter took on a path that does not use it, when every path carried every
parameter of its space: a configuration hashes with these filled in, so its key is the one it
had then."""

SCOPE_FUNCTIONS: dict[str, Callable[[Scope], Any]] = {
    "smem_bytes": lambda scope: path_of(scope).smem_bytes(path_of(scope).scope(scope), scope["MAX_HEAD_DIM"]),
    "threads": lambda scope: path_of(scope).threads(path_of(scope).scope(scope)),
}
"""Functions a space's constraints may call, without arguments, on the configuration at hand:
``smem_bytes()`` (its main kernel's shared memory at the space's largest head dim) and
``threads()`` (its block's threads)."""


def get(name: str) -> KernelPath:
    """The path named ``name``; KeyError naming the known ones."""
    try:
        return PATHS[name]
    except KeyError:
        raise KeyError(f"no kernel path {name!r} (known: {', '.join(PATHS)})") from None


def path_of(config: Mapping[str, Any]) -> KernelPath:
    return get(str(config["PATH"]))


__all__ = ["NEUTRAL", "PATHS", "SCOPE_FUNCTIONS", "KernelPath", "Rule", "Scope", "get", "path_of"]
