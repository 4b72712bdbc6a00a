"""Damaged runs: every command that reads a run answers a damaged file with one line
naming the file and what is wrong (exit 2), never a traceback or a silent partial
answer. Real run directories from replayed searches, real SQLite, a real full disk and
a real read-only file system (tmpfs mounts, where this process may mount)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest
from run_fixtures import recorded_keys  # noqa: E402

from evoengineer.gpu import STATUSES

REPO = Path(__file__).resolve().parent.parent
SPACE = REPO / "recordings" / "h100_mma_seed.yaml"
RECORDING = REPO / "recordings" / "h100_mma_seed.jsonl"
BUDGET = 10


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def search(run: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return cli("search", "--space", str(SPACE), "--replay", str(RECORDING), "--run-dir", str(run), "--quiet", *extra, cwd=cwd)


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The command failed with exit code 2 and one line (Optuna's own ``[I ...]`` log lines aside)."""
    err = "\n".join(line for line in proc.stderr.strip().splitlines() if not line.startswith("[I "))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and err.count("\n") == 0 and err.startswith("error: "), err
    for word in words:
        assert word in err, err
    return err


def trials_in(run: Path) -> int:
    study = optuna.load_study(study_name=run.name, storage=f"sqlite:///{run / 'study.db'}")
    return sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status") in STATUSES)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 10-evaluation run; each test damages its own copy."""
    root = tmp_path_factory.mktemp("finished")
    run = root / "run"
    done = search(run, "--trials", str(BUDGET), "--strategy", "random", cwd=root)
    assert done.returncode == 0, done.stderr + done.stdout
    return run


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def readers(run: Path, out: Path) -> list[list[str]]:
    return [["leaderboard", str(run)], ["leaderboard", str(run), "--per-shape"], ["export", str(run), "--out", str(out)],
            ["export", str(run), "--rank", "1", "--out", str(out)], ["runs", "--root", str(run.parent)]]


