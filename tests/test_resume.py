"""``--resume`` continues a run as recorded and only on its own study; a kill anywhere,
even inside resume's own recovery, loses no budget slot and repeats no evaluation.
Replayed searches (no GPU) in real subprocesses on real SQLite studies; real SIGKILLs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from run_fixtures import recorded_keys  # noqa: E402

from evoengineer.gpu import STATUSES
from evoengineer.search import Ledger

REPO = Path(__file__).resolve().parent.parent
SPACE = REPO / "recordings" / "h100_mma_seed.yaml"
RECORDING = REPO / "recordings" / "h100_mma_seed.jsonl"
SPACE_BUDGET = 100  # h100_mma_seed.yaml's search.budget: what a resume must not fall back to


def search(run: Path, *extra: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", "search", "--space", str(SPACE), "--replay", str(RECORDING),
                           "--run-dir", str(run), "--quiet", *extra], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, **(env or {})})


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == code, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and err.count("\n") == 0 and err.startswith("error: "), err
    return err


def study_of(run: Path) -> optuna.Study:
    meta = json.loads((run / "run.json").read_text())
    return optuna.load_study(study_name=meta["study_name"], storage=f"sqlite:///{run / 'study.db'}")


def evaluated(study: optuna.Study) -> list[str]:
    return [t.user_attrs["config_key"] for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status") in STATUSES]


def test_resume_keeps_the_runs_budget_and_applies_a_differing_flag_with_one_line(tmp_path: Path) -> None:
    """A 12-evaluation run resumed without flags stays at 12 (not the space's 100); resumed
    with --trials 15 --top-k 2 --strategy random it says so, one line each, and records them."""
    run = tmp_path / "run"
    first = search(run, "--trials", "12", "--strategy", "grid", "--top-k", "3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr + first.stdout
    again = search(run, "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr + again.stdout
    assert len(recorded_keys(run)) == 12 and "replaces" not in again.stdout + again.stderr
    assert "budget 12 evaluations" in again.stdout

    more = search(run, "--resume", "--trials", "15", "--top-k", "2", "--strategy", "random", cwd=tmp_path)
    assert more.returncode == 0, more.stderr + more.stdout
    said = [line for line in more.stdout.splitlines() if line.startswith("resume: ")]
    assert said == ["resume: --trials 15 replaces the run's 12", "resume: --top-k 2 replaces the run's 3",
                    "resume: --strategy random replaces the run's grid"], more.stdout
    keys = recorded_keys(run)
    assert len(keys) == len(set(keys)) == 15
    meta = json.loads((run / "run.json").read_text())
    assert (meta["trials"], meta["top_k"], meta["strategy"]) == (15, 2, "random")
    assert len(json.loads((run / "leaderboard.json").read_text())["entries"]) == 2
    assert sorted(evaluated(study_of(run))) == sorted(keys)


def test_resume_refuses_a_missing_empty_or_foreign_study(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    for path in (run, other):
        done = search(path, "--trials", "6", cwd=tmp_path)
        assert done.returncode == 0, done.stderr + done.stdout
    backup = tmp_path / "study.db.bak"
    shutil.copyfile(run / "study.db", backup)

    (run / "study.db").unlink()
    err = one_line(search(run, "--resume", "--trials", "8", cwd=tmp_path))
    assert "study.db is missing" in err and "repeat its 6 recorded" in err
    assert not (run / "study.db").exists()  # refused before creating a new one

    optuna.create_study(study_name=run.name, storage=f"sqlite:///{run / 'study.db'}")  # right name, no trials
    err = one_line(search(run, "--resume", "--trials", "8", cwd=tmp_path))
    assert "is empty" in err

    (run / "study.db").unlink()  # another run's study (its trials and user attributes), under this run's study name
    optuna.copy_study(from_study_name=other.name, from_storage=f"sqlite:///{other / 'study.db'}",
                      to_storage=f"sqlite:///{run / 'study.db'}", to_study_name=run.name)
    err = one_line(search(run, "--resume", "--trials", "8", cwd=tmp_path))
    assert "belongs to another run" in err and "other" in err

    (run / "study.db").unlink()
    shutil.copyfile(backup, run / "study.db")
    resumed = search(run, "--resume", "--trials", "8", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert len(recorded_keys(run)) == len(set(recorded_keys(run))) == 8
    assert len(recorded_keys(other)) == 6


def test_a_moved_and_a_copied_run_resume_their_own_study(tmp_path: Path) -> None:
    """run.json records the default SQLite study relative to the run directory: a moved run
    resumes it, a copy resumes its own copy and leaves the original alone."""
    original = tmp_path / "a" / "run"
    done = search(original, "--trials", "6", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads((original / "run.json").read_text())["storage"] == "sqlite:///study.db"

    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(str(original), str(moved))
    resumed = search(moved, "--resume", "--trials", "9", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert len(set(recorded_keys(moved))) == len(recorded_keys(moved)) == 9
    assert len(evaluated(study_of(moved))) == 9

    copy = tmp_path / "c" / "copy"
    shutil.copytree(moved, copy)
    resumed = search(copy, "--resume", "--trials", "12", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert len(set(recorded_keys(copy))) == len(recorded_keys(copy)) == 12
    assert recorded_keys(copy)[:9] == recorded_keys(moved)  # continued, nothing repeated
    assert len(evaluated(study_of(moved))) == 9  # the original's study untouched
    assert len(evaluated(study_of(copy))) == 12


def _kill_mid_search(run: Path, cwd: Path, budget: int) -> None:
    """Start a search slow enough to hold trials in flight, SIGKILL it after a few records."""
    proc = subprocess.Popen([sys.executable, "-m", "evoengineer", "search", "--space", str(SPACE), "--replay", str(RECORDING),
                             "--run-dir", str(run), "--trials", str(budget), "--strategy", "random", "--devices", "0,1",
                             "--replay-delay", "0.4", "--quiet"], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while len(recorded_keys(run)) < 4:
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("point", ["recover:marked", "recover:failed"])
def test_a_kill_inside_resumes_recovery_loses_no_budget_slot(tmp_path: Path, point: str) -> None:
    """Kill a search with trials in flight; resume it with a fault-injection point that
    SIGKILLs the resume inside its recovery (after marking a dead trial re-queued, or after
    failing it, before its retry is queued); resume again: the budget is met exactly, no
    configuration twice, and the study agrees with results.jsonl."""
    budget, run = 20, tmp_path / "run"
    _kill_mid_search(run, tmp_path, budget)
    running = [t for t in study_of(run).get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    assert running, "the kill left no trial in flight"

    crashed = search(run, "--resume", cwd=tmp_path, env={"EVOENGINEER_CRASH_AT": point})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr + crashed.stdout
    study = study_of(run)
    marked = Ledger(study).entries("requeued:")
    assert marked and not [t for t in study.get_trials(deepcopy=False) if t.system_attrs.get("retry_history")], \
        "the crash point did not land between marking and re-queuing"

    resumed = search(run, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    keys = recorded_keys(run)
    assert len(keys) == len(set(keys)) == budget, f"{len(keys)} of {budget}"
    study = study_of(run)
    assert sorted(evaluated(study)) == sorted(keys)
    assert len(Ledger(study).slots()) == budget
    assert not [t for t in study.get_trials(deepcopy=False) if t.state in (optuna.trial.TrialState.RUNNING,
                                                                          optuna.trial.TrialState.WAITING)]
