"""The backward as a space of its own, without a GPU: its path's rules (``paths.mma_backward``)
agree with the template and with ``backward_rules``, the built-in ``h100-backward`` space, the
errors of a backward space file, FLOPs and labels, and an export that takes a backward run's
per-case winners."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from run_fixtures import load_module, make_run

from evoengineer import paths
from evoengineer.kernels import RenderError, render
from evoengineer.kernels.backward_rules import BACKWARD_CONFIGS, BACKWARD_TEMPLATE, default_config, fits, problems
from evoengineer.resources import builtin_spaces
from evoengineer.results import export_runs
from evoengineer.results.export_backward import backward_choice, backward_runs, measured_backward, short_backward
from evoengineer.space import Case, Config, SpaceError, Variant, load_space, parse_space

D64, D64_C = "B4 H16 S2048 D64", "B4 H16 S2048 D64 causal"
D128 = "B4 H16 S2048 D128"
STRIPS = Config(PATH="mma", DKDV="strips", BLOCK_M=32, BLOCK_N=64, STAGES=2, DQ_MODE="atomic", DQ_BLOCK_M=64, DQ_BLOCK_N=64)
TILES = Config(PATH="mma", DKDV="tiles", BLOCK_M=64, BLOCK_N=128, STAGES=2, DQ_MODE="atomic", DQ_BLOCK_M=64, DQ_BLOCK_N=64)
SEPARATE = Config(PATH="mma", DKDV="tiles", BLOCK_M=64, BLOCK_N=128, STAGES=2, DQ_MODE="separate", DQ_BLOCK_M=64,
                  DQ_BLOCK_N=32)
SEPARATE_SLOW = SEPARATE.replace(DQ_BLOCK_N=128)


def _doc(**changes) -> dict:
    doc = yaml.safe_load(builtin_spaces()["h100-backward"].read_text())
    doc.update(changes)
    return doc


def test_the_backward_space_holds_exactly_the_configurations_the_rules_build() -> None:
    space = load_space("h100-backward")
    assert space.backward and not load_space("h100").backward
    valid = list(space.valid_configs())
    assert 50 < len(valid) < space.total_size()
    dims = sorted({c.head_dim for c in space.cases})
    for config in valid:
        assert all(fits(config, d, space.target.smem_per_block) for d in dims), config.label()
    # every configuration the rules refuse at some head dim of the space is left out, and vice versa
    for config in (Config({**c, "PATH": "mma"}) for c in _every_combination(space)):
        ok = all(fits(config, d, space.target.smem_per_block) for d in dims)
        assert space.contains(config) == ok, config.label()
    # narrowed to one head dim, a configuration valid there only (a D64 128x128 tile) joins
    d64 = space.with_shapes([(4, 16, 2048, 64, 2048)])
    wide = Config(PATH="mma", DKDV="tiles", BLOCK_M=128, BLOCK_N=128, STAGES=2, DQ_MODE="atomic", DQ_BLOCK_M=64, DQ_BLOCK_N=64)
    assert d64.contains(wide) and not space.contains(wide) and wide in d64.search.seeds
    # halves (S and dP by column halves) is searched beside tiles, from seeds of the sizes that spill as tiles
    halves = wide.replace(DKDV="halves")
    assert d64.contains(halves) and halves in d64.search.seeds and halves.replace(BLOCK_M=64) in space.search.seeds
    assert not space.contains(halves.replace(BLOCK_M=64, BLOCK_N=64)) and space.contains(TILES.replace(BLOCK_N=64))


def _every_combination(space):
    import itertools

    own = space.paths[0]
    for values in itertools.product(*(p.values for p in own.params)):
        yield dict(zip(own.param_names, values))


def test_the_kept_backward_configurations_obey_the_path_rules_and_the_template_refuses_what_they_refuse() -> None:
    rules = paths.get("mma", BACKWARD_TEMPLATE)
    assert rules is paths.mma_backward.PATH and rules is not paths.get("mma")
    for head_dim, named in BACKWARD_CONFIGS.items():
        for name, config in named.items():
            assert problems(config, head_dim) == [], name
    bad = STRIPS.replace(BLOCK_M=128)             # more query rows than keys a strip
    line = problems(bad, 64)[0]
    assert line.startswith("DKDV strips BLOCK_M 128 BLOCK_N 64: mma.rows:")
    with pytest.raises(RenderError):
        render(BACKWARD_TEMPLATE, bad, Variant(64, False))
    # an atomic dQ has no dQ kernel: its tile parameters stay at their defaults, so no two keys build one kernel
    assert problems(STRIPS.replace(DQ_BLOCK_N=32), 64) and not problems(STRIPS.replace(DQ_MODE="separate", DQ_BLOCK_N=32), 64)


@pytest.mark.parametrize("changes,key,fragment", [
    ({"problem": {"dtype": "fp16", "shapes": [{"B": 1, "H": 2, "S": 64, "D": 96}]}}, "problem.shapes[0].D", "got 96"),
    ({"problem": {"dtype": "fp16", "shapes": [{"B": 1, "H": 2, "S": 64, "D": 64, "softcap": 30.0}]}}, "problem.shapes",
     "no soft cap"),
    ({"paths": {"scalar": {"params": {"BLOCK_M": [64]}}}}, "paths.scalar", "no kernel path 'scalar'"),
    ({"paths": {"wgmma": {"params": {"BLOCK_M": [64], "BLOCK_N": [128], "PINGPONG": [1]}}}}, "paths.wgmma.params.PINGPONG",
     "does not use PINGPONG"),
    ({"paths": {"mma": {"params": {"WARPS": [4]}}}}, "paths.mma.params.WARPS", "does not use WARPS"),
])
def test_a_backward_space_file_that_cannot_be_built_stops_in_one_line(tmp_path: Path, changes: dict, key: str,
                                                                        fragment: str) -> None:
    doc = _doc(**changes)
    doc["search"].pop("seeds")
    with pytest.raises(SpaceError) as err:
        parse_space(doc, "train.yaml")
    assert f"train.yaml: {key}:" in str(err.value) and fragment in str(err.value) and "\n" not in str(err.value)


def test_backward_flops_and_labels() -> None:
    space = load_space("h100-backward")
    case = Case(4, 16, 2048, 64, True)
    assert space.flops(case) == pytest.approx(2.5 * case.flops()) == pytest.approx(case.backward_flops())
    assert load_space("h100").flops(case) == case.flops()
    assert TILES.short_label() == "bwdt 64x128 st2 dq=atomic"
    assert SEPARATE.short_label() == "bwdt 64x128 st2 dq=sep64x32"
    assert STRIPS.replace(STAGES=1).short_label() == "bwd 32x64 dq=atomic"
    assert TILES.replace(DKDV="halves", BLOCK_M=128).short_label() == "bwdh 128x128 st2 dq=atomic"
    assert short_backward(TILES) == "bwd tiles 64x128 st2 atomic" and short_backward(STRIPS) == "bwd 32x64 st2 atomic"
    assert short_backward(SEPARATE.replace(DKDV="halves")) == "bwd halves 64x128 st2 sep 64x32"


def _backward_run(path: Path) -> Path:
    doc = _doc()
    doc["problem"]["dtype"] = "fp16"
    doc["problem"]["shapes"] = [{"B": 4, "H": 16, "S": 2048, "D": 64, "causal": [False, True]},
                                {"B": 4, "H": 16, "S": 2048, "D": 128}]
    times = {D64: {STRIPS: 900.0, TILES: 700.0, SEPARATE: 800.0, SEPARATE_SLOW: 850.0},
             D64_C: {STRIPS: 500.0, TILES: 520.0, SEPARATE: 560.0, SEPARATE_SLOW: 540.0},
             D128: {STRIPS: 1900.0, TILES: 1500.0, SEPARATE: 1600.0}}
    return make_run(path, times, sdpa={D64: 850.0, D64_C: 450.0, D128: 1550.0}, name="train", space=doc)


def test_an_export_takes_a_backward_runs_winners_per_case_and_its_fastest_deterministic_configuration(tmp_path: Path) -> None:
    forward, backward = make_run(tmp_path / "fwd"), _backward_run(tmp_path / "bwd")
    assert backward_runs([backward, forward]) == ([forward], [backward])
    measured, exact = measured_backward([backward])
    assert {(m.shape.label(), m.config) for m in measured} == {
        (f"{D64} fp16", TILES), (f"{D64_C} fp16", STRIPS), (f"{D128} fp16", TILES)}
    assert exact == {("fp16", 64, False): SEPARATE, ("fp16", 64, True): SEPARATE_SLOW, ("fp16", 128, False): SEPARATE}
    export_runs([forward], tmp_path / "out", backward=backward_choice([], measured=measured, exact=exact))
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())["backward"]
    by_variant = {(v["dtype"], v["head_dim"], v["causal"]): v for v in info["variants"]}
    assert by_variant[("fp16", 64, False)]["fallback"] == TILES.key()
    assert by_variant[("fp16", 64, False)]["deterministic"] == SEPARATE.key()
    assert by_variant[("fp16", 64, True)]["deterministic"] == SEPARATE_SLOW.key()
    assert [c["config"] for c in by_variant[("fp16", 64, True)]["cases"]] == [STRIPS.key()]
    # D128 causal was not measured (in either dtype): the head dim's default
    assert by_variant[("fp16", 128, True)]["fallback"] == default_config(128, hopper=True).key()
    module = load_module(tmp_path / "out")
    assert module.dispatch_backward("fp16", 64, False, 4, 16, 2048, 2048) == TILES.key()
    assert module.dispatch_backward("fp16", 64, True, 4, 16, 2048, 2048, deterministic=True) == SEPARATE_SLOW.key()


def test_export_of_a_backward_run_alone_or_with_no_backward_stops_in_one_line(tmp_path: Path) -> None:
    backward = _backward_run(tmp_path / "bwd")
    forward = make_run(tmp_path / "fwd")
    for args, fragment in (([str(backward)], "export it beside a forward run"),
                           ([str(forward), str(backward), "--no-backward"], "is a backward run")):
        done = subprocess.run([sys.executable, "-m", "evoengineer", "export", *args, "--out", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and fragment in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = subprocess.run([sys.executable, "-m", "evoengineer", "export", str(forward), str(backward), "--out",
                           str(tmp_path / "both")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "both" / "kernel.json").read_text())["backward"]
    assert sum(v["measured_cases"] for v in info["variants"]) == 3


@pytest.mark.parametrize("strategy", ["evo", "tpe"])
def test_a_backward_search_replays_on_two_devices_and_resumes_as_a_forward_one(tmp_path: Path, strategy: str) -> None:
    """A backward space runs the same strategies, storage, replay and devices: 24 evaluations an
    H200 recorded (``tests/data/h200_backward_d64.jsonl``), replayed on two simulated devices."""
    recording = Path(__file__).parent / "data" / "h200_backward_d64.jsonl"
    run = tmp_path / "run"
    # the space as recorded: its mma path without DKDV halves (the wgmma path and halves came later)
    doc = _doc()
    doc["paths"].pop("wgmma")
    doc["paths"]["mma"]["params"]["DKDV"] = ["strips", "tiles"]
    doc["search"]["seeds"] = [s for s in doc["search"]["seeds"] if s.get("PATH", "mma") == "mma" and s["DKDV"] != "halves"]
    space = tmp_path / "h100-backward.yaml"
    space.write_text(yaml.safe_dump(doc))
    args = ["search", "--space", str(space), "--shape", "4,16,2048,64", "--replay", str(recording), "--strategy",
            strategy, "--trials", "40", "--devices", "0,1", "--run-dir", str(run), "--quiet"]   # 24 recorded of 140
    done = subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    resumed = subprocess.run([sys.executable, "-m", "evoengineer", "search", "--space", str(space), "--replay",
                              str(recording), "--run-dir", str(run), "--resume", "--trials", "48", "--quiet"],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    results = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    # fp16 and bf16 each a partition of the search: a configuration is evaluated once per partition
    assert len(results) == 48 and len({(r["partition"], r["key"]) for r in results}) == 48
    assert {r["partition"] for r in results} == {"D64", "D64 bf16"}
    recorded = {json.loads(line).get("key") for line in recording.read_text().splitlines()}
    ok = [r for r in results if r["status"] == "ok"]
    assert ok and {r["key"] for r in ok} <= recorded     # what the recording lacks is a status, never a time
    board = json.loads((run / "leaderboard.json").read_text())
    assert board["entries"] and all(Config(e["config"]).short_label().startswith("bwd") for e in board["entries"])
    table = subprocess.run([sys.executable, "-m", "evoengineer", "leaderboard", str(run)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    rows = [line for line in table.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert table.returncode == 0 and rows and all(" bwd" in row for row in rows), table.stderr + table.stdout
    assert "SDPA cudnn" in table.stdout, table.stdout   # the recording's fastest SDPA backward per case
