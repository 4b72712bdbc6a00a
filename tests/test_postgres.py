"""Searches sharing one study on a real PostgreSQL server (see the ``postgres_url`` fixture):
claims that only one process wins, and a worker killed with SIGKILL whose running trials
are found dead by their heartbeats, re-queued once and finished by the others."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
from run_fixtures import recorded_keys  # noqa: E402

from evoengineer.gpu import STATUSES
from evoengineer.search import Ledger, make_storage

DATA = Path(__file__).resolve().parent / "data"
RECORDING = DATA / "replay_synthetic.jsonl"




def test_ledger_inserts_are_won_once_across_connections(postgres_url: str) -> None:
    """Eight threads, each with its own storage (connection pool), race for one key and for
    five budget slots: one wins the key, five win a slot each."""
    name = f"ledger-{time.time_ns()}"
    optuna.create_study(study_name=name, storage=make_storage(postgres_url, None))
    barrier = threading.Barrier(8)
    won_key, slots = [], []

    def race() -> None:
        ledger = Ledger(optuna.load_study(study_name=name, storage=make_storage(postgres_url, None)))
        barrier.wait()
        if ledger.insert("config:abc", {"trial": threading.get_ident()}):
            won_key.append(1)
        slot = ledger.take_slot(5, threading.get_ident())
        if slot is not None:
            slots.append(slot)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won_key) == 1
    assert sorted(slots) == [0, 1, 2, 3, 4]


def test_four_workers_one_killed_share_a_postgres_study(tmp_path: Path, space_yaml: Path, postgres_url: str) -> None:
    """Four `search --replay` processes on one PostgreSQL study; one is killed with SIGKILL
    mid-run. Every evaluation is accounted for, none is repeated, the budget is met exactly,
    and the killed worker's running trials are re-queued and finished by the others."""
    budget, study_name = 40, f"kill-{time.time_ns()}"
    procs = []
    for i in range(4):
        args = [sys.executable, "-m", "evoengineer", "search", "--space", str(space_yaml), "--replay", str(RECORDING),
                "--trials", str(budget), "--strategy", "evo", "--seed", str(i), "--run-dir", str(tmp_path / f"run{i}"),
                "--storage", postgres_url, "--study", study_name, "--heartbeat", "1", "--replay-delay", "0.3", "--quiet"]
        procs.append(subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    victim = procs[0]
    deadline = time.time() + 120
    while len(recorded_keys(tmp_path / "run0")) < 3:
        assert victim.poll() is None, victim.stderr.read()
        assert time.time() < deadline, "the first worker recorded nothing"
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    for proc in procs[1:]:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()

    runs = [tmp_path / f"run{i}" for i in range(4)]
    keys = [k for run in runs for k in recorded_keys(run)]
    assert len(keys) == len(set(keys)), "a configuration was evaluated twice"
    assert len(keys) == budget, f"{len(keys)} evaluations recorded for a budget of {budget}"

    study = optuna.load_study(study_name=study_name, storage=postgres_url)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.user_attrs.get("status") in STATUSES]
    assert sorted(t.user_attrs["config_key"] for t in done) == sorted(keys)  # the study and the records agree
    assert not [t for t in trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]

    # the killed worker's unfinished trials failed (no status) and were each retried once, by the others
    dead = [t for t in trials if t.user_attrs.get("run") == "run0" and t.state == optuna.trial.TrialState.FAIL
            and "status" not in t.user_attrs]
    assert dead, "the killed worker left no running trial behind"
    retries = {t.system_attrs["retry_history"][-1]: t for t in trials if t.system_attrs.get("retry_history")}
    for t in dead:
        retry = retries[t.number]
        assert retry.user_attrs["run"] != "run0"
        if t.params:  # killed while evaluating: the same configuration, evaluated by another worker
            assert retry.user_attrs.get("status") in STATUSES and retry.params == t.params
        else:  # killed while asking: a new configuration, unless the budget was all taken by then
            assert retry.user_attrs.get("status") in (*STATUSES, "over budget")
    assert len(Ledger(study).slots()) == budget
    assert all(len(recorded_keys(run)) > 0 for run in runs[1:])
