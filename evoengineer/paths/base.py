"""What every kernel path declares: its parameters, its rules, its budgets and its label.

A *scope* is one configuration's parameter values together with the space's environment names
(``SMEM_LIMIT``, ``HEAD_DIMS``, ``MAX_HEAD_DIM``, ``MIN_HEAD_DIM``, ``ARCH_NAME``, ...), as a constraint sees
them. Rules read a scope; budgets take a configuration and a head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

Scope = Mapping[str, Any]
"""Parameter values and environment names, by name."""


@dataclass(frozen=True)
class Rule:
    """One validity rule of a path: ``check(scope)`` is true for a configuration the kernel
    can run. ``needs`` names every parameter the check reads, so that an enumeration can run it
    as soon as those have values; ``why`` is the one line a user reads when it fails."""

    name: str
    why: str
    needs: tuple[str, ...]
    check: Callable[[Scope], bool]

    def __call__(self, scope: Scope) -> bool:
        return bool(self.check(scope))

    @property
    def text(self) -> str:
        """How a violation is named: ``wgmma.persistent-loads-by-tma: <why>``."""
        return f"{self.name}: {self.why}"


@dataclass(frozen=True)
class KernelPath:
    """A kernel path (a value of ``PATH``): the parameters its template reads besides ``PATH``,
    the rules a configuration of it obeys, and the figures derived from a configuration."""

    name: str
    params: tuple[str, ...]
    """Every parameter the path's template reads (besides PATH), in the order a label shows them."""
    rules: tuple[Rule, ...]
    smem_bytes: Callable[[Scope, int], int]
    """Dynamic shared memory of the main kernel at a head dim, as its ``// LAUNCH`` line declares."""
    threads: Callable[[Scope], int]
    """Threads of the main kernel's block."""
    rows_per_cta: Callable[[Scope], int]
    """Query rows one CTA (one work tile) covers."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """What the template takes for a parameter of ``params`` a configuration leaves out (a space
    need not list every parameter of a path); rules and budgets see these where a value is absent."""
    head_dims: tuple[int, ...] = (64, 128)
    """Head dims the template holds (its ``head-dims`` rule refuses a space with any other)."""
    features: tuple[str, ...] = ()
    """Compile-time features the template holds on this path (``runtime.features.SWITCHES``: a
    variant asking another fails to render, naming this list)."""
    label: Callable[[dict[str, Any]], None] | None = None
    """Rewrites a configuration's values, in place, into the path's short-label tokens (pops what
    it folds into ``PATH``'s word or another token); None: the generic label."""
    template_values: Callable[[Scope, int], Mapping[str, Any]] | None = None
    """Further figures of the path's rules at a head dim that its template reads, each as
    ``PATH_<NAME>`` (beside ``PATH_SMEM_BYTES``, ``PATH_THREADS``, ``PATH_ROWS_PER_CTA``), so that the
    template restates no formula of this module."""

    def uses(self, name: str) -> bool:
        return name == "PATH" or name in self.params

    def scope(self, config: Scope, environment: Scope = {}) -> dict[str, Any]:
        """What the rules and budgets read: the environment, the defaults, then ``config``."""
        return {**environment, **self.defaults, **config}

    def smem(self, config: Scope, head_dim: int) -> int:
        """``smem_bytes`` of ``config`` (absent parameters at their defaults) at ``head_dim``."""
        return self.smem_bytes(self.scope(config), head_dim)

    def violations(self, config: Scope, environment: Scope = {}) -> list[str]:
        """The texts of the rules ``config`` breaks under ``environment``, in order (empty when valid)."""
        scope = self.scope(config, environment)
        return [rule.text for rule in self.rules if not rule(scope)]


def rule(path: str, name: str, why: str, needs: str, check: Callable[[Scope], bool]) -> Rule:
    """A ``Rule`` named ``<path>.<name>`` that reads the space-separated parameters ``needs``."""
    return Rule(f"{path}.{name}", why, tuple(needs.split()), check)


def scope_head_dims(c: Scope) -> tuple[int, ...]:
    """Every head dim of the space (``HEAD_DIMS``; a scope without it: its smallest and largest)."""
    return tuple(c["HEAD_DIMS"]) if "HEAD_DIMS" in c else (c["MIN_HEAD_DIM"], c["MAX_HEAD_DIM"])


def head_dims_rule(path: str, dims: tuple[int, ...]) -> Rule:
    """``<path>.head-dims``: every head dim of the space is one of ``dims``."""
    return rule(path, "head-dims", f"the {path} path holds head dims {', '.join(map(str, dims))}", "",
                lambda c: all(d in dims for d in scope_head_dims(c)))


def features_rule(path: str, held: tuple[str, ...]) -> Rule:
    """``<path>.features``: the path holds every kernel feature the space's shapes need
    (``FEATURES``: soft-capping, a window, packed sequences; a scope without it needs none)."""
    return rule(path, "features", f"the {path} path holds the features {', '.join(held) or 'none'}", "",
                lambda c: set(c.get("FEATURES", ())) <= set(held))
