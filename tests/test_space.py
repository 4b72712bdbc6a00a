from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.resources import builtin_spaces
from evoengineer.space import Config, SpaceError, load_space, parse_duration, resolve_space_path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


# -- resolution ------------------------------------------------------------------


def test_builtin_names_resolve(tmp_path: Path) -> None:
    assert resolve_space_path("l4", tmp_path) == builtin_spaces()["l4"]
    assert resolve_space_path("h100", tmp_path) == builtin_spaces()["h100"]


def test_spaces_prefix_falls_back_to_builtin(tmp_path: Path) -> None:
    assert resolve_space_path("spaces/l4.yaml", tmp_path) == builtin_spaces()["l4"]


def test_existing_file_wins_over_builtin(tmp_path: Path) -> None:
    local = tmp_path / "spaces" / "l4.yaml"
    local.parent.mkdir()
    local.write_text((REPO / "search_spaces" / "l4.yaml").read_text().replace("budget: 60", "budget: 7"))
    assert resolve_space_path("spaces/l4.yaml", tmp_path) == local
    assert load_space("spaces/l4.yaml", tmp_path).search.budget == 7


def test_unknown_name_lists_builtins(tmp_path: Path) -> None:
    with pytest.raises(SpaceError) as err:
        resolve_space_path("l5", tmp_path)
    assert "l4" in str(err.value) and "h100" in str(err.value)


# -- schema errors: one line naming file and key ------------------------------------


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (lambda d: d["params"].update(BLOCK_M="abc"), "params.BLOCK_M", "non-empty list"),
        (lambda d: d["params"].update(BLOCK_M=[]), "params.BLOCK_M", "non-empty list"),
        (lambda d: d.update(timming={}), "timming", "did you mean 'timing'"),
        (lambda d: d["target"].update(smem_per_blok=1), "target.smem_per_blok", "did you mean 'smem_per_block'"),
        (lambda d: d["target"].update(sms="many"), "target.sms", "expected an integer"),
        (lambda d: d["target"].update(arch="ampere"), "target.arch", "sm_89"),
        (lambda d: d.update(constraints=["WARPS <= 4", "BLOCKM <= 64"]), "constraints[1]", "did you mean 'BLOCK_M'"),
        (lambda d: d["search"].update(seeds=[{"BLOCK_M": 96}]), "search.seeds[0].BLOCK_M", "not one of"),
        (lambda d: d["search"].update(seeds=[{"PATH": "wmma", "BLOCK_M": 16, "WARPS": 8}]), "search.seeds[0]", "outside the space"),
        (lambda d: d["search"].update(strategy="evolution"), "search.strategy", "evo"),
        (lambda d: d["search"].update(time="ten minutes"), "search.time", "duration"),
        (lambda d: d["problem"]["shapes"][0].update(D=72), "problem.shapes[0].D", "head dim"),
        (lambda d: d["tolerances"].update(atol=-1), "tolerances.atol", "positive"),
        (lambda d: d.setdefault("timing", {}).update(precision=-0.01), "timing.precision", ">= 0"),
        (lambda d: d.setdefault("timing", {}).update(min_time_ms=20), "timing.min_time_ms", "unknown key"),
        (lambda d: d.pop("params"), "params", "missing"),
    ],
)
def test_schema_errors_name_file_and_key(space_file, edit, key, words) -> None:
    path = space_file(edit)
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.key == key
    assert words in str(err.value)
    assert str(err.value).startswith(f"{path}: {key}: ") or str(err.value).startswith(f"{path.name}: {key}: ")
    assert "\n" not in str(err.value)


def test_malformed_yaml_gives_line_and_column(space_file) -> None:
    path = space_file(text="target:\n  name: x\n  arch: [sm_90\nparams: {}\n")
    with pytest.raises(SpaceError, match=r"line \d+, column \d+"):
        load_space(path)


