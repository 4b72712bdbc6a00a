"""What a run leaves for people: the re-timed leaderboard, per-shape winners, the exported
module, plots, an HTML report, the tables every command prints."""
from __future__ import annotations

from .export import MODULE_NAME, export_entry, export_runs, kernel_args
from .leaderboard import LEADERBOARD, build_leaderboard, leaderboard_csv, load_leaderboard, merge_boards
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
from .report import REPORT, shape_winners, write_report
from .tables import (
    Column,
    Grid,
    baseline_grid,
    bench_grid,
    check_grid,
    grid_html,
    leaderboard_grid,
    print_grid,
    profile_grid,
    runs_grid,
    search_summary_grid,
    spaces_grid,
)

__all__ = [
    "DISPATCH_RULE", "LEADERBOARD", "MODULE_NAME", "REPORT", "Column", "ExportError", "Grid", "PerShape", "Shape",
    "baseline_grid", "bench_grid", "build_leaderboard", "check_grid", "config_legend", "export_entry", "export_runs",
    "grid_html", "kernel_args", "leaderboard_csv", "leaderboard_grid", "load_leaderboard", "merge_boards", "nearest", "parse_label",
    "per_shape_table", "per_shape_winners", "print_grid", "profile_grid", "runs_grid", "search_summary_grid", "shape_winners",
    "short_config", "spaces_grid", "write_report",
]
