"""What a run leaves for people: the re-timed leaderboard, the exported kernel, plots, an
HTML report, the tables every command prints."""
from __future__ import annotations

from .export import MODULE_NAME, export_entry
from .leaderboard import LEADERBOARD, build_leaderboard, leaderboard_csv, load_leaderboard
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
    runs_grid,
    search_summary_grid,
    spaces_grid,
)

__all__ = ["LEADERBOARD", "MODULE_NAME", "REPORT", "Column", "Grid", "baseline_grid", "bench_grid", "build_leaderboard",
           "check_grid", "export_entry", "grid_html", "leaderboard_csv", "leaderboard_grid", "load_leaderboard",
           "print_grid", "runs_grid", "search_summary_grid", "shape_winners", "spaces_grid", "write_report"]
