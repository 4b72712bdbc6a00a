"""The sustained-clock benchmark's reading of nvidia-smi's samples and its table
(evoengineer.bench.clock), and its command line (no GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from evoengineer.bench.clock import settled_medians, sustained_lines

REPO = Path(__file__).resolve().parent.parent


def test_medians_skip_the_first_quarter_and_lines_that_are_not_readings() -> None:
    # nvidia-smi's lines while the clock settles: 1980 MHz idle, then the power limit
    lines = ["1980, 120.5", "1980, 350.0", "[N/A], [N/A]", "1620, 690.1", "1605, 698.2", "1590, 699.0", "1605, 700.3", ""]
    mhz, watts = settled_medians(lines)
    # six readings: the first quarter (one) is dropped, the median of the other five is kept
    assert (mhz, watts) == (1605.0, 698.2)
    assert settled_medians(["[N/A], [N/A]"]) is None
    assert settled_medians([]) is None


def test_the_table_divides_by_the_first_kernels_median_and_fits_80_columns() -> None:
    figures = {"SDPA cudnn": [{"us": 100.0, "mhz": 1600.0, "watts": 700.0, "mj_per_call": 70.0},
                              {"us": 102.0, "mhz": 1590.0, "watts": 699.0, "mj_per_call": 71.3}],
               "ptma 128x128 st2 r32/232 ovl pp " + "o" * 60: [{"us": 95.0, "mhz": None, "watts": None, "mj_per_call": None}]}
    lines = sustained_lines(figures)
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split() == ["kernel", "µs", "÷cudnn", "MHz", "W", "mJ"]
    assert lines[1].split()[-5:] == ["100.0", "0.990", "1600", "700", "70.0"]    # ÷ the median, 101 µs
    assert lines[2].split() == ["102.0", "1.010", "1590", "699", "71.3"]
    assert lines[3].split()[-5:] == ["95.0", "0.941", "-", "-", "-"]


def test_the_command_line_asks_for_something_to_time() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sustained_clock.py"), "--shape", "4,16,2048,128"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give at least one --config, --sdpa or --fa4" in done.stderr
    assert "Traceback" not in done.stderr
