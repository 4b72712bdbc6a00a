"""``evoengineer ab`` without a GPU: its sides (a neighbour in one parameter, another
configuration, a git revision's templates), its interleaved rounds on an evaluator that answers
from a table of times, its table, and its command line (usage errors, no GPU, --compile-only)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.bench import (
    AbError,
    Side,
    ab_lines,
    ab_rows,
    checkout_templates,
    config_sides,
    neighbour_value,
    param_sides,
    revision_sides,
    run_ab,
)
from evoengineer.gpu import EvalResult
from evoengineer.resources import templates_dir
from evoengineer.space import Case, Config, load_space

REPO = Path(__file__).resolve().parent.parent
L4 = load_space("l4")
MMA = Config({p.name: p.values[0] for p in L4.params}).replace(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8,
                                                              P_IN_REGS=1)


def cli(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_a_parameter_pairs_the_configuration_with_its_neighbour() -> None:
    assert L4.contains(MMA)
    space, a, b = param_sides(L4, MMA, "BLOCK_N")
    assert space is L4 and (a.config, a.name) == (MMA, "BLOCK_N=64")
    assert (b.config, b.name) == (MMA.replace(BLOCK_N=128), "BLOCK_N=128")   # the next value of BLOCK_N
    assert neighbour_value(L4, MMA.replace(BLOCK_N=128), "BLOCK_N") == 64      # the last one looks back
    _, a, b = param_sides(L4, MMA, "STAGES=2")
    assert a.config == MMA and b.config == MMA.replace(STAGES=2) and b.name == "STAGES=2"
    _, a, b = param_sides(L4, MMA, "SMEM_LAYOUT=pad,swizzle")
    assert (a.config["SMEM_LAYOUT"], b.config["SMEM_LAYOUT"]) == ("pad", "swizzle")


def test_a_value_the_space_does_not_list_is_judged_by_its_constraints() -> None:
    space, _, b = param_sides(L4, MMA, "BLOCK_N=96")
    assert space.param("BLOCK_N").values == (16, 32, 64, 128, 96) and space.contains(b.config)
    assert space.param_names == L4.param_names and not L4.contains(b.config)
    with pytest.raises(AbError, match="violates"):
        param_sides(L4, MMA, "VEC=3")            # listed nowhere and against a constraint of the space


def test_sides_the_space_refuses_are_usage_mistakes() -> None:
    with pytest.raises(AbError, match="unknown parameter 'NOPE'"):
        param_sides(L4, MMA, "NOPE=1")
    with pytest.raises(AbError, match="expected NAME, NAME=B or NAME=A,B"):
        param_sides(L4, MMA, "STAGES=1,2,3")
    with pytest.raises(AbError, match="--against: .*violates"):
        config_sides(L4, MMA, MMA.replace(PATH="scalar", WARPS=1, VEC=3))
    a, b = config_sides(L4, MMA, MMA.replace(BLOCK_M=128))
    assert (a.name, b.name) == ("A", "B")


def test_a_git_revision_gives_its_templates(tmp_path: Path) -> None:
    into = tmp_path / "head"
    into.mkdir()
    checkout_templates("HEAD", into)
    names = sorted(p.name for p in into.iterdir())
    assert "flash_attention.cu.j2" in names
    assert len(names) == len([p for p in templates_dir().iterdir() if p.is_file() and p.suffix == ".j2"]) or names
    a, b = revision_sides(MMA, "HEAD", tmp_path)
    assert a.templates == tmp_path and b.templates is None and a.config == b.config == MMA
    a, _ = revision_sides(MMA, str(into), tmp_path / "unused")
    assert a.templates == into and a.name == f"before ({into})"
    with pytest.raises(AbError, match="no templates/ at git revision"):
        checkout_templates("no-such-revision-anywhere", tmp_path)
    with pytest.raises(AbError, match="not a git revision"):
        checkout_templates("--output=/tmp/x", tmp_path)


class TableEvaluator:
    """An evaluator whose gate passes or fails as told and whose timings come from ``times[side
    label]`` in call order; every call is recorded."""

    def __init__(self, cases: list[Case], times: dict[str, list[float]], gate: dict[str, str]) -> None:
        self.space = type("S", (), {"cases": tuple(cases)})()
        self.timing = {"repetitions": 30, "precision": 0.01, "warmup": 3, "flush_l2": True, "race": 1.5,
                       "give_up_above_us": 9.0}
        self.arch = "sm_89"
        self.times, self.gate = times, gate
        self.calls: list[tuple[str, str]] = []
        self.timings: list[dict] = []

    def evaluate(self, config: Config, report) -> EvalResult:
        status = self.gate.get(report.name, "ok")
        return EvalResult(config.to_dict(), config.key(), status, "" if status == "ok" else "max abs error 3",
                          cases=[{"label": "x", "max_abs_err": 1e-3}])

    def time_case(self, report, case: Case, timing: dict) -> dict:
        self.calls.append((case.label(), report.name))
        self.timings.append(timing)
        return {"status": "ok", "time": {"median_us": self.times[report.name].pop(0)}}


class Built:
    def __init__(self, name: str) -> None:
        self.name = name


def _built(space, side: Side, arch: str) -> Built:
    return Built(side.name)


def test_rounds_alternate_the_sides_on_each_case_and_pair_them() -> None:
    cases = [Case(1, 8, 512, 64, False), Case(1, 8, 512, 64, True)]
    # B is 5 % faster; the clock drops by a third in round 2 on both sides
    ev = TableEvaluator(cases, {"A": [10.0, 20.0, 15.0, 30.0, 10.0, 20.0], "B": [9.5, 19.0, 14.25, 28.5, 9.5, 19.0]}, {})
    sides = (Side("A", MMA), Side("B", MMA.replace(BLOCK_N=128)))
    measured = run_ab(ev, sides, 3, build=_built)
    assert [who for _, who in ev.calls] == ["A", "B", "A", "B", "B", "A", "B", "A", "A", "B", "A", "B"]
    assert [label for label, _ in ev.calls[:4]] == [cases[0].label(), cases[0].label(), cases[1].label(), cases[1].label()]
    assert all(t["precision"] == 0.0 and t["race"] == 0 and "give_up_above_us" not in t and t["repetitions"] == 30
               for t in ev.timings)
    rows = ab_rows(measured)
    assert [r["b_over_a"]["ratio"] for r in rows] == pytest.approx([0.95, 0.95])
    assert [r["b_over_a"]["relation"] for r in rows] == ["lower", "lower"]
    assert rows[0]["a"] == {"median_us": 10.0, "min_us": 10.0, "max_us": 15.0, "rounds": 3}
    lines = ab_lines(measured, rows)
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert lines[0].startswith("A: A  mma 64x64") and "B faster" in "\n".join(lines)
    assert lines[-1] == "geomean B/A over 2 cases: 0.950 (min 0.950, max 0.950)"


def test_a_side_that_fails_its_gate_is_not_timed() -> None:
    cases = [Case(1, 8, 512, 64, False)]
    ev = TableEvaluator(cases, {"A": [10.0, 10.1]}, {"B": "incorrect"})
    measured = run_ab(ev, (Side("A", MMA), Side("B", MMA)), 2, build=_built)
    assert [who for _, who in ev.calls] == ["A", "A"]
    assert [s["status"] for s in measured["sides"]] == ["ok", "incorrect"]
    rows = ab_rows(measured)
    assert rows[0]["b"] is None and "b_over_a" not in rows[0]
    assert "not timed" in "\n".join(ab_lines(measured, rows))


def test_help_teaches_with_examples() -> None:
    done = cli("ab", "--help")
    assert done.returncode == 0
    assert "examples:" in done.stdout and "--param BLOCK_N" in done.stdout and "--before HEAD~1" in done.stdout
    assert all(len(line) <= 80 for line in done.stdout.splitlines()), done.stdout


@pytest.mark.parametrize("args, message", [
    (["--param", "NOPE"], "error: --param: unknown parameter 'NOPE'"),
    (["--param", "STAGES", "--rounds", "0"], "error: --rounds: at least 1, got 0"),
    (["--against", "PATH=mma,BOGUS=1"], "error: --against: unknown parameter 'BOGUS'"),
    (["--before", "no-such-revision-anywhere"], "error: --before: no templates/ at git revision"),
])
def test_usage_mistakes_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = cli("ab", "--space", "l4", "--config", MMA.label(), *args)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_without_a_gpu_it_stops_at_once() -> None:
    pytest.importorskip("torch")
    from conftest import HAS_GPU

    if HAS_GPU:
        pytest.skip("a GPU is present")
    done = cli("ab", "--space", "l4", "--config", MMA.label(), "--param", "BLOCK_N", timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("error: no CUDA GPU found"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_compile_only_builds_both_sides_without_a_gpu(tmp_path: Path) -> None:
    done = cli("ab", "--space", "l4", "--config", MMA.label(), "--param", "STAGES", "--shape", "1,8,512,64",
               "--compile-only", "--json", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["compile_only"] and out["arch"] == L4.target.arch
    assert [s["name"] for s in out["sides"]] == ["STAGES=1", "STAGES=2"]
    assert all(s["status"] == "compiled" and s["registers"] > 0 for s in out["sides"]), out
    assert out["sides"][1]["smem"] > out["sides"][0]["smem"]                   # a second K/V stage in flight
