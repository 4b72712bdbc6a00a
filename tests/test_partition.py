"""A search in partitions (``search.partition``): each (dtype, head dim) of a space searched on its
own valid set and budget share, in one run that ``leaderboard``, ``export`` and ``--resume``
read as any other. Replayed from a recording made here (no GPU)."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from evoengineer.cli.main import main
from evoengineer.results import load_leaderboard, per_shape_winners
from evoengineer.results.report import write_report
from evoengineer.search import RunDir, check_records
from evoengineer.search.partition import budget_shares, plan, small_shape, split_cases
from evoengineer.space import Case, Config, load_space, parse_space

SPACE = {
    "name": "parts",
    "description": "Two head dims in two dtypes; BLOCK_N 128 fits D64 only.",
    "target": {"name": "any", "arch": "sm_90", "sms": 132, "smem_per_block": 232448},
    "problem": {"dtype": ["fp16", "bf16"], "shapes": [
        {"B": 1, "H": 8, "S": 512, "D": 64, "causal": [False, True]},
        {"B": 2, "H": 8, "S": 1024, "D": 128, "causal": [False]},
    ]},
    "template": "flash_attention",
    "params": {"PATH": ["scalar", "wmma"], "BLOCK_M": [32, 64], "BLOCK_N": [32, 64, 128], "WARPS": [2, 4], "VEC": [8]},
    "constraints": ["WARPS <= BLOCK_M // 16 or PATH == 'scalar'", "BLOCK_N * MAX_HEAD_DIM <= 8192"],
    "search": {"strategy": "random", "budget": 60, "top_k": 2},
}


def _us(config: Config, label: str) -> float:
    """A made-up time: at D64 every BLOCK_N 128 configuration beats every other one; bf16 a little slower."""
    base = 100.0 if "D64" in label else 300.0
    fit = 1.0 if config["BLOCK_N"] == 128 or "D128" in label else 1.5
    spread = 1 + 0.01 * (config["BLOCK_M"] // 32) + 0.02 * config["WARPS"] + 0.05 * (config["PATH"] == "scalar") \
        + 0.003 * config["BLOCK_N"] * ("D128" in label)
    return base * fit * spread * (1.1 if "bf16" in label else 1.0)


@pytest.fixture
def recording(tmp_path: Path) -> tuple[Path, Path]:
    """(the space's YAML, a recording of every configuration valid at some head dim, each with
    the times of the cases of the head dims it is valid at)."""
    space = parse_space(SPACE, "parts.yaml")
    times: dict[Config, dict[str, float]] = {}
    for _, part in split_cases(space, "head-dim"):
        for config in part.valid_configs():
            times.setdefault(config, {}).update({c.label(): _us(config, c.label()) for c in part.cases})
    lines = [{"header": {"space_inline": SPACE, "gpu": "NVIDIA H100 80GB HBM3"}}]
    for config, cases in times.items():
        objective = math.exp(sum(map(math.log, cases.values())) / len(cases))
        lines.append({"config": config.to_dict(), "key": config.key(), "status": "ok", "objective_us": objective,
                      "cases": cases})
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    yaml_path = tmp_path / "parts.yaml"
    yaml_path.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    return yaml_path, path


def _search(space: Path, recording: Path, run: Path, *extra: str) -> int:
    return main(["search", "--space", str(space), "--replay", str(recording), "--run-dir", str(run), "--quiet",
                 "--seed", "1", *extra])


def test_budget_shares_are_even_capped_at_each_valid_set_and_pass_on_what_one_cannot_use() -> None:
    assert budget_shares(60, [21, 14, 21, 14]) == [16, 14, 16, 14]
    assert budget_shares(10, [100, 100, 100]) == [4, 3, 3]
    assert budget_shares(100, [5, 3, 100]) == [5, 3, 92]
    assert budget_shares(50, [5, 3]) == [5, 3]  # the valid sets, and no more
    assert budget_shares(2, [9, 9, 9]) == [1, 1, 0]


def test_partitions_follow_what_export_dispatches_on() -> None:
    h100 = load_space("h100")
    assert [name for name, _ in split_cases(h100, "head-dim")] == ["D64", "D128"]
    d64 = split_cases(h100, "head-dim")[0][1]
    assert [c.label() for c in d64.cases] == ["B1 H8 S512 D64", "B1 H8 S512 D64 causal", "B4 H16 S2048 D64",
                                              "B4 H16 S2048 D64 causal"]
    assert d64.valid_size() > h100.valid_size()  # configurations valid at D64 only join its search
    assert len(d64.search.seeds) > len(h100.search.seeds)  # and so do its seeds valid at D64 only
    assert [name for name, _ in split_cases(h100, "regime")] == ["D64 small", "D64", "D128"]  # the default
    small, large = (part for name, part in split_cases(h100, "regime") if name.startswith("D64"))
    assert [c.label() for c in small.cases] == ["B1 H8 S512 D64", "B1 H8 S512 D64 causal"]  # 32 tiles, 132 SMs
    assert large.valid_size() == small.valid_size() == d64.valid_size()
    bf16 = load_space("h100-bf16")
    assert [name for name, _ in split_cases(bf16, "regime")] == ["D64 small bf16", "D64 bf16", "D128 bf16"]
    assert [p.trials for p in plan(h100, "regime", h100.search.budget)] == [100, 100, 100]
    assert [name for name, _ in split_cases(h100, "shape")] == ["B1 H8 S512 D64", "B4 H16 S2048 D64", "B4 H16 S2048 D128"]
    assert [name for name, _ in split_cases(h100, "none")] == [""]
    decode = load_space("h100-decode")
    assert [name for name, _ in split_cases(decode, "head-dim")] == ["D128 decode", "D128 decode bf16", "D64 decode",
                                                                      "D64 decode bf16"]
    one = plan(h100.with_shapes([(4, 16, 2048, 64)]), "head-dim", 30)  # --shape: a search of one part, as before
    assert len(one) == 1 and one[0].name is None and one[0].trials == 30
    assert one[0].study_name("run") == "run" and plan(h100, "head-dim")[1].study_name("run") == "run:D128"


def test_a_small_shape_gives_fewer_128_row_tiles_than_the_gpu_has_sms() -> None:
    assert small_shape(Case(1, 8, 512, 64, False), 132)  # 32 tiles
    assert small_shape(Case(1, 32, 500, 128, True, heads_kv=8), 132)  # 128 tiles: S rounded up to 4 tiles
    assert not small_shape(Case(1, 33, 512, 128, False), 132)  # 132 tiles: one full wave
    assert not small_shape(Case(1, 8, 512, 64, False), 32)
    assert not small_shape(Case(2, 4, 1, 128, False, seq_kv=4096), 132)  # decode is a partition of its own
    wide = parse_space({**SPACE, "problem": {**SPACE["problem"], "shapes": [
        *SPACE["problem"]["shapes"], {"B": 4, "H": 16, "S": 2048, "D": 64, "causal": [False]}]}}, "wide.yaml")
    parts = dict(split_cases(wide, "regime"))  # only a head dim of both regimes splits
    assert list(parts) == ["D64 small", "D64", "D64 small bf16", "D64 bf16", "D128", "D128 bf16"]
    assert [c.label() for c in parts["D64 small bf16"].cases] == ["B1 H8 S512 D64 bf16", "B1 H8 S512 D64 causal bf16"]
    assert [c.label() for c in parts["D64"].cases] == ["B4 H16 S2048 D64"]
    assert list(dict(split_cases(wide, "head-dim"))) == ["D64", "D64 bf16", "D128", "D128 bf16"]


def test_each_partition_searches_its_own_valid_set_on_its_share_and_export_takes_its_winners(
        tmp_path: Path, recording: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    space_yaml, recorded = recording
    space = load_space(space_yaml)
    parts = {p.name: p for p in plan(space, "head-dim", 60)}
    assert list(parts) == ["D64", "D64 bf16", "D128", "D128 bf16"]
    assert [p.trials for p in parts.values()] == [16, 16, 14, 14]  # 15 each; D128's 14 valid ones pass on 2

    run = tmp_path / "run"
    assert _search(space_yaml, recorded, run) == 0
    meta = json.loads((run / "run.json").read_text())
    assert meta["partition"] == "regime"  # the default; each head dim's shapes are all small here
    assert [(p["name"], p["trials"]) for p in meta["partitions"]] == [(n, p.trials) for n, p in parts.items()]
    records = RunDir(run).results()
    assert Counter(r["partition"] for r in records) == {n: p.trials for n, p in parts.items()}
    for r in records:
        part = parts[r["partition"]]
        assert part.space.contains(Config(r["config"]))  # proposed from its own valid set
        assert [c["label"] for c in r["cases"]] == part.labels  # timed on its own cases
    d64 = [r for r in records if r["partition"] == "D64"]
    assert any(r["config"]["BLOCK_N"] == 128 for r in d64)  # valid at D64 only: searched there
    assert not any(r["config"]["BLOCK_N"] == 128 for r in records if "D128" in r["partition"])
    assert check_records(RunDir(run)) == ""

    per = per_shape_winners([run])
    for winner in per.winners:
        name = f"D{winner.shape.head_dim}" + ("" if winner.shape.dtype == "fp16" else " bf16")
        mine = [r for r in records if r["partition"] == name]
        best = min(mine, key=lambda r: next(c["time"]["median_us"] for c in r["cases"] if c["label"] == winner.label))
        assert per.configs[winner.config].key == best["key"], winner.label
        assert (per.configs[winner.config].config["BLOCK_N"] == 128) == (winner.shape.head_dim == 64)

    board = load_leaderboard(run)
    assert [p["name"] for p in board["partitions"]] == list(parts)
    assert [e["rank"] for e in board["entries"]] == list(range(1, 9))  # top 2 of each, numbered on
    assert [e["partition"] for e in board["entries"]] == [n for n in parts for _ in range(2)]
    capsys.readouterr()
    assert main(["leaderboard", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "D64 bf16: 2 cases" in shown and "D128: 1 case" in shown
    assert max(map(len, shown.splitlines())) <= 80
    page = write_report(run).read_text()
    best_d64 = min(r["objective_us"] for r in records if r["partition"] == "D64" and r["status"] == "ok")
    assert f"best of D64 {best_d64:.2f} µs" in page and "best of D128 bf16" in page
    assert "No importances: the search ran in 4 partitions" in page


def test_partition_none_searches_one_geometric_mean_where_d64_only_configurations_never_come(
        tmp_path: Path, recording: tuple[Path, Path]) -> None:
    space_yaml, recorded = recording
    run = tmp_path / "run"
    assert _search(space_yaml, recorded, run, "--partition", "none", "--trials", "14") == 0
    records = RunDir(run).results()
    assert len(records) == 14 and all("partition" not in r for r in records)
    assert not any(r["config"]["BLOCK_N"] == 128 for r in records)
    assert len(records[0]["cases"]) == len(load_space(space_yaml).cases)
    assert json.loads((run / "run.json").read_text())["partitions"] is None
    assert all(w.median_us >= 150 for w in per_shape_winners([run]).winners if w.shape.head_dim == 64)


def test_a_resumed_search_continues_each_partitions_budget(tmp_path: Path, recording: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    space_yaml, recorded = recording
    run = tmp_path / "run"
    assert _search(space_yaml, recorded, run, "--trials", "8") == 0
    assert Counter(r["partition"] for r in RunDir(run).results()) == {"D64": 2, "D64 bf16": 2, "D128": 2, "D128 bf16": 2}
    assert _search(space_yaml, recorded, run, "--trials", "21", "--resume") == 0
    records = RunDir(run).results()
    assert Counter(r["partition"] for r in records) == {"D64": 6, "D64 bf16": 5, "D128": 5, "D128 bf16": 5}
    for name in ("D64", "D128 bf16"):  # nothing evaluated twice within a partition
        keys = [r["key"] for r in records if r["partition"] == name]
        assert len(keys) == len(set(keys))
    assert check_records(RunDir(run)) == ""
    capsys.readouterr()
    assert _search(space_yaml, recorded, run, "--resume", "--partition", "none") == 2
    assert "--partition regime" in capsys.readouterr().err
    assert _search(space_yaml, recorded, tmp_path / "few", "--trials", "3") == 2
    assert "fewer evaluations than the 4 partitions" in capsys.readouterr().err
    assert not (tmp_path / "few").exists()


def test_a_search_killed_mid_way_resumes_every_partitions_budget(
        tmp_path: Path, recording: tuple[Path, Path]) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    space_yaml, recorded = recording
    run = tmp_path / "run"
    args = [sys.executable, "-m", "evoengineer", "search", "--space", str(space_yaml), "--replay", str(recorded),
            "--run-dir", str(run), "--trials", "24", "--strategy", "evo", "--quiet"]
    proc = subprocess.Popen([*args, "--replay-delay", "0.1"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        results = run / "results.jsonl"
        if results.exists() and len(results.read_text().splitlines()) >= 8:
            break
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = Counter(r["partition"] for r in RunDir(run).results())
    assert sum(before.values()) >= 8 and all(0 < before[name] < 6 for name in ("D64", "D64 bf16", "D128", "D128 bf16"))

    resumed = subprocess.run([*args, "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    records = RunDir(run).results()
    assert Counter(r["partition"] for r in records) == {"D64": 6, "D64 bf16": 6, "D128": 6, "D128 bf16": 6}
    assert len({(r["partition"], r["key"]) for r in records}) == 24  # none lost, none repeated
    assert check_records(RunDir(run)) == ""


def test_the_partitions_are_searched_side_by_side(tmp_path: Path, recording: tuple[Path, Path]) -> None:
    """Each ask goes to the partition that has taken the least of its budget: the records of the
    four partitions interleave from the first evaluations on, each budget still exact."""
    space_yaml, recorded = recording
    run = tmp_path / "run"
    assert _search(space_yaml, recorded, run, "--devices", "0,1") == 0
    order = [r["partition"] for r in RunDir(run).results()]
    assert set(order[:8]) == {"D64", "D64 bf16", "D128", "D128 bf16"}
    assert Counter(order) == {"D64": 16, "D64 bf16": 16, "D128": 14, "D128 bf16": 14}
