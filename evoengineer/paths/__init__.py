"""Each kernel path's rules in one place: the parameters it uses, the validity of a
configuration, its shared-memory and register budget, its launch shape and its label tokens.

A path is a value of the ``PATH`` parameter and one include of a template: the forward's
``flash_attention`` (``scalar``, ``wmma``, ``mma``, ``wgmma``) or the backward's
``flash_attention_bwd`` (``mma``, ``wgmma``). The space applies a path's rules to every
configuration of it (a space file restates none of them) and lets constraints call its budgets
(``smem_bytes()``, ``threads()``); the renderer hands the budgets, and whatever else of the
rules a template reads (a path's ``template_values``), to the template as ``PATH_<NAME>``, so
that no template restates a formula; the tests compare the template's launches with them.

It imports no other stage but the runtime (the mma path's split rule is written there, for exports).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from . import mma, mma_backward, scalar, wgmma, wgmma_backward, wmma
from .base import KernelPath, Rule, Scope

FORWARD_TEMPLATE = "flash_attention"
BACKWARD_TEMPLATE = mma_backward.TEMPLATE
PATHS: dict[str, KernelPath] = {p.PATH.name: p.PATH for p in (scalar, wmma, mma, wgmma)}
"""Every path of the forward template, by its ``PATH`` value."""
TEMPLATE_PATHS: dict[str, dict[str, KernelPath]] = {
    FORWARD_TEMPLATE: PATHS,
    BACKWARD_TEMPLATE: {p.PATH.name: p.PATH for p in (mma_backward, wgmma_backward)},
}
"""Every template's paths, by template name (a template without paths of its own: the forward's)."""

NEUTRAL: dict[str, Any] = {
    "WARPS": 1, "VEC": 1, "STAGES": 1, "SMEM_LAYOUT": "swizzle", "Q_IN_REGS": 0, "P_IN_REGS": 0, "SPLITS": 1,
    "KV_GROUPS": 1, "PACK_GQA": 0, "CONSUMER_WGS": 1, "PRODUCER": 0, "REG_PRODUCER": 0, "REG_CONSUMER": 0,
    "INTRA_WG_OVERLAP": 0, "PINGPONG": 0, "LOAD": "cpasync", "PERSISTENT": 0, "O_TMA": 0, "SPLIT_TAIL": 0,
    "SOFTMAX_PIN": 0,
}
"""The value a parameter took on a path that does not use it, when every path carried every
parameter of its space: a configuration hashes with these filled in, so its key is the one it
had then."""

def _scope_path(scope: Scope) -> KernelPath:
    return path_of(scope, scope.get("TEMPLATE", FORWARD_TEMPLATE))


SCOPE_FUNCTIONS: dict[str, Callable[[Scope], Any]] = {
    "smem_bytes": lambda scope: _scope_path(scope).smem_bytes(_scope_path(scope).scope(scope), scope["MAX_HEAD_DIM"]),
    "threads": lambda scope: _scope_path(scope).threads(_scope_path(scope).scope(scope)),
}
"""Functions a space's constraints may call, without arguments, on the configuration at hand:
``smem_bytes()`` (its main kernel's shared memory at the space's largest head dim) and
``threads()`` (its block's threads)."""


def of_template(template: str) -> dict[str, KernelPath]:
    """The paths of ``template`` (those of the forward for a template not named here)."""
    return TEMPLATE_PATHS.get(template, PATHS)


def get(name: str, template: str = FORWARD_TEMPLATE) -> KernelPath:
    """The path named ``name`` of ``template``; KeyError naming the known ones."""
    known = of_template(template)
    try:
        return known[name]
    except KeyError:
        raise KeyError(f"no kernel path {name!r} (known: {', '.join(known)})") from None


def path_of(config: Mapping[str, Any], template: str = FORWARD_TEMPLATE) -> KernelPath:
    return get(str(config["PATH"]), template)


def label_path(values: Mapping[str, Any]) -> KernelPath | None:
    """The path whose label tokens a configuration takes: the backward's path of its PATH where it
    has the backward's own parameters (DKDV, DQ_MODE), else the forward's (None: no such path)."""
    if "DKDV" in values or "DQ_MODE" in values:
        return TEMPLATE_PATHS[BACKWARD_TEMPLATE].get(str(values.get("PATH")), mma_backward.PATH)
    return PATHS.get(str(values.get("PATH")))


def head_dims(template: str = FORWARD_TEMPLATE) -> tuple[int, ...]:
    """Head dims some path of ``template`` holds (a space's shapes may use only these)."""
    return tuple(sorted({d for path in of_template(template).values() for d in path.head_dims}))


def is_backward(template: str) -> bool:
    """Whether ``template`` is the backward pass's (its objective: the backward's device time)."""
    return template == BACKWARD_TEMPLATE


__all__ = ["BACKWARD_TEMPLATE", "FORWARD_TEMPLATE", "NEUTRAL", "PATHS", "TEMPLATE_PATHS", "is_backward", "label_path", "of_template", "SCOPE_FUNCTIONS", "KernelPath", "Rule", "Scope", "get", "head_dims", "path_of"]
