"""Searches sharing a study race against each other's times: each successful trial stores its
timed cases, and a search reads them into the racing table its lanes share."""
from __future__ import annotations

from pathlib import Path

import optuna

from evoengineer.gpu import EvalResult
from evoengineer.search import ReplayCandidates, RunDir, open_study, run_search, tell
from evoengineer.search.loop import CASE_TIMES_KEY, RacingBests, case_times_since
from evoengineer.space import load_space

RECORDING = Path(__file__).parent / "data" / "replay_synthetic.jsonl"


def _result(key: str, times: dict[str, float]) -> EvalResult:
    cases = [{"label": label, "status": "ok", "time": {"median_us": us}} for label, us in times.items()]
    cases.append({"label": "edge", "status": "ok"})  # gated, not timed: not a racing time
    return EvalResult(config={}, key=key, status="ok", cases=cases, objective_us=min(times.values()))


def _study(tmp_path: Path, space_yaml: Path) -> tuple[optuna.Study, RunDir]:
    space = load_space(space_yaml)
    run = RunDir.create(tmp_path / "runs", space)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    return open_study(space, run, strategy="random", seed=1, storage=url, study_name="shared", resume=False), run


def test_a_successful_trial_stores_its_timed_cases_and_a_reader_takes_the_best_of_each(tmp_path: Path,
                                                                                      space_yaml: Path) -> None:
    study, _ = _study(tmp_path, space_yaml)
    for key, times in (("a", {"B1 D64": 12.0, "B1 D64 causal": 9.0}), ("b", {"B1 D64": 10.0, "B1 D64 causal": 11.0})):
        trial = study.ask()
        assert tell(study, trial, _result(key, times))
    failed = study.ask()
    assert tell(study, failed, EvalResult(config={}, key="c", status="incorrect", reason="wrong",
                                          cases=[{"label": "B1 D64", "time": {"median_us": 1.0}}]))
    assert study.trials[0].user_attrs[CASE_TIMES_KEY] == {"B1 D64": 12.0, "B1 D64 causal": 9.0}
    assert CASE_TIMES_KEY not in study.trials[2].user_attrs  # a wrong kernel's time races nobody
    after, bests = case_times_since(study, 0)
    assert bests == {"B1 D64": 10.0, "B1 D64 causal": 9.0} and after > 0
    trial = study.ask()
    tell(study, trial, _result("d", {"B1 D64": 8.0}))
    later, newer = case_times_since(study, after)
    assert newer == {"B1 D64": 8.0} and later > after  # only what came since


def test_a_racing_table_takes_other_searches_bests_and_keeps_its_own_better_ones(tmp_path: Path,
                                                                                space_yaml: Path) -> None:
    study, _ = _study(tmp_path, space_yaml)
    other = optuna.load_study(study_name="shared", storage=f"sqlite:///{tmp_path / 'shared.db'}")
    tell(other, other.ask(), _result("a", {"x": 20.0, "y": 5.0}))
    table = {"y": 4.0}
    bests = RacingBests(study, table, interval=3600)
    bests.refresh(force=True)
    assert table == {"x": 20.0, "y": 4.0}
    tell(other, other.ask(), _result("b", {"x": 15.0}))
    bests.refresh()  # within the interval: not read yet
    assert table["x"] == 20.0
    bests.refresh(force=True)
    assert table["x"] == 15.0


def test_a_search_starts_from_the_times_other_searches_recorded(tmp_path: Path, space_yaml: Path) -> None:
    study, run = _study(tmp_path, space_yaml)
    space = load_space(space_yaml)
    label = space.cases[0].label()
    other = optuna.load_study(study_name="shared", storage=f"sqlite:///{tmp_path / 'shared.db'}")
    tell(other, other.ask(), _result("elsewhere", {label: 0.5}))
    replay = ReplayCandidates(RECORDING)
    seen: list[float | None] = []

    class Racing:
        best_case_us: dict[str, float] = {}

        def evaluate(self, config, report=None):
            seen.append(self.best_case_us.get(label))
            return replay.evaluate(config, report)

    stats = run_search(space, Racing(), run, study, arch="sm_90", trials=3, build=False)
    assert stats.evaluated == 3
    assert seen and all(v == 0.5 for v in seen)  # every evaluation raced against the other search's best
