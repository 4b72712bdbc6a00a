"""Proposals in batches: distinct, claimed once across searches, the budget exact on many devices."""
from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from evoengineer.search import ReplayCandidates, ReplayEvaluator, RunDir, open_study, run_search
from evoengineer.search import optuna_internals as internals
from evoengineer.search.strategies import make_sampler, suggest_config
from evoengineer.space import Config, load_space

optuna.logging.set_verbosity(optuna.logging.WARNING)

DATA = Path(__file__).parent / "data"
SMALL = DATA / "replay_small_h100.jsonl"


def _batch_round(study: optuna.Study, space, replay: ReplayEvaluator, k: int) -> list[Config]:
    trials = [study.ask() for _ in range(k)]
    configs = [suggest_config(t, space) for t in trials]
    for trial, config in zip(trials, configs):
        result = replay.evaluate(config)
        if result.ok:
            study.tell(trial, result.objective_us)
        else:
            study.tell(trial, state=TrialState.FAIL)
    return configs


@pytest.mark.parametrize("strategy", ["evo", "random"])
@pytest.mark.parametrize("k", [4, 16])
def test_a_batch_proposes_distinct_valid_configurations(strategy: str, k: int) -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler(strategy, space, seed=3)
    sampler.batch_size = k
    study = optuna.create_study(sampler=sampler)
    taken: list[Config] = []
    for _ in range(5):
        taken += _batch_round(study, space, replay, k)
    assert len(taken) == len(set(taken)) == 5 * k
    assert all(space.contains(c) for c in taken)
    assert sampler.batch_stats["batches"] <= 5 + 1  # one model fit per batch, not per proposal
    assert sampler.batch_stats["proposals"] >= 5 * k


def test_evo_fits_the_model_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=1)
    study = optuna.create_study(sampler=sampler)
    for _ in range(12):  # past the random start
        _batch_round(study, space, replay, 1)
    searched: list[bool] = []
    fit = sampler.gp.fit

    def spy(*args, keep_hyperparameters: bool = False, **kwargs):
        searched.append(not keep_hyperparameters)
        return fit(*args, keep_hyperparameters=keep_hyperparameters, **kwargs)

    monkeypatch.setattr(sampler.gp, "fit", spy)
    sampler.batch_size = 8
    _batch_round(study, space, replay, 8)
    assert searched and searched[0] and sum(searched) == 1  # the hyperparameters are searched once


def test_two_searches_with_batches_never_share_a_configuration(tmp_path: Path) -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    studies = []
    for seed in (0, 0):  # the same seed: only the claims keep them apart
        sampler = make_sampler("evo", space, seed=seed)
        sampler.batch_size = 6
        studies.append(optuna.create_study(study_name="shared", storage=url, sampler=sampler, load_if_exists=True))
    taken: list[Config] = []
    for _ in range(4):
        for study in studies:
            taken += _batch_round(study, space, replay, 6)
    assert len(taken) == len(set(taken)) == 48


def test_background_prefetch_fills_the_queue_and_asks_pop_it() -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=2)
    study = optuna.create_study(sampler=sampler)
    for _ in range(12):
        _batch_round(study, space, replay, 1)
    sampler.prefetch(study, 8)
    sampler.wait_prefetch(timeout=60)
    assert sampler.batch_stats["background"] == 1
    queued = [p.config for p in sampler._queue]
    assert len(queued) == 8 and len(set(queued)) == 8
    before = sampler.batch_stats["batches"]
    taken = _batch_round(study, space, replay, 8)
    assert taken == queued  # the asks took the prefetched batch, in order, computing nothing
    assert sampler.batch_stats["batches"] == before


def test_two_searches_of_one_seed_prefetch_different_batches() -> None:
    """The background batch's draws depend on the search (the loop's run name), not on the seed
    alone: two searches of the same seed on one study would otherwise propose the same batches."""
    replay = ReplayEvaluator(SMALL)
    space = replay.space()

    def batch(identity: str) -> list[Config]:
        sampler = make_sampler("random", space, seed=5)
        sampler.identity = identity
        study = optuna.create_study(sampler=sampler)
        sampler.prefetch(study, 8)
        sampler.wait_prefetch(timeout=60)
        return [p.config for p in sampler._queue]

    assert batch("run-a") == batch("run-a")
    assert batch("run-a") != batch("run-b")


