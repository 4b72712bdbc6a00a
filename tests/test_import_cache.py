"""`evoengineer import-cache`: a real Kernel Tuner cache (a cut of pnpoly on an RTX 3090) as a
recording and a recorded space, replayed; recorded spaces in the space model."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from evoengineer.cli.main import main
from evoengineer.search import ReplayEvaluator
from evoengineer.search.kernel_tuner_cache import convert
from evoengineer.space import SpaceError, load_space, parse_space

DATA = Path(__file__).parent / "data"
CACHE = DATA / "kt_pnpoly_rtx3090_subset.json.gz"


def _cache() -> dict:
    return json.loads(gzip.decompress(CACHE.read_bytes()))


def test_round_trip_replays_every_entry_of_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "pnpoly.jsonl.gz"
    assert main(["import-cache", str(CACHE), "--out", str(out), "--categorical", "between_method,use_method"]) == 0
    assert "336 configurations" in capsys.readouterr().out
    replay = ReplayEvaluator(out)
    space = replay.space()
    assert space.recorded and space.param_names == ("between_method", "block_size_x", "tile_size", "use_method")
    assert not space.param("use_method").ordinal and space.param("tile_size").ordinal
    doc = _cache()
    valid = list(space.valid_configs())
    assert len(valid) == len(doc["cache"]) == 336
    for entry in doc["cache"].values():
        config = {n: entry[n] for n in doc["tune_params_keys"]}
        result = replay.evaluate(config)
        if isinstance(entry["time"], str):
            assert result.status == "launch_failed" and result.objective_us is None
        else:
            assert result.ok and result.objective_us == pytest.approx(1000 * entry["time"], rel=1e-6)
    # the space beside it loads, and a search replays it
    yaml_space = load_space(tmp_path / "pnpoly.yaml")
    assert yaml_space.recorded and yaml_space.param_names == space.param_names
    run = tmp_path / "run"
    assert main(["search", "--space", str(tmp_path / "pnpoly.yaml"), "--replay", str(out), "--trials", "12",
                 "--run-dir", str(run), "--quiet"]) in (0, 1)
    keys = [json.loads(line)["key"] for line in (run / "results.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 12


def test_conversion_is_byte_for_byte_repeatable(tmp_path: Path) -> None:
    for name in ("a", "b"):
        convert(CACHE).write(tmp_path / f"{name}.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("tune_params_keys"), "tune_params_keys: required key is missing"),
    (lambda d: d.update(objective="GFLOP/s"), "objective: 'GFLOP/s' is maximised"),
    (lambda d: next(iter(d["cache"].values())).update(tile_size=3), "is not one of tune_params.tile_size"),
    (lambda d: d.update(Results=[], Metadata={}), "KTT"),
])
def test_a_bad_cache_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, mutate, message: str) -> None:
    doc = _cache()
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["import-cache", str(bad), "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err and err.count("\n") == 1


def test_unknown_categorical_parameter_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["import-cache", str(CACHE), "--out", str(tmp_path / "x.jsonl"), "--categorical", "use_methd"]) == 2
    assert "use_methd" in capsys.readouterr().err


def test_a_recorded_space_without_its_recording_cannot_be_searched(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    convert(CACHE).write(tmp_path / "p.jsonl", tmp_path / "p.yaml")
    assert main(["search", "--space", str(tmp_path / "p.yaml"), "--trials", "3", "--run-dir", str(tmp_path / "r")]) == 2
    assert "recorded problem" in capsys.readouterr().err


def _recorded(params: dict, **extra) -> dict:
    return {"name": "r", "problem": {"kind": "recorded"}, "params": params, **extra}


def test_recorded_space_names_categorical_values_and_constraints() -> None:
    space = parse_space(_recorded({"block_size_x": [64, 32], "method": {"values": [2, 0, 1], "categorical": True}},
                                  constraints=["block_size_x * (method + 1) <= 128"]), "r.yaml")
    assert space.param("block_size_x").values == (32, 64)  # ordered values are sorted
    assert space.param("method").values == (2, 0, 1) and not space.param("method").ordinal
    assert space.param("method").steps(0) == (2, 1)  # a categorical value steps to every other
    assert space.valid_size() == 5
    narrowed = space.with_domain([{"block_size_x": 32, "method": 0}, {"block_size_x": 64, "method": 2}])
    assert [dict(c) for c in narrowed.valid_configs()] == [{"block_size_x": 32, "method": 0}]  # 64 * 3 > 128


@pytest.mark.parametrize("data, key", [
    (_recorded({"min": [1, 2]}), "params.min"),
    (_recorded({"a b": [1, 2]}), "params.a b"),
    (_recorded({"x": {"values": [1], "categorical": "yes"}}), "params.x.categorical"),
    (_recorded({"x": [1]}, template="flash_attention"), "template"),
])
def test_recorded_space_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(SpaceError) as err:
        parse_space(data, "r.yaml")
    assert err.value.key == key


def test_attention_spaces_keep_upper_case_names() -> None:
    space = load_space(DATA / "replay_small_space.yaml")
    raw = dict(space.raw)
    raw["params"] = {**raw["params"], "lower": [1]}
    with pytest.raises(SpaceError, match="UPPER_CASE"):
        parse_space(raw, "x.yaml")