def test_a_record_of_the_wrong_schema_stops_resume_before_any_evaluation(run: Path, tmp_path: Path) -> None:
    lines = (run / "results.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["objective_us"] = "fast"
    lines[3] = json.dumps(record)
    (run / "results.jsonl").write_text("\n".join(lines) + "\n")
    before = trials_in(run)
    refused(search(run, "--resume", "--trials", "20", cwd=tmp_path), "results.jsonl: line 4:", "objective_us")
    assert trials_in(run) == before and len(recorded_keys(run)) == BUDGET  # nothing spent
    for args in readers(run, tmp_path / "out"):
        refused(cli(*args, cwd=tmp_path), "results.jsonl: line 4:")
    (run / "results.jsonl").write_text("\n".join([*lines[:3], "[1, 2]", *lines[4:]]) + "\n")
    refused(cli("leaderboard", str(run), cwd=tmp_path), "line 4: expected a JSON object")


READS = {  # which commands read the file (a replayed run's baseline.json is made up here; GPU runs have one)
    "run.json": {"resume", "leaderboard", "per-shape", "export", "export-rank", "runs"},
    "leaderboard.json": {"leaderboard", "export-rank"},
    "baseline.json": {"per-shape", "export", "export-rank"},
}


@pytest.mark.parametrize("name", sorted(READS))
def test_truncated_json_files_give_one_line(run: Path, tmp_path: Path, name: str) -> None:
    path = run / name
    if not path.exists():
        path.write_text(json.dumps({"B1 H8 S512 D64": {"flash": {"status": "ok", "time": {"median_us": 9.0}}}}, indent=2))
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    commands = {**dict(zip(["leaderboard", "per-shape", "export", "export-rank", "runs"], readers(run, tmp_path / "out"))),
                "resume": ["search", "--space", str(SPACE), "--replay", str(RECORDING), "--run-dir", str(run), "--resume",
                           "--quiet"]}  # last: a resume rewrites leaderboard.json
    for label, args in commands.items():
        proc = cli(*args, cwd=tmp_path)
        if label in READS[name]:
            refused(proc, f"{name}: not valid JSON")
        else:
            assert "Traceback" not in proc.stderr, (label, proc.stderr)


def test_a_corrupted_study_gives_one_line_naming_it(run: Path, tmp_path: Path) -> None:
    with (run / "study.db").open("r+b") as fh:
        fh.write(b"this is not a SQLite database" * 10)
    refused(search(run, "--resume", "--trials", "12", cwd=tmp_path), "study", "not a database")
    for args in readers(run, tmp_path / "out")[:4]:
        refused(cli(*args, cwd=tmp_path), "study.db: file is not a database")


def test_leaderboard_and_export_say_when_results_and_study_disagree(run: Path, tmp_path: Path) -> None:
    """A search killed between telling the study and writing the record (here: the last
    record cut in half): leaderboard and export refuse with one line saying so; resume
    writes the record from the study, after which they answer."""
    text = (run / "results.jsonl").read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    (run / "results.jsonl").write_text(text[: last + (len(text) - last) // 2])
    for args in readers(run, tmp_path / "out")[:4]:
        refused(cli(*args, cwd=tmp_path), "results.jsonl: lacks 1 of the 10 evaluations", "--resume")
    resumed = search(run, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert len(recorded_keys(run)) == len(set(recorded_keys(run))) == BUDGET  # repaired, nothing evaluated again
    assert trials_in(run) == BUDGET
    board = cli("leaderboard", str(run), "--json", cwd=tmp_path)
    assert board.returncode == 0 and json.loads(board.stdout)["entries"], board.stderr

    lines = (run / "results.jsonl").read_text().splitlines()  # a record the study never saw
    foreign = json.loads(lines[-1])
    foreign["key"] = "0123456789ab"
    (run / "results.jsonl").write_text("\n".join([*lines, json.dumps(foreign)]) + "\n")
    refused(cli("leaderboard", str(run), cwd=tmp_path), "holds 1 record(s) its study")


# -- real file systems: read-only and full -----------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a small tmpfs (root only); yields a function that remounts it with options."""
    point = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(point)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(point)], check=True, capture_output=True)

    try:
        yield point, remount
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_a_read_only_run_refuses_resume_in_one_line_and_still_reads(finished: Path, tmp_path: Path, tmpfs) -> None:
    point, remount = tmpfs
    run = point / "run"
    shutil.copytree(finished, run)
    remount("ro")
    refused(search(run, "--resume", "--trials", "12", cwd=tmp_path), str(run), "not writable")
    board = cli("leaderboard", str(run), "--json", cwd=tmp_path)  # checked against the study, read in place
    assert board.returncode == 0 and json.loads(board.stdout)["entries"] and not board.stderr, board.stderr
    exported = cli("export", str(run), "--rank", "1", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert exported.returncode == 0 and (tmp_path / "out" / "kernel.json").exists(), exported.stderr
    refused(cli("export", str(run), "--out", str(point / "out"), cwd=tmp_path), "Read-only file system", "read-only")


def test_a_full_disk_stops_the_search_in_one_line_and_resume_finishes_the_budget(tmp_path: Path, tmpfs) -> None:
    """A search on a file system that fills up (a 600 KiB tmpfs) stops with one line saying
    the disk is full; given room again, --resume meets the budget exactly, nothing repeated."""
    point, remount = tmpfs
    remount("size=600k")
    run, budget = point / "run", 300
    full = search(run, "--trials", str(budget), "--strategy", "random", cwd=tmp_path)
    refused(full, "disk is full")
    stopped = len(recorded_keys(run))
    assert 0 < stopped < budget, stopped
    remount("size=64m")
    resumed = search(run, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    keys = recorded_keys(run)
    assert len(keys) == len(set(keys)) == budget
    assert trials_in(run) == budget