def _sqlite_study_of_12(tmp_path: Path) -> tuple[ReplayEvaluator, str, optuna.Study]:
    """(the small recording, a SQLite study's URL, the study: evo of seed 2, 12 trials told)."""
    from evoengineer.search import make_storage

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=make_storage(url, heartbeat_s=None), sampler=make_sampler("evo", space, seed=2),
                                study_name="s")
    for _ in range(12):
        _batch_round(study, space, replay, 1)
    return replay, url, study


def test_a_batch_process_computes_the_batch_this_process_would(tmp_path: Path) -> None:
    """The batch process's sampler (made as the search's was) reads the study from its storage
    and proposes what a sampler made the same way proposes here; the prefetched batch comes from
    it, computed nowhere in this process."""
    import random
    import time

    replay, url, study = _sqlite_study_of_12(tmp_path)
    space, sampler = replay.space(), study.sampler
    here = make_sampler("evo", space, seed=2)
    expected = [p.config for p in here.compute_batch(study, here.history(study), 8, random.Random("label"))]
    sampler.use_process(url, "s")
    try:
        deadline = time.monotonic() + 120
        while not sampler._remote.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = sampler._remote.batch(8, [], "label")
        assert rows is not None and [space.config(c) for c, _, _ in rows] == expected
        assert [space.config(c) for c, _, _ in sampler._remote.batch(4, expected[:2], "label")] != expected[:4]
        computed = sampler.batch_stats["batches"]
        sampler.prefetch(study, 8)
        sampler.wait_prefetch(timeout=60)
        queued = [p.config for p in sampler._queue]
        assert len(set(queued)) == 8 and all(space.contains(c) for c in queued)
        assert all(c is sampler._reader.intern[c] for c in queued)  # the space's own configuration objects
        assert sampler.batch_stats["batches"] == computed
    finally:
        sampler.close_process()
    assert sampler._remote is None


def test_an_ask_computes_its_own_batch_while_the_batch_process_is_slow_to_answer(tmp_path: Path) -> None:
    """A background request waiting on the batch process (stopped here with SIGSTOP, as a first
    batch that loads the study keeps it busy) holds no lock an ask needs: the ask proposes from a
    batch computed in this process, and the process's batch joins the queue when it answers."""
    import os
    import signal
    import threading
    import time

    replay, url, study = _sqlite_study_of_12(tmp_path)
    space, sampler = replay.space(), study.sampler
    sampler.batch_size = 4
    sampler.use_process(url, "s")
    child = sampler._remote._process.pid
    try:
        deadline = time.monotonic() + 120
        while not sampler._remote.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler._remote.ready
        os.kill(child, signal.SIGSTOP)
        sampler.prefetch(study, 4)
        time.sleep(0.2)
        assert sampler._background.is_alive()  # waiting for the stopped process
        computed = sampler.batch_stats["batches"]
        taken: list[Config] = []
        ask = threading.Thread(target=lambda: taken.extend(_batch_round(study, space, replay, 1)), daemon=True)
        ask.start()
        ask.join(timeout=20)
        assert not ask.is_alive() and len(taken) == 1  # it did not wait for the stopped process
        assert sampler.batch_stats["batches"] == computed + 1  # its batch, computed here
        os.kill(child, signal.SIGCONT)
        sampler.wait_prefetch(timeout=60)
        assert not sampler._background.is_alive()
        assert len(sampler._queue) == 3 + 4  # the rest of its batch, then the process's
    finally:
        os.kill(child, signal.SIGCONT)
        sampler.close_process()


