"""What a run leaves for people: the re-timed leaderboard, per-shape winners, the exported
module, plots."""
from __future__ import annotations

from .export import MODULE_NAME, export_entry, export_runs, kernel_args
from .leaderboard import LEADERBOARD, build_leaderboard, leaderboard_csv, leaderboard_table, load_leaderboard
from .per_shape import (
    DISPATCH_RULE,
    ExportError,
    PerShape,
    Shape,
    config_legend,
    nearest,
    parse_label,
    per_shape_table,
    per_shape_winners,
    short_config,
)

__all__ = ["DISPATCH_RULE", "LEADERBOARD", "MODULE_NAME", "ExportError", "PerShape", "Shape", "build_leaderboard",
           "config_legend", "export_entry", "export_runs", "kernel_args", "leaderboard_csv", "leaderboard_table",
           "load_leaderboard", "nearest", "parse_label", "per_shape_table", "per_shape_winners", "short_config"]
