"""A small safe evaluator for constraint expressions written in a space YAML.

Constraints are data: ``WARPS * 16 <= BLOCK_M``, ``PATH != 'mma' or VEC == 8``,
``max(BLOCK_M, BLOCK_N) * 2 <= SMEM_LIMIT``. The expression is parsed with Python's
``ast`` and every node is checked against a whitelist: names must be known
variables, the only calls are ``min``, ``max`` and ``abs`` and, where the space offers them,
argument-less functions of the configuration at hand (``smem_bytes()``: the kernel path's
rules in ``evoengineer.paths``), and there is no
attribute access, subscript, comprehension or lambda. Only then is it compiled,
and it is evaluated with no builtins, so a YAML file cannot run code.

It is also bounded: the text is at most ``MAX_LENGTH`` characters and ``MAX_DEPTH``
nodes deep, ``*`` and ``**`` refuse to build an integer of more than ``MAX_BITS`` bits
(or to repeat a string or list), and every sub-expression without variables is
evaluated once at parse time, so ``BLOCK_M / 0`` or ``(9**64)**64 > 0`` fail when the
space is loaded. An evaluation that fails (a division by zero that only some values
reach, comparing a string with a number) raises ``ExpressionError``, one line.
"""
from __future__ import annotations

import ast
import reprlib
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
MAX_LENGTH = 2000
"""Characters of one expression (the longest built-in constraint has under 200)."""
MAX_DEPTH = 64
"""Nesting depth of one expression's syntax tree."""
MAX_BITS = 1024
"""The largest integer ``*`` or ``**`` may produce, in bits."""
_POW, _MUL = "__evo_pow", "__evo_mul"  # not valid names in a space: the whitelist sees only the user's tree


class ExpressionError(ValueError):
    """The expression is not allowed, names an unknown variable, or cannot be evaluated
    (then ``expression`` is the text of the one that failed)."""

    def __init__(self, message: str, expression: str | None = None) -> None:
        super().__init__(message)
        self.expression = expression


def quote(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, on one line, never building a
    huge string first (a YAML alias can make a list of billions of items)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    short.maxlevel = 3
    text = short.repr(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _checked_pow(base: Any, exponent: Any) -> Any:
    if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > MAX_BITS:
        raise ExpressionError(f"'** {exponent}' makes an integer larger than {MAX_BITS} bits")
    return base ** exponent


def _checked_mul(a: Any, b: Any) -> Any:
    if isinstance(a, (str, list, tuple)) or isinstance(b, (str, list, tuple)):
        raise ExpressionError("'*' multiplies numbers only (no repeated strings or lists)")
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_BITS:
        raise ExpressionError(f"'*' makes an integer larger than {MAX_BITS} bits")
    return a * b


_GLOBALS = {"__builtins__": {}, **_FUNCTIONS, _POW: _checked_pow, _MUL: _checked_mul}


@dataclass(frozen=True)
class SafeExpression:
    text: str
    names: frozenset[str]
    _code: Any = field(repr=False, compare=False)
    calls: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict, repr=False, compare=False)
    """The scope functions the expression calls (each reads every parameter of the configuration)."""

    def __reduce__(self) -> tuple:
        """Pickled as its text, parsed again where it is loaded (a code object does not pickle)."""
        return (parse_expression, (self.text, self.names, dict(self.calls)))

    def __call__(self, variables: Mapping[str, Any]) -> Any:
        try:
            scope = dict(variables)
            bound = {name: (lambda f=f: f(scope)) for name, f in self.calls.items()}
            return eval(self._code, {**_GLOBALS, **bound}, scope)  # noqa: S307 - whitelisted, bounded AST
        except ExpressionError as exc:
            raise ExpressionError(f"{quote(self.text)}: {exc}{_at(self.names, variables)}", self.text) from None
        except (ArithmeticError, TypeError, ValueError, MemoryError, RecursionError) as exc:
            raise ExpressionError(f"{quote(self.text)}: {_why(exc)}{_at(self.names, variables)}", self.text) from None


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return quote(text, 120).strip("'\"") if len(text) > 120 else text


def _at(names: frozenset[str], variables: Mapping[str, Any]) -> str:
    values = ", ".join(f"{n}={quote(variables[n], 20)}" for n in sorted(names) if n in variables)
    return f" (at {values})" if values else ""


class _Bound(ast.NodeTransformer):
    """``a ** b`` and ``a * b`` become calls of the size-checked functions."""

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        name = _POW if isinstance(node.op, ast.Pow) else _MUL if isinstance(node.op, ast.Mult) else None
        if name is None:
            return node
        return ast.copy_location(ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=[node.left, node.right], keywords=[]), node)