@pytest.mark.parametrize("devices", [1, 8])
def test_search_on_simulated_devices_keeps_the_budget_exact(tmp_path: Path, devices: int) -> None:
    # 50 ms an evaluation: on a loaded 2-core machine 10 ms let one of 8 lanes find the budget gone
    # before its thread got the CPU
    replay = ReplayCandidates(SMALL, delay_s=0.05)
    space = load_space(DATA / "replay_small_space.yaml")
    run = RunDir.create(tmp_path, space)
    study = open_study(space, run, strategy="evo", seed=0, storage=None, study_name=None, resume=False)
    evaluators = replay.on_devices(list(range(devices))) if devices > 1 else replay
    stats = run_search(space, evaluators, run, study, arch=space.target.arch, trials=40, build=False)
    keys = [json.loads(line)["key"] for line in run.results_path.read_text().splitlines()]
    assert stats.evaluated == len(keys) == 40
    assert len(set(keys)) == 40
    assert len({d for d in stats.per_device}) == devices
    assert study.sampler.batch_size == devices


def _snapshot(history) -> tuple:
    return (frozenset(history.seen), tuple(history.complete), tuple(history.failed), history.n_trials)


def test_history_read_from_sqlite_incrementally_matches_a_full_read(tmp_path: Path) -> None:
    from optuna.study import StudyDirection

    from evoengineer.search.strategies import HistoryReader

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=4)
    sampler.batch_size = 4
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", sampler=sampler)
    incremental = HistoryReader(space.param_names)
    for round_ in range(6):
        _batch_round(study, space, replay, 4)
        running = study.ask()  # pending: its claim is all the study holds of it
        suggest_config(running, space)
        if round_ == 2:
            study.enqueue_trial(dict(replay.space().sample(1)[0]))
        seen_now = incremental._read_rdb(study, internals.rdb_backend(study), None, False)
        full = HistoryReader(space.param_names)._read_trials(study, None, study.direction == StudyDirection.MAXIMIZE)
        assert _snapshot(seen_now) == _snapshot(full)
        assert len(seen_now.seen) >= 4 * (round_ + 1) + 1


def test_a_proposal_reads_only_the_trials_new_since_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SQLite, each proposal decodes the configurations of the trials finished or started
    since the last one (not the history), and the model's rows come from the tally of those."""
    from evoengineer.search.strategies.evo import EvoSampler

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=5)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", sampler=sampler)
    full_reads: list[int] = []
    from_history = EvoSampler._rows_from_history
    monkeypatch.setattr(EvoSampler, "_rows_from_history", lambda self, h: full_reads.append(1) or from_history(self, h))
    decoded: list[int] = []
    for _ in range(150):
        before = sampler._reader.decoded
        _batch_round(study, space, replay, 1)
        decoded.append(sampler._reader.decoded - before)
    assert max(decoded) <= 1  # the trial told last, nothing older
    assert not full_reads  # the rows were never rebuilt from the whole history
    log = sampler._reader._log
    assert len(log) == 150 - 1 and sampler._tally.cursor == len(log)  # each finished trial tallied once


def test_the_tally_gives_the_rows_of_the_whole_history(tmp_path: Path) -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=6)
    sampler.batch_size = 4
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", sampler=sampler)
    for round_ in range(8):
        _batch_round(study, space, replay, 4)
        running = study.ask()  # under way: a pending row
        suggest_config(running, space)
        history = sampler.history(study)
        history.seen.add(sampler.valid[round_])  # as a batch's earlier proposal
        tallied, whole = sampler._rows_from_log(history), sampler._rows_from_history(history)
        assert tallied is not None
        for field in ("ok", "values", "complete", "failed", "free"):
            assert getattr(tallied, field).tolist() == getattr(whole, field).tolist(), field
        assert sorted(tallied.pending.tolist()) == sorted(whole.pending.tolist())


