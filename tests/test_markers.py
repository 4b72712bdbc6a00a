"""The test suite's own rules (tests/conftest.py): slow tests left out unless asked for, GPU
tests left out where there is no GPU, each with one summary line instead of a skip mark apiece."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def test_slow_tests_run_only_when_asked_for() -> None:
    from conftest import SLOW_TESTS

    slow = sorted(name.split("::")[1] for name in SLOW_TESTS if name.startswith("tests/test_search_cli.py::"))
    fast = _collect("tests/test_search_cli.py")
    assert fast.returncode == 0, fast.stdout + fast.stderr
    assert not [name for name in slow if name in fast.stdout] and "test_search_without_gpu_points_to_check" in fast.stdout
    assert f"not run: {len(slow)} tests marked slow (--slow runs them too, -m slow only them)" in fast.stdout
    only = _collect("tests/test_search_cli.py", "-m", "slow")
    assert sorted(line.split("::")[1] for line in only.stdout.splitlines() if "::" in line) == slow
    both = _collect("tests/test_search_cli.py", "--slow")
    assert all(name in both.stdout for name in slow) and "test_search_without_gpu_points_to_check" in both.stdout


def test_first_only_rules_keep_one_parametrization_in_the_fast_suite() -> None:
    fast = _collect("tests/test_check.py", "-k", "every_path")
    assert [line for line in fast.stdout.splitlines() if "::" in line] == [
        "tests/test_check.py::test_every_path_of_shipped_spaces_compiles[sm_89-l4]"]


def test_gpu_tests_are_left_out_with_one_line_where_there_is_no_gpu() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU tests run")
    out = _collect("tests/gpu/test_gate.py")
    assert "::" not in out.stdout and "tests need a CUDA GPU, none here" in out.stdout


@pytest.mark.timing
def test_timing_probe() -> None:
    """What ``test_timing_tests_skip_where_test_processes_share_the_gpu`` runs."""


def test_timing_tests_skip_where_test_processes_share_the_gpu() -> None:
    import os

    probe = "tests/test_markers.py::test_timing_probe"
    for workers, outcome in (("1", "1 passed"), ("3", "1 skipped")):
        env = {**os.environ, "PYTEST_XDIST_WORKER_COUNT": workers}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", probe],
                              capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        assert outcome in done.stdout, done.stdout + done.stderr
    assert "run alone (pytest -m timing), not beside 2 other test processes" in done.stdout
