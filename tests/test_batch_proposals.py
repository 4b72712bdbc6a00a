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


@pytest.mark.parametrize("devices", [1, 8])
def test_search_on_simulated_devices_keeps_the_budget_exact(tmp_path: Path, devices: int) -> None:
    replay = ReplayCandidates(SMALL, delay_s=0.01)
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