def test_cli_error_is_one_line_exit_2(space_file) -> None:
    path = space_file(lambda d: d["params"].update(BLOCK_M="abc"))
    proc = run_cli("check", "--space", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == f"error: {path}: params.BLOCK_M: expected a non-empty list of integers or strings, got 'abc'"
    assert "Traceback" not in proc.stderr


def test_cli_unknown_space_exit_2(tmp_path: Path) -> None:
    proc = run_cli("check", "--space", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "built-in spaces: gemma2-9b, h100, h100-backward, h100-bf16, h100-decode, l4, llama3-8b, mistral-7b, phi3-mini, qwen2.5-7b" in proc.stderr


# -- constraints are data ------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch {marker}')",
        "BLOCK_M.__class__ == 1",
        "(lambda: 1)() == 1",
        "[x for x in (1, 2)] == [1, 2]",
        "open('{marker}', 'w') is None",
        "BLOCK_M ** BLOCK_N > 0",
        "PATH[0] == 's'",
    ],
)
def test_constraint_code_is_rejected_and_nothing_runs(space_file, tmp_path: Path, expr: str) -> None:
    marker = tmp_path / "pwned"
    path = space_file(lambda d: d.update(constraints=["WARPS <= 4", expr.format(marker=marker)]))
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.key == "constraints[1]"
    assert not marker.exists()


def test_constraints_allow_arithmetic_min_max(space_file) -> None:
    path = space_file(lambda d: d["constraints"].append("max(BLOCK_M, BLOCK_N) // min(BLOCK_M, BLOCK_N) <= 4 and PATH in ('scalar', 'wmma', 'mma')"))
    space = load_space(path)
    for config in space.valid_configs():
        big, small = max(config["BLOCK_M"], config["BLOCK_N"]), min(config["BLOCK_M"], config["BLOCK_N"])
        assert big // small <= 4


# -- enumeration -------------------------------------------------------------------


def test_valid_configs_match_brute_force() -> None:
    space = load_space(REPO / "tests" / "data" / "l4_flat.yaml")
    valid = set(space.valid_configs())
    env = space.environment()
    import itertools

    brute = set()
    for values in itertools.product(*(p.values for p in space.params)):
        cfg = dict(zip(space.param_names, values))
        # plain Python evaluation of the constraint texts, independent of the safe evaluator
        if all(eval(c.text, {"min": min, "max": max, "abs": abs}, env | cfg) for c in space.constraints):
            brute.add(Config(cfg))
    assert valid == brute
    assert 0 < len(valid) < space.total_size()
    for cfg in valid:
        assert space.contains(cfg)
        assert not (cfg["PATH"] == "wmma" and cfg["WARPS"] * 16 > cfg["BLOCK_M"])


def test_neighbours_are_valid_and_one_step_away() -> None:
    space = load_space("h100")
    seed = space.search.seeds[0]
    near = space.neighbours(seed)
    assert near and all(space.contains(n) for n in near)
    for n in near:
        if n["PATH"] != seed["PATH"]:  # another path: the parameters both use keep their values where they can
            other = space.path_space(n["PATH"])
            assert all(n[k] == seed[k] for k in set(n) & set(seed) - {"PATH"} if seed[k] in other.param(k).values)
            continue
        changed = [k for k in seed if seed[k] != n[k]]
        assert len(changed) == 1 and set(n) == set(seed)
        p = space.path_space(seed["PATH"]).param(changed[0])
        if p.ordinal:
            assert abs(p.values.index(seed[changed[0]]) - p.values.index(n[changed[0]])) == 1
    wgmma = next(s for s in space.search.seeds if s["PATH"] == "wgmma")
    assert "WARPS" not in wgmma and all("WARPS" not in n for n in space.neighbours(wgmma) if n["PATH"] == "wgmma")


def test_seeds_are_in_the_space() -> None:
    for name in ("l4", "h100"):
        space = load_space(name)
        assert space.search.seeds and all(space.contains(s) for s in space.search.seeds)
        narrowed = [space.with_shapes([shape]) for shape in dict.fromkeys(c.shape for c in space.cases)]
        for seed in space.search.listed_seeds:  # each valid in the space, or where it is narrowed to a head dim
            assert any(seed in s.search.seeds for s in [space, *narrowed]), seed.label()


