"""``evoengineer ab`` and the measurement protocol on a real GPU: a kernel against itself reads
a ratio within a few % of 1, whichever way the two sides are made."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.resources import templates_dir
from evoengineer.space import Config, load_space

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent.parent
L4 = load_space("l4")
MMA = Config({p.name: p.values[0] for p in L4.params}).replace(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8,
                                                              P_IN_REGS=1)
SHAPE = "2,16,2048,64"


def ab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", "ab", "--space", "l4", "--config", MMA.label(),
                           "--shape", SHAPE, "--rounds", "3", "--json", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=900)


@pytest.mark.parametrize("other", [["--against", MMA.label()], ["--before", str(templates_dir())]],
                         ids=["against-itself", "same-templates"])
def test_a_configuration_against_itself_reads_one(tmp_path: Path, other: list[str]) -> None:
    done = ab(*other, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert [s["status"] for s in out["sides"]] == ["ok", "ok"]
    assert len(out["rows"]) == 2                                   # B2 H16 S2048 D64, full and causal
    for row in out["rows"]:
        ratio = row["b_over_a"]
        assert ratio["rounds"] == 3 and abs(ratio["ratio"] - 1) <= 0.03, row
        assert row["a"]["rounds"] == row["b"]["rounds"] == 3


def test_a_neighbour_in_one_parameter_is_timed_and_printed(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "evoengineer", "ab", "--space", "l4", "--config", MMA.label(),
                           "--shape", SHAPE, "--rounds", "2", "--param", "STAGES"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any(line.startswith("A: STAGES=1 ") for line in lines) and any(line.startswith("B: STAGES=2 ") for line in lines)
    assert any(line.startswith("geomean B/A over 2 cases: ") for line in lines)


def test_paired_rounds_of_one_operation_on_a_real_clock() -> None:
    """The same matmul under two names, timed by time_graph in interleaved rounds: the paired
    ratio is within a few % of 1 and the verdict does not call it slower."""
    import torch

    from evoengineer.bench import paired_ratios, ratio_verdict, run_rounds
    from evoengineer.gpu.timing import time_graph

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    ops = [lambda: a @ a]
    figures = run_rounds(["first", "second"], 4, lambda name: time_graph(ops, repetitions=30, warmup=5).median_us)
    assert [len(v) for v in figures.values()] == [4, 4]
    verdict = ratio_verdict(paired_ratios(figures["second"], figures["first"]))
    assert abs(verdict.ratio - 1) <= 0.03 and verdict.at_most, verdict


def test_retime_pairs_finalists_with_sdpa(tmp_path: Path) -> None:
    from evoengineer.bench import retime
    from evoengineer.gpu import Evaluator
    from evoengineer.kernels import arch_for_device

    space = L4.with_shapes([(2, 16, 2048, 64, 2048)])
    with Evaluator(space) as evaluator:
        evaluator.arch = arch_for_device(evaluator.info()["arch"], space.target.arch)
        report = evaluator.build(MMA)
        assert evaluator.evaluate(MMA, report).ok
        out = retime(evaluator, [report], rounds=2, backends=("flash", "cudnn"))
    assert out["failures"] == {}
    per_case = out["candidates"][MMA.key()]
    assert set(per_case) == {c.label() for c in space.cases}
    assert all(s["rounds"] == 2 and s["min_us"] <= s["median_us"] <= s["max_us"] for s in per_case.values())
    assert all(row["flash"]["rounds"] == 2 for row in out["sdpa"].values())
