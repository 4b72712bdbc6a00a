"""The search space: a YAML file's target, problem, parameters and constraints.

``load_space`` reads and validates a space; ``Space`` enumerates its valid
configurations, each a hashable ``Config``; ``Case`` and ``Variant`` describe the
problem shapes (with K/V heads for grouped-query attention and a K/V length for decode) and the compile-time
variants (head dim, causal, dtype) a kernel is built for.
"""
from __future__ import annotations

from .config import Config, ParamValue
from .expressions import ExpressionError, SafeExpression, parse_expression
from .model import (
    DEFAULT_TOLERANCES,
    DTYPES,
    STRATEGIES,
    Case,
    Constraint,
    Param,
    SearchSettings,
    Space,
    SpaceError,
    Target,
    Timing,
    Variant,
    format_shape,
    lengths_label,
    load_space,
    parse_duration,
    parse_shape,
    parse_space,
    path_component,
    resolve_space_path,
)

__all__ = [
    "DEFAULT_TOLERANCES", "DTYPES", "STRATEGIES", "Case", "Config", "Constraint", "ExpressionError", "Param", "ParamValue", "SafeExpression",
    "SearchSettings", "Space", "SpaceError", "Target", "Timing", "Variant", "format_shape", "lengths_label", "load_space", "parse_duration",
    "parse_expression", "parse_shape", "parse_space", "path_component", "resolve_space_path",
]