def test_a_seed_valid_at_one_head_dim_joins_searches_narrowed_to_it() -> None:
    """h100 lists a 192x128 tile whose accumulators fit 160 registers at D64 only: the whole space
    (D64 and D128) leaves it out of its seeds, a space narrowed to a D64 shape takes it, in the file's
    order, and one narrowed to D128 does not."""
    space = load_space("h100")
    d64_only = [s for s in space.search.listed_seeds if s not in space.search.seeds]
    assert d64_only and all(s["BLOCK_N"] == 128 and s["REG_CONSUMER"] == 160 and s["CONSUMER_WGS"] == 3 for s in d64_only)
    assert all(any(v.startswith("wgmma.consumer-registers:") for v in space.violations(s)) for s in d64_only)
    d64, d128 = space.with_shapes([(4, 16, 2048, 64)]), space.with_shapes([(4, 16, 2048, 128)])
    assert d64.search.seeds == tuple(s for s in space.search.listed_seeds if d64.contains(s))
    assert set(d64_only) <= set(d64.search.seeds) and set(space.search.seeds) <= set(d64.search.seeds)
    assert d128.search.seeds == space.search.seeds
    assert not set(d64_only) & set(space.with_shapes([], [(8, 16, 4096, 128)]).search.seeds)
    # another arch drops the wgmma seeds with the path itself
    assert {s["PATH"] for s in space.for_arch("sm_89").search.seeds} == {"scalar", "wmma", "mma"}


def test_a_seed_outside_the_space_at_every_head_dim_is_refused(space_file) -> None:
    def edit(d: dict) -> None:
        d["problem"]["shapes"].append({"B": 1, "H": 8, "S": 512, "D": 128, "causal": [False, True]})
        d["search"]["seeds"] = [{"PATH": "wmma", "BLOCK_M": 16, "WARPS": 8}]

    with pytest.raises(SpaceError) as err:
        load_space(space_file(edit))
    assert "search.seeds[0]: seed is outside the space at every head dim" in str(err.value)


def test_shipped_shapes() -> None:
    l4, h100 = load_space("l4"), load_space("h100")
    assert (l4.target.arch, l4.target.sms, h100.target.arch, h100.target.sms) == ("sm_89", 58, "sm_90a", 132)
    labels = {c.label() for c in h100.cases}
    assert {"B1 H8 S512 D64", "B4 H16 S2048 D64", "B4 H16 S2048 D128 causal"} <= labels
    assert {"B1 H8 S512 D64", "B1 H8 S512 D64 causal"} <= {c.label() for c in l4.cases}


def test_enumeration_prunes_without_losing_or_adding_configurations() -> None:
    import itertools

    space = load_space(REPO / "tests" / "data" / "l4_flat.yaml")  # a flat space: pruning against the plain product
    env = space.environment()
    brute = [dict(zip(space.param_names, values)) for values in itertools.product(*(p.values for p in space.params))
             if all(c.expression({**env, **dict(zip(space.param_names, values))}) for c in space.constraints)]
    assert [dict(c) for c in space.valid_configs()] == brute


def test_wgmma_needs_sm_90a_and_other_archs_drop_it() -> None:
    h100 = load_space("h100")
    paths = {c["PATH"] for c in h100.valid_configs()}
    assert paths == {"scalar", "wmma", "mma", "wgmma"}
    for arch in ("sm_90", "sm_89"):
        retargeted = h100.for_arch(arch)
        assert retargeted.target.arch == arch
        assert "wgmma" not in {c["PATH"] for c in retargeted.valid_configs()}
    assert all(c["BLOCK_M"] == 64 * c["CONSUMER_WGS"] for c in h100.valid_configs() if c["PATH"] == "wgmma")


@pytest.mark.parametrize("raw, seconds", [("90s", 90), ("15m", 900), ("1h30m", 5400), (45, 45)])
def test_parse_duration(raw, seconds) -> None:
    assert parse_duration(raw) == seconds


def test_config_hash_and_parse() -> None:
    a = Config(BLOCK_M=64, PATH="wmma")
    assert a == Config(PATH="wmma", BLOCK_M=64) and hash(a) == hash(Config(PATH="wmma", BLOCK_M=64))
    assert a.key() == Config.parse("PATH=wmma,BLOCK_M=64").key()
    assert a.key() != a.replace(BLOCK_M=32).key()
    assert {a: 1}[Config.parse(a.label())] == 1


