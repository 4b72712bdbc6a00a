"""A small safe evaluator for constraint expressions written in a space YAML.

Constraints are data: ``WARPS * 16 <= BLOCK_M``, ``PATH != 'mma' or VEC == 8``,
``max(BLOCK_M, BLOCK_N) * 2 <= SMEM_LIMIT``. The expression is parsed with Python's
``ast`` and every node is checked against a whitelist: names must be known
variables, the only calls are ``min``, ``max`` and ``abs`` and, where the space offers them,
argument-less functions of the configuration at hand (``smem_bytes()``: the kernel path's
rules in ``evoengineer.paths``), and there is no
attribute access, subscript, comprehension or lambda. Only then is it compiled,
and it is evaluated with no builtins, so a YAML file cannot run code.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs}
_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.BinOp, ast.Add, ast.Sub, ast.Mult,
    ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.IfExp, ast.Name, ast.Load, ast.Constant, ast.Call, ast.Tuple, ast.List,
)
_MAX_POW_EXPONENT = 64


class ExpressionError(ValueError):
    """The expression is not allowed or names an unknown variable."""


@dataclass(frozen=True)
class SafeExpression:
    text: str
    names: frozenset[str]
    _code: Any = field(repr=False, compare=False)
    calls: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict, repr=False, compare=False)
    """The scope functions the expression calls (each reads every parameter of the configuration)."""

    def __call__(self, variables: Mapping[str, Any]) -> Any:
        scope = dict(variables)
        bound = {name: (lambda f=f: f(scope)) for name, f in self.calls.items()}
        return eval(self._code, {"__builtins__": {}, **_FUNCTIONS, **bound}, scope)  # noqa: S307 - whitelisted AST


def parse_expression(text: str, known_names: set[str] | frozenset[str],
                     scope_functions: Mapping[str, Callable[[Mapping[str, Any]], Any]] | None = None) -> SafeExpression:
    """Check ``text`` against the whitelist and compile it; raise ExpressionError otherwise.
    ``scope_functions`` may be called without arguments; each gets the variables the expression
    is evaluated with (a trusted function of the package, never text from the file)."""
    scope_functions = scope_functions or {}
    calls: dict[str, Callable[[Mapping[str, Any]], Any]] = {}
    called: set[int] = set()  # the Name nodes that are a scope function's call
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("expected a non-empty expression string")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not a valid expression: {exc.msg}") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(f"{type(node).__name__} is not allowed in a constraint (only arithmetic, comparisons, and/or/not, min/max/abs)")
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in scope_functions and node.func.id not in _FUNCTIONS:
                if node.args or node.keywords:
                    raise ExpressionError(f"{node.func.id}() takes no arguments")
                calls[node.func.id] = scope_functions[node.func.id]
                called.add(id(node.func))
            elif not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
                allowed = sorted(_FUNCTIONS) + [f"{n}()" for n in sorted(scope_functions)]
                raise ExpressionError(f"only calls to {', '.join(allowed)} are allowed")
        elif isinstance(node, ast.Name) and id(node) in called:
            continue
        elif isinstance(node, ast.Name) and node.id not in _FUNCTIONS:
            if node.id not in known_names:
                raise ExpressionError(f"unknown name {node.id!r}{_suggest(node.id, known_names)}")
            names.add(node.id)
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool)):
            raise ExpressionError(f"constant {node.value!r} is not allowed")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, int) and 0 <= node.right.value <= _MAX_POW_EXPONENT):
                raise ExpressionError(f"'**' needs a constant integer exponent between 0 and {_MAX_POW_EXPONENT}")
    code = compile(tree, "<constraint>", "eval")
    return SafeExpression(text.strip(), frozenset(names), code, calls)


def _suggest(name: str, known: set[str] | frozenset[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
