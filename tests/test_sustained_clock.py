"""benchmarks/sustained_clock.py's reading of nvidia-smi's samples, and its command line (no GPU)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load_sustained_clock():
    """benchmarks/sustained_clock.py as a module (it imports ncu_profile from beside it)."""
    spec = importlib.util.spec_from_file_location("sustained_clock", REPO / "benchmarks" / "sustained_clock.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


sustained_clock = _load_sustained_clock()


def test_medians_skip_the_first_quarter_and_lines_that_are_not_readings() -> None:
    # nvidia-smi's lines while the clock settles: 1980 MHz idle, then the power limit
    lines = ["1980, 120.5", "1980, 350.0", "[N/A], [N/A]", "1620, 690.1", "1605, 698.2", "1590, 699.0", "1605, 700.3", ""]
    mhz, watts = sustained_clock.settled_medians(lines)
    # six readings: the first quarter (one) is dropped, the median of the other five is kept
    assert (mhz, watts) == (1605.0, 698.2)
    assert sustained_clock.settled_medians(["[N/A], [N/A]"]) is None
    assert sustained_clock.settled_medians([]) is None


def test_the_command_line_asks_for_something_to_time() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sustained_clock.py"), "--shape", "4,16,2048,128"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give at least one --config, --sdpa or --fa4" in done.stderr
    assert "Traceback" not in done.stderr