def test_timing_protocol_defaults_and_overrides(space_file) -> None:
    default = load_space(space_file(lambda d: d.pop("timing", None))).timing
    assert (default.min_repetitions, default.precision, default.repetitions) == (20, 0.002, 100)
    custom = load_space(space_file(lambda d: d.update(timing={"repetitions": 50, "min_repetitions": 10, "precision": 0})))
    assert custom.timing.protocol() == {"warmup": 10, "repetitions": 50, "min_repetitions": 10, "precision": 0.0,
                                      "flush_l2": True, "race": 1.5}


def test_median_standard_error_separates_steady_from_noisy_samples() -> None:
    import random

    from evoengineer.gpu.timing import median_rel_stderr

    draw = random.Random(0)
    steady = [10 * (1 + draw.gauss(0, 0.002)) for _ in range(20)]   # a kernel's graph replays: ~0.3 % spread
    noisy = [10 * (1 + draw.gauss(0, 0.03)) for _ in range(20)]
    assert median_rel_stderr(steady) < 0.002 < median_rel_stderr(noisy)
    assert median_rel_stderr(noisy * 9) < median_rel_stderr(noisy)   # more samples, a better-known median
    assert median_rel_stderr([1.0, 2.0]) == float("inf")


def test_launches_per_sample_fill_the_sample_time() -> None:
    from evoengineer.gpu.timing import launches_per_sample

    assert launches_per_sample(6.0, 3) == 84                  # ~500 µs of 6 µs calls
    assert launches_per_sample(2000.0, 1) == 1                # one call is already longer
    assert launches_per_sample(2000.0, 5) == 5                # every input set at least once
    assert launches_per_sample(0.5, 1) == 256                 # at most 256 launches
    assert launches_per_sample(10.0, 2, target_sample_us=3000.0, max_launches=1000) == 300


def test_spaces_reads_valid_sizes_from_its_cache_keyed_by_the_file(tmp_path: Path, space_file) -> None:
    """`evoengineer spaces` counts each space's valid configurations once and keeps the count
    in the cache directory, keyed by the space file's content and the code's hash: a cached
    count is answered without counting; another file content is counted again."""
    import hashlib
    import json
    import os

    from evoengineer.cli.space_commands import SIZES_FILE, _code_hash, cached_valid_size
    cache: dict[str, int] = {}
    small = load_space(space_file(lambda d: d["params"].update(WARPS=[4])))
    size, counted = cached_valid_size(small, cache, "code")
    assert counted and size == small.valid_size() and list(cache.values()) == [size]
    assert cached_valid_size(small, cache, "code") == (size, False)
    assert cached_valid_size(small, cache, "other code") == (size, True)  # new code: counted again
    other = load_space(space_file(lambda d: d["params"].update(WARPS=[2, 4]), name="other.yaml"))
    assert cached_valid_size(other, cache, "code")[1]

    # the command answers from the cache: sizes planted there are the ones it prints
    planted: dict[str, int] = {}
    code = _code_hash()
    for i, path in enumerate(builtin_spaces().values()):
        planted[f"{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}-{code}"] = 1000 + i
    (tmp_path / SIZES_FILE).write_text(json.dumps(planted))
    proc = subprocess.run([sys.executable, "-m", "evoengineer", "spaces", "--json"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "EVOENGINEER_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert [row["valid"] for row in json.loads(proc.stdout)] == [1000 + i for i in range(len(planted))]


def test_a_space_with_constraints_pickles_and_enumerates_the_same() -> None:
    """A space travels to another process (a batch process's sampler): its constraints' code
    objects do not pickle, so they are parsed again from their text."""
    import pickle

    space = load_space(Path(__file__).parent / "data" / "replay_small_space.yaml")
    assert any(p.constraints for p in space.paths) or space.constraints
    again = pickle.loads(pickle.dumps(space))
    assert again == space and list(again.valid_configs()) == list(space.valid_configs())