def _depth(tree: ast.AST) -> int:
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def parse_expression(text: str, known_names: set[str] | frozenset[str],
                     scope_functions: Mapping[str, Callable[[Mapping[str, Any]], Any]] | None = None) -> SafeExpression:
    """Check ``text`` against the whitelist and the bounds and compile it; raise
    ExpressionError otherwise (also when a part without variables cannot be evaluated).
    ``scope_functions`` may be called without arguments; each gets the variables the expression
    is evaluated with (a trusted function of the package, never text from the file)."""
    scope_functions = scope_functions or {}
    calls: dict[str, Callable[[Mapping[str, Any]], Any]] = {}
    called: set[int] = set()  # the Name nodes that are a scope function's call
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("expected a non-empty expression string")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression is {len(text)} characters long; at most {MAX_LENGTH}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not a valid expression: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ExpressionError(f"expression is nested too deeply (at most {MAX_DEPTH} levels)") from None
    if _depth(tree) > MAX_DEPTH:
        raise ExpressionError(f"expression is nested too deeply (at most {MAX_DEPTH} levels)")
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
                raise ExpressionError(f"unknown name {quote(node.id)}{_suggest(node.id, known_names)}")
            names.add(node.id)
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool)):
            raise ExpressionError(f"constant {quote(node.value)} is not allowed")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, int) and 0 <= node.right.value <= _MAX_POW_EXPONENT):
                raise ExpressionError(f"'**' needs a constant integer exponent between 0 and {_MAX_POW_EXPONENT}")
    _fold_constants(tree)
    try:
        code = compile(ast.fix_missing_locations(_Bound().visit(tree)), "<constraint>", "eval")
    except (RecursionError, MemoryError, ValueError):
        raise ExpressionError(f"expression is nested too deeply (at most {MAX_DEPTH} levels)") from None
    return SafeExpression(text.strip(), frozenset(names), code, calls)


def _fold_constants(tree: ast.Expression) -> None:
    """Evaluate, within the bounds, every sub-expression that names no variable, and every
    divisor: a constant part that cannot be computed, or a divisor that is the constant 0,
    is an error when the space loads rather than in the middle of a search."""
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            divisor = _constant_value(node.right)
            if divisor is not _UNKNOWN and not isinstance(divisor, str) and divisor == 0:
                raise ExpressionError(f"division by zero: {quote(ast.unparse(node), 60)}")
        if isinstance(node, ast.expr) and not isinstance(node, (ast.Constant, ast.Name)) and not _names_in(node):
            _constant_value(node)


_UNKNOWN = object()


def _names_in(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id not in _FUNCTIONS for n in ast.walk(node))


def _constant_value(node: ast.AST) -> Any:
    """The value of a variable-free ``node`` (raises ExpressionError when it fails), or
    ``_UNKNOWN`` when it names a variable."""
    if _names_in(node):
        return _UNKNOWN
    expression = ast.fix_missing_locations(_Bound().visit(ast.Expression(body=_copy(node))))
    try:
        return eval(compile(expression, "<constraint>", "eval"), dict(_GLOBALS), {})  # noqa: S307 - whitelisted, bounded AST
    except ExpressionError as exc:
        raise ExpressionError(f"{quote(ast.unparse(node), 60)}: {exc}") from None
    except (ArithmeticError, TypeError, ValueError, MemoryError, RecursionError) as exc:
        raise ExpressionError(f"{quote(ast.unparse(node), 60)}: {_why(exc)}") from None


def _copy(node: ast.AST) -> ast.AST:
    import copy

    return copy.deepcopy(node)


def _suggest(name: str, known: set[str] | frozenset[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name[:100], sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
