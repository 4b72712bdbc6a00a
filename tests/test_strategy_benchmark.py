"""The strategy benchmark (benchmarks/strategies.py), Kernel Tuner's replay of our recordings
(benchmarks/kernel_tuner_replay.py) and the recording tool (benchmarks/record.py), on the
recordings in tests/data: no GPU."""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml

from evoengineer.search import ReplayEvaluator
from evoengineer.space import Config

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
DATA = Path(__file__).resolve().parent / "data"
SMALL = DATA / "replay_small_h100.jsonl"
SYNTHETIC = DATA / "replay_synthetic.jsonl"


def _load(name: str, file: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_strategies", "strategies.py")
record = _load("bench_record", "record.py")
ktr = bench.ktr  # the module strategies.py replays Kernel Tuner with


# -- the benchmark's core -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_results() -> dict:
    return bench.benchmark([SMALL], strategies=["evo", "tpe", "random", "grid", "optuna-random"], seeds=3, workers=1)


def test_every_strategy_reaches_the_optimum_within_the_space(small_results: dict) -> None:
    entry = small_results["recordings"]["replay_small_h100"]
    n = entry["valid"]
    assert entry["budget"] == n == 208 and entry["within"] == {"1%": 1, "2%": 1, "5%": 1}
    for name, stats in entry["strategies"].items():
        runs = stats["reach"]["1%"]["runs"]
        assert len(runs) == (1 if name == "grid" else 3), name
        assert all(r is not None and 1 <= r <= n for r in runs), (name, runs)
        curve = np.array(stats["curve"]["median"])
        assert len(curve) == n and np.all(np.diff(curve) <= 0) and curve[-1] == pytest.approx(entry["optimum_us"])
        assert stats["reach"]["1%"]["q1"] <= stats["reach"]["1%"]["median"] <= stats["reach"]["1%"]["q3"]
    # grid is deterministic: the optimum's place in enumeration order
    replay = ReplayEvaluator(SMALL)
    order = list(replay.space().valid_configs())
    assert entry["strategies"]["grid"]["reach"]["2%"]["runs"] == [order.index(replay.optimum()[0]) + 1]
    assert set(small_results["score"]) == set(entry["strategies"])
    table = bench.table(small_results)
    assert all(len(line) <= 80 for line in table.splitlines()), table
    assert "evo *" in table and "target (evo, to 2%)" in table


def test_random_search_matches_the_analytic_expectation() -> None:
    """Uniform draws without replacement need (N + 1) / (k + 1) evaluations on average to hit
    one of k marked configurations; the median of 40 runs lies within 3.5 standard errors."""
    results = bench.benchmark([SMALL], strategies=["random"], seeds=40, workers=1)
    entry = results["recordings"]["replay_small_h100"]
    n, k = entry["valid"], entry["within"]["2%"]
    expected = (n + 1) / (k + 1)
    assert entry["random_expected"]["2%"] == pytest.approx(expected)
    runs = entry["strategies"]["random"]["reach"]["2%"]["runs"]
    assert len(set(runs)) > 20  # the seeds draw differently
    spread = 3.5 * n / (2 * math.sqrt(len(runs)))  # the median of uniform positions on 1..n
    assert abs(entry["strategies"]["random"]["reach"]["2%"]["median"] - expected) < spread


def test_calculated_random_curve() -> None:
    """The expected best of M draws without replacement: the mean at M = 1 (failures worth the
    worst success), the optimum at M = N, decreasing in between, and the mean of sampled runs."""
    rec = bench.load_recording(str(SYNTHETIC))
    n = len(rec.valid)
    curve = bench.random_expected_best(rec, n)
    values = [v if v is not None else rec.worst for v in rec.values.values()]
    assert curve[0] == pytest.approx(np.mean(values))
    assert curve[-1] == pytest.approx(rec.optimum)
    assert np.all(np.diff(curve) <= 1e-9)
    rng = np.random.default_rng(0)
    sampled = np.mean([np.minimum.accumulate(rng.permutation(values))[:20] for _ in range(4000)], axis=0)
    assert np.allclose(sampled, curve[:20], rtol=0.02)


def test_score_is_zero_for_the_calculated_baseline_and_one_at_the_optimum() -> None:
    rec = bench.load_recording(str(SMALL))
    n = len(rec.valid)
    random_curve = bench.random_expected_best(rec, n)
    at_optimum = bench.summarise(rec, [[rec.optimum]], n, random_curve)
    assert at_optimum["score"] == pytest.approx(1.0)
    start, end = bench.score_range(rec)
    assert 1 <= start <= end <= n
    worst_first = [v for v in sorted(rec.ok_values, reverse=True)]
    assert bench.summarise(rec, [worst_first], n, random_curve)["score"] < 0


def test_unknown_strategy_is_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH / "strategies.py"), "--recording", str(SMALL), "--strategies", "anneal"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: --strategies: unknown strategy 'anneal'")
    assert "Traceback" not in out.stderr