def test_a_won_claim_writes_the_trials_attribute_in_the_same_transaction(tmp_path: Path) -> None:
    from evoengineer.search.ledger import Ledger
    from evoengineer.search.strategies import CLAIM_KEY

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    first, second = study.ask(), study.ask()
    ledger = Ledger(study)
    attr = {"config": {"A": 1}, "origin": "child", "parents": []}
    assert ledger.claim_config_for("abc", first.number, internals.trial_id(first), CLAIM_KEY, attr) == (True, True)
    assert ledger.claim_config_for("abc", second.number, internals.trial_id(second), CLAIM_KEY, attr) == (False, False)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[first.number].system_attrs[CLAIM_KEY] == attr
    assert CLAIM_KEY not in trials[second.number].system_attrs
    assert ledger.get("config:abc") == {"trial": first.number}
    # a trial that holds the attribute already: the claim alone, the attribute left as it was
    internals.storage(study).set_trial_system_attr(internals.trial_id(second), CLAIM_KEY, {"config": {}})
    assert ledger.claim_config_for("xyz", second.number, internals.trial_id(second), CLAIM_KEY, attr) == (True, False)
    assert study.get_trials(deepcopy=False)[second.number].system_attrs[CLAIM_KEY] == {"config": {}}


def test_incremental_read_with_another_study_in_the_storage_matches_a_full_read(tmp_path: Path) -> None:
    """Another study's trials leave gaps in this study's trial ids (many ranges of folded ids)."""
    from optuna.study import StudyDirection

    from evoengineer.search.strategies import HistoryReader

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    url = f"sqlite:///{tmp_path / 's.db'}"
    ours = optuna.create_study(study_name="ours", storage=url, sampler=make_sampler("random", space, seed=1))
    theirs = optuna.create_study(study_name="theirs", storage=url, sampler=make_sampler("random", space, seed=2))
    incremental = HistoryReader(space.param_names)
    for round_ in range(40):
        _batch_round(ours, space, replay, 1)
        _batch_round(theirs, space, replay, 1 + round_ % 2)
        if round_ % 5 == 0:
            suggest_config(ours.ask(), space)  # left running
        now = incremental._read_rdb(ours, internals.rdb_backend(ours), None, False)
        full = HistoryReader(space.param_names)._read_trials(ours, None, ours.direction == StudyDirection.MAXIMIZE)
        assert _snapshot(now) == _snapshot(full)


def test_beyond_its_points_the_process_searches_its_hyperparameters_every_few_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from evoengineer.search.strategies import evo

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=7)
    sampler.gp.max_points = 12
    study = optuna.create_study(sampler=sampler)
    fits: list[tuple[int, bool]] = []
    fit = sampler.gp.fit

    def spy(ok, objectives, pending=None, keep_hyperparameters: bool = False):
        fits.append((len(ok) + (len(pending) if pending is not None else 0), not keep_hyperparameters))
        return fit(ok, objectives, pending, keep_hyperparameters=keep_hyperparameters)

    monkeypatch.setattr(sampler.gp, "fit", spy)
    for _ in range(80):
        _batch_round(study, space, replay, 1)
    small = [searched for points, searched in fits if points <= 12]
    large = [searched for points, searched in fits if points > 12]
    assert small and all(small)  # every fit searched while the points fit
    assert len(large) >= 2 * evo.SEARCH_EVERY
    assert 1 <= sum(large) <= len(large) // evo.SEARCH_EVERY + 1


def test_the_scan_of_a_large_space_scores_a_bounded_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    from evoengineer.search.strategies import evo

    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    sampler = make_sampler("evo", space, seed=8)
    study = optuna.create_study(sampler=sampler)
    for _ in range(15):
        _batch_round(study, space, replay, 1)
    monkeypatch.setattr(evo, "SCAN_LIMIT", 16)
    scored: list[int] = []
    best = sampler._best
    monkeypatch.setattr(sampler, "_best", lambda rows, history: scored.append(len(rows)) or best(rows, history))
    history = sampler.history(study)
    proposal = sampler.best_unseen(history)
    assert scored == [16]
    assert sampler.is_new(proposal.config, history) and proposal.origin == "model"


