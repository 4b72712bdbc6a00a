"""The measurement protocol, in one place: interleaved rounds, paired ratios, L2 rotation,
target verdicts, tables at 80 columns; and what measures with it (the re-timing of a search's
finalists, the ``ab`` command, the benchmarks under ``benchmarks/``).

``protocol``, ``verdicts`` and ``tables`` are pure Python (no torch); the rest time through
``gpu`` (``Evaluator`` jobs, or ``gpu.timing``'s CUDA-graph replay) and import torch only
when they run.
"""
from __future__ import annotations

from .ab import (
    AbError,
    Side,
    ab_lines,
    ab_rows,
    ab_templates_dir,
    build_side,
    checkout_templates,
    config_sides,
    neighbour_value,
    param_sides,
    revision_sides,
    run_ab,
)
from .protocol import Summary, geomean, half_range, paired_ratio, paired_ratios, round_order, run_rounds, schedule
from .retime import interleaved_times, retime
from .rotation import attention_set_bytes, cold_set_count
from .tables import TextColumn, text_table
from .verdicts import NOISE_FLOOR, RatioVerdict, paired_verdict, ratio_verdict, relation

__all__ = [
    "NOISE_FLOOR", "AbError", "RatioVerdict", "Side", "Summary", "TextColumn", "ab_lines", "ab_rows", "ab_templates_dir",
    "attention_set_bytes", "build_side", "checkout_templates", "cold_set_count", "config_sides", "geomean",
    "half_range", "interleaved_times", "neighbour_value", "paired_ratio", "paired_ratios", "paired_verdict",
    "param_sides", "ratio_verdict", "relation", "retime", "revision_sides", "round_order", "run_ab", "run_rounds",
    "schedule", "text_table",
]