def test_without_kernel_tuner_its_strategies_are_skipped_with_a_note(tmp_path: Path) -> None:
    blocked = tmp_path / "kernel_tuner"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    out = subprocess.run([sys.executable, str(BENCH / "strategies.py"), "--recording", str(SMALL), "--seeds", "2",
                          "--strategies", "evo,kt-random_sample", "--workers", "1", "--quiet"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "note: Kernel Tuner is not installed" in out.stdout and "kt-random_sample" not in out.stdout.split("note:")[0]
    assert "evo *" in out.stdout


# -- Kernel Tuner on our recordings ------------------------------------------------------------


def test_kernel_tuner_cache_replays_the_recording(tmp_path: Path) -> None:
    pytest.importorskip("kernel_tuner")
    for path in (SMALL, SYNTHETIC):
        rec = bench.load_recording(str(path))
        cache = ktr.write_cache(rec.replay, rec.space, tmp_path / f"{path.stem}.json")
        doc = json.loads(cache.read_text())
        assert doc["tune_params_keys"] == list(rec.space.param_names) and len(doc["cache"]) == len(rec.valid)
        failed = [e for e in doc["cache"].values() if not isinstance(e["time"], float)]
        assert len(failed) == sum(v is None for v in rec.values.values())
        # brute force in Kernel Tuner's simulation mode: every configuration once, the same optimum
        trace = ktr.run_strategy(cache, rec.space, "brute_force", seed=0, budget=len(rec.valid))
        assert len(trace) == len(rec.valid)
        assert sorted(v for v in trace if v is not None) == sorted(v for v in rec.values.values() if v is not None)
        assert min(v for v in trace if v is not None) == rec.optimum
        # a stochastic strategy stays inside the space and its budget
        sampled = ktr.run_strategy(cache, rec.space, "random_sample", seed=1, budget=30)
        assert len(sampled) == 30


def test_kernel_tuner_runs_stop_at_the_repeat_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel Tuner charges only new configurations; a run that keeps revisiting cached ones is
    stopped after REPEAT_CAP evaluations per configuration of its budget, repeats included."""
    pytest.importorskip("kernel_tuner")
    rec = bench.load_recording(str(SMALL))
    cache = ktr.write_cache(rec.replay, rec.space, tmp_path / "small.json")
    assert len(ktr.run_strategy(cache, rec.space, "greedy_ils", seed=0, budget=100)) == 100
    monkeypatch.setattr(ktr, "REPEAT_CAP", 1)
    assert 0 < len(ktr.run_strategy(cache, rec.space, "greedy_ils", seed=0, budget=100)) < 100
    assert ktr.run_strategy(cache, rec.space, "brute_force", seed=0, budget=100) == []  # one batch of 208 > 100


# -- recordings from runs -----------------------------------------------------------------------


def _fake_run(run: Path, space_yaml: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    shutil.copyfile(space_yaml, run / "space.yaml")
    (run / "run.json").write_text(json.dumps({"strategy": "grid", "started": "2025-01-01T00:00:00", "finished": "2025-01-01T01:00:00"}))
    (run / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.00"}))
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"config": {"BLO')  # a line cut by a kill


def _result(config: Config, status: str, value: float | None) -> dict:
    cases = [{"label": "B1H8S512D64", "status": "ok", "time": {"median_us": value * 1.0001}}] if value else []
    return {"config": config.to_dict(), "key": config.key(), "status": status, "reason": "x" * 400 if value is None else "",
            "resources": {"registers": 96}, "cases": cases, "objective_us": value, "eval_s": 1.2}


def test_convert_runs_to_a_recording(tmp_path: Path) -> None:
    replay = ReplayEvaluator(SMALL)
    space = replay.space()
    space_yaml = tmp_path / "space.yaml"
    space_yaml.write_text(yaml.safe_dump(replay.header["space_inline"], sort_keys=False))
    valid = list(space.valid_configs())
    rows = [_result(c, "ok", replay.evaluate(c).objective_us) for c in valid]
    rows[5] = _result(valid[5], "crashed", None)
    # two runs of one shared study: the first half and the second half, one configuration twice
    _fake_run(tmp_path / "gpu0", space_yaml, rows[:110])
    _fake_run(tmp_path / "gpu1", space_yaml, rows[100:])

    out = tmp_path / "rec.jsonl.gz"
    assert record.main(["convert", str(tmp_path / "gpu0"), str(tmp_path / "gpu1"), "--out", str(out)]) == 0
    back = ReplayEvaluator(out)
    assert back.space().valid_size() == len(valid) == len(back)
    assert back.evaluate(valid[5]).status == "crashed"
    assert back.optimum()[0] == replay.optimum()[0]
    assert back.optimum()[1] == round(replay.optimum()[1], 4)  # objectives rounded to 0.1 ns
    lines = gzip.decompress(out.read_bytes()).decode().splitlines()
    header = json.loads(lines[0])["header"]
    assert header["gpu"] == "NVIDIA H100 80GB HBM3" and header["recorded"] == len(valid) == header["valid_size"]
    assert header["counts"] == {"ok": len(valid) - 1, "crashed": 1}
    first = json.loads(lines[1])
    assert [Config(json.loads(line)["config"]) for line in lines[1:]] == valid  # enumeration order
    assert set(first) == {"config", "key", "status", "reason", "objective_us", "cases"}
    assert len(json.loads(lines[6])["reason"]) == record.REASON_CHARS
    assert first["cases"] == {"B1H8S512D64": round(rows[0]["objective_us"] * 1.0001, 3)}

    # a recording that misses configurations is refused, unless asked for
    partial = tmp_path / "partial.jsonl"
    assert record.main(["convert", str(tmp_path / "gpu0"), "--out", str(partial)]) == 2
    assert not partial.exists()
    assert record.main(["convert", str(tmp_path / "gpu0"), "--out", str(partial), "--allow-missing"]) == 0
    assert len(ReplayEvaluator(partial)) == 110


def test_record_run_on_two_workers_times_each_configuration_once(tmp_path: Path) -> None:
    """``record.py run --devices 0,1``: two searches on one shared study split the space (here
    answered from a recording instead of two GPUs) and the recording holds each configuration once."""
    replay = ReplayEvaluator(SMALL)
    raw = dict(replay.header["space_inline"])
    raw["name"] = "tiny"
    raw["params"] = {**raw["params"], "PATH": ["wmma"], "VEC": [8], "BLOCK_N": [32, 64, 128]}
    space_yaml = tmp_path / "tiny.yaml"
    space_yaml.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "tiny.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH / "record.py"), "run", str(space_yaml), "--out", str(out),
                           "--devices", "0,1", "--root", str(tmp_path / "runs"), "--replay", str(SMALL), "--replay-delay", "0.2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    summary = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    back = ReplayEvaluator(out)
    valid = list(back.space().valid_configs())
    assert summary["duplicates"] == 0 and summary["missing"] == 0 and len(back) == len(valid) >= 12
    per_run = [len((tmp_path / "runs" / f"rec-tiny-gpu{d}" / "results.jsonl").read_text().splitlines()) for d in (0, 1)]
    assert sum(per_run) == len(valid) and min(per_run) > 0  # both workers took a share, none twice
    for config in valid:
        assert back.evaluate(config).objective_us == round(replay.evaluate(config).objective_us, 4)
    assert json.loads(out.read_text().splitlines()[0])["header"]["devices"] == [0, 1]


def test_record_errors_are_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH / "record.py"), "convert", str(tmp_path / "nope"), "--out", str(tmp_path / "x.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "not a run directory" in out.stderr