def test_a_won_claim_writes_the_parameters_it_is_given_and_a_lost_one_none(tmp_path: Path) -> None:
    from evoengineer.search.ledger import Ledger
    from evoengineer.search.strategies import CLAIM_KEY

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    first, second = study.ask(), study.ask()
    ledger = Ledger(study)
    choices = optuna.distributions.CategoricalDistribution([16, 32])
    params = [("A", 1.0, optuna.distributions.distribution_to_json(choices))]
    attr = {"config": {"A": 32}, "origin": "child", "parents": []}
    assert ledger.claim_config_for("abc", first.number, internals.trial_id(first), CLAIM_KEY, attr, params) == (True, True)
    assert ledger.claim_config_for("abc", second.number, internals.trial_id(second), CLAIM_KEY, attr, params) == (False, False)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[first.number].params == {"A": 32}
    assert trials[second.number].params == {}


def test_slots_are_taken_from_memory_and_read_again_when_all_look_taken(tmp_path: Path) -> None:
    from evoengineer.search.ledger import Ledger

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    mine, other = Ledger(study), Ledger(study)
    assert mine.take_slot(3, 0) == 0
    assert other.take_slot(3, 1) == 1  # behind the first ledger's back: its insert of slot 1 loses, slot 2 is next
    assert mine.take_slot(3, 2) == 2 and mine.free_after == 0
    assert mine.take_slot(3, 3) is None
    other.release_slot(1)  # another search gives a slot back: found when every slot looks taken
    assert mine.take_slot(3, 4) == 1
    assert sorted(mine.slots().items()) == [(0, 0), (1, 4), (2, 2)]


def test_a_tell_unless_the_trial_was_requeued_writes_nothing(tmp_path: Path) -> None:
    from evoengineer.search.ledger import Ledger
    from evoengineer.search.study import finish_trial

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    kept, requeued = study.ask(), study.ask()
    ledger = Ledger(study)
    assert ledger.mark_requeued(requeued.number, "another search")
    for trial in (kept, requeued):
        done = finish_trial(study, trial, TrialState.COMPLETE, 1.5, {"status": "ok"}, Ledger.requeued_key(trial.number))
        assert done == (trial is kept)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[kept.number].state == TrialState.COMPLETE and trials[kept.number].value == 1.5
    assert trials[requeued.number].state == TrialState.RUNNING and trials[requeued.number].user_attrs == {}


def test_a_new_trials_first_heartbeat_is_written_off_the_callers_thread(tmp_path: Path) -> None:
    import time

    from evoengineer.search.study import Heartbeat, make_storage

    study = optuna.create_study(storage=make_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_s=30))
    trial = study.ask()
    heartbeat = Heartbeat(study)
    try:
        heartbeat.add(internals.trial_id(trial))
        deadline = time.monotonic() + 10
        while not _has_heartbeat(study, internals.trial_id(trial)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _has_heartbeat(study, internals.trial_id(trial))  # long before the 30 s interval
    finally:
        heartbeat.close()


def _has_heartbeat(study: optuna.Study, trial_id: int) -> bool:
    from evoengineer.search.ledger import Ledger

    return trial_id in Ledger(study).heartbeats([trial_id])


def test_a_trial_created_by_table_inserts_is_numbered_and_read_as_optunas_own(tmp_path: Path) -> None:
    from evoengineer.search.study import create_running_trial

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    first = study.ask()
    made = [create_running_trial(study, {"run": "r"}) for _ in range(2)]
    last = study.ask()
    trials = {internals.trial_id(t): t for t in study.get_trials(deepcopy=False)}
    assert [trials[i].number for i in made] == [first.number + 1, first.number + 2] and last.number == first.number + 3
    assert all(trials[i].state == TrialState.RUNNING and trials[i].user_attrs == {"run": "r"} for i in made)
    trial = optuna.Trial(study, made[0])
    study.tell(trial, 2.0)
    assert internals.storage(study).get_trial(made[0]).value == 2.0


def test_a_running_trial_made_without_reading_it_back_is_the_one_in_the_study(tmp_path: Path) -> None:
    from evoengineer.search.study import running_trial

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    study.ask()
    made = running_trial(study, {"run": "r"})
    stored = internals.storage(study).get_trial(internals.trial_id(made))
    assert internals.frozen_trial(made) == stored and made.number == 1 and stored.user_attrs == {"run": "r"}
    study.tell(made, 2.0)
    assert internals.storage(study).get_trial(internals.trial_id(made)).value == 2.0
