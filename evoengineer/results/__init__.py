"""What a run leaves for people: the re-timed leaderboard, the exported kernel, plots."""
from __future__ import annotations

from .export import MODULE_NAME, export_entry
from .leaderboard import LEADERBOARD, build_leaderboard, leaderboard_csv, leaderboard_table, load_leaderboard

__all__ = ["LEADERBOARD", "MODULE_NAME", "build_leaderboard", "export_entry", "leaderboard_csv",
           "leaderboard_table", "load_leaderboard"]
