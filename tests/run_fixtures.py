"""Hand-written run directories with per-case timings: what a GPU search leaves behind
(space.yaml, run.json, env.json, baseline.json, results.jsonl), without a GPU."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from evoengineer.resources import builtin_spaces
from evoengineer.results import parse_label
from evoengineer.space import Config

GPU = "NVIDIA H100 80GB HBM3"

_MMA_OFF = {"STAGES": 1, "SMEM_LAYOUT": "swizzle", "Q_IN_REGS": 0, "P_IN_REGS": 0, "SPLITS": 1, "KV_GROUPS": 1}
WMMA = Config({"PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8, **_MMA_OFF})
"""Small shapes' winner in ``make_run``."""
MMA = Config({"PATH": "mma", "BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 4, "VEC": 8, "STAGES": 1, "SMEM_LAYOUT": "swizzle",
              "Q_IN_REGS": 0, "P_IN_REGS": 1, "SPLITS": 1, "KV_GROUPS": 1})
"""Large shapes' winner and geometric-mean winner (the fallback)."""
SPLIT = Config({"PATH": "mma", "BLOCK_M": 64, "BLOCK_N": 128, "WARPS": 4, "VEC": 8, "STAGES": 2, "SMEM_LAYOUT": "swizzle",
                "Q_IN_REGS": 1, "P_IN_REGS": 1, "SPLITS": 2, "KV_GROUPS": 1, "PACK_GQA": 1})
"""Split-K/V (two launches and a workspace) with the query heads of a K/V head packed in one
CTA: the decode case's winner."""

SMALL, SMALL_C = "B1 H8 S512 D64", "B1 H8 S512 D64 causal"
LARGE64, LARGE64_C = "B4 H16 S2048 D64", "B4 H16 S2048 D64 causal"
LARGE128 = "B4 H16 S2048 D128"
DECODE = "B8 H32 Sq1 Sk4096 D128"
"""A decode case (q_len 1 over a 4096-key cache): not a case of today's spaces, recorded by label."""

# label -> config -> median µs; LARGE128 causal is in the space but never timed (its variant falls back)
TIMES = {
    SMALL: {WMMA: 20.0, MMA: 26.0, SPLIT: 34.0},
    SMALL_C: {WMMA: 15.0, MMA: 18.0, SPLIT: 26.0},
    LARGE64: {WMMA: 400.0, MMA: 250.0, SPLIT: 330.0},
    LARGE64_C: {WMMA: 260.0, MMA: 140.0, SPLIT: 190.0},
    LARGE128: {WMMA: 900.0, MMA: 480.0, SPLIT: 560.0},
    DECODE: {WMMA: 90.0, MMA: 60.0, SPLIT: 25.0},
}
SDPA = {SMALL: 18.0, SMALL_C: 16.0, LARGE64: 260.0, LARGE64_C: 150.0, LARGE128: 500.0, DECODE: 30.0}


def space_doc(name: str = "handmade") -> dict:
    doc = yaml.safe_load(builtin_spaces()["h100"].read_text())
    doc["name"] = name
    doc["paths"]["mma"]["params"]["PACK_GQA"] = [0, 1]   # the decode winner packs grouped query heads
    doc["problem"]["shapes"] = [
        {"B": 1, "H": 8, "S": 512, "D": 64, "causal": [False, True]},
        {"B": 4, "H": 16, "S": 2048, "D": 64, "causal": [False, True]},
        {"B": 4, "H": 16, "S": 2048, "D": 128, "causal": [False, True]},
    ]
    return doc


def _time(us: float) -> dict:
    return {"median_us": us, "p20_us": us * 0.99, "p80_us": us * 1.01, "repetitions": 30, "launches_per_sample": 8}


def make_run(path: Path, times: dict[str, dict[Config, float]] | None = None, *, gpu: str = GPU,
             sdpa: dict[str, float] | None = None, name: str = "handmade", space: dict | None = None) -> Path:
    """A finished run directory whose results carry per-case timings (``times``: label ->
    config -> µs); the objective is the geometric mean over each configuration's cases.
    ``space``: the run's space document (default: ``space_doc(name)``)."""
    import math

    times = TIMES if times is None else times
    sdpa = SDPA if sdpa is None else sdpa
    path.mkdir(parents=True)
    (path / "sources").mkdir()
    (path / "space.yaml").write_text(yaml.safe_dump(space if space is not None else space_doc(name), sort_keys=False))
    info = {"gpu": gpu, "arch": "sm_90", "sms": 132}
    from evoengineer.space import parse_space

    doc = space if space is not None else space_doc(name)
    case_flops = {case.label(): case.flops() for case in parse_space(doc, "space.yaml").cases}
    flops = {}
    for label in times:
        shape = parse_label(label)
        flops[label] = case_flops[label] if shape is None else (   # packed sequences: the space's own count
            4.0 * shape.batch * shape.heads * shape.seq_q * shape.seq_k * shape.head_dim / (2 if shape.causal else 1))
    (path / "run.json").write_text(json.dumps({"space": name, "strategy": "grid", "gpu": info, "arch": "sm_90",
                                               "case_flops": flops}))
    (path / "env.json").write_text(json.dumps(info))
    (path / "baseline.json").write_text(json.dumps({
        label: {"flash": {"status": "ok", "time": _time(us)}, "cudnn": {"status": "ok", "time": _time(us * 1.1)},
                "efficient": {"status": "unsupported", "reason": "-"}}
        for label, us in sdpa.items()}))
    configs = list(dict.fromkeys(c for per in times.values() for c in per))
    with (path / "results.jsonl").open("w") as fh:
        for config in configs:
            cases = [{"label": label, "status": "ok", "max_abs_err": 1e-3, "time": _time(per[config])}
                     for label, per in times.items() if config in per]
            objective = math.exp(sum(math.log(c["time"]["median_us"]) for c in cases) / len(cases))
            fh.write(json.dumps({"config": config.to_dict(), "key": config.key(), "status": "ok", "reason": "",
                                 "resources": {"registers": 96}, "cases": cases, "objective_us": objective}) + "\n")
        fh.write(json.dumps({"config": {**WMMA.to_dict(), "BLOCK_N": 32}, "key": "0badc0ffee00", "status": "incorrect",
                             "reason": "max abs error", "cases": [], "objective_us": None}) + "\n")
    return path


def load_module(directory: Path, name: str = "evo_attention"):
    """Import an exported package from ``directory`` under a unique name (several exports in one process)."""
    import importlib.util
    import sys

    unique = f"{name}_{next(_COUNTER)}"
    package = directory / name
    spec = importlib.util.spec_from_file_location(unique, package / "__init__.py", submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    spec.loader.exec_module(module)
    return module


import itertools as _itertools  # noqa: E402

_COUNTER = _itertools.count()


def recorded_keys(run: Path) -> list[str]:
    """The configuration keys a run directory's results.jsonl holds, in order (a torn last line
    left out; none before the run writes its first result)."""
    path = run / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["key"] for line in path.read_text().splitlines() if line.strip().endswith("}")]


def stand_in_driver(calls: list, status: int = 0) -> tuple:
    """A ``runtime.tensormap.Driver`` whose functions are C callbacks recording their arguments
    (libcuda's prototypes and calls): ("encode", map, data type, rank, address, dims[:4],
    strides[:3], box[:4], element strides[:4], interleave, swizzle, L2 promotion, fill), each map
    filled with 0xAB, or ("replace", map, address); each returns ``status``. Keep the second value
    alive while the driver is used."""
    import ctypes

    from evoengineer.runtime import tensormap

    def encode(out, dtype, rank, address, dims, strides, box, elems, interleave, swizzle, l2, oob):
        calls.append(("encode", out, dtype, rank, address, dims[:4], strides[:3], box[:4], elems[:4], interleave,
                      swizzle, l2, oob))
        ctypes.memset(out, 0xAB, tensormap.MAP_BYTES)
        return status

    def replace(out, address):
        calls.append(("replace", out, address))
        return status

    keep = [tensormap._ENCODE(encode), tensormap._REPLACE(replace)]
    return tensormap.Driver(*[ctypes.cast(f, ctypes.c_void_p).value for f in keep]), keep



def replayed_partitioned_search(tmp_path: Path, doc: dict, us, sdpa_us) -> tuple[Path, Path]:
    """(a run of ``search --replay`` over ``doc`` in its head-dim partitions, its export directory):
    every valid configuration of each partition recorded with ``us(config, case label)``
    microseconds, SDPA at ``sdpa_us(case)``."""
    import math

    from evoengineer.cli.main import main
    from evoengineer.results import export_runs
    from evoengineer.search.partition import split_cases
    from evoengineer.space import parse_space

    name = doc["name"]
    space = parse_space(doc, f"{name}.yaml")
    times: dict[Config, dict[str, float]] = {}
    for _, part in split_cases(space, "head-dim"):
        for config in part.valid_configs():
            times.setdefault(config, {}).update({c.label(): us(config, c.label()) for c in part.cases})
    sdpa = {c.label(): sdpa_us(c) for c in space.cases}
    lines = [{"header": {"space_inline": doc, "gpu": GPU, "sdpa_fastest_us": sdpa}}]
    for config, cases in times.items():
        lines.append({"config": config.to_dict(), "key": config.key(), "status": "ok", "cases": cases,
                      "objective_us": math.exp(sum(map(math.log, cases.values())) / len(cases))})
    recording = tmp_path / f"{name}.jsonl"
    recording.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    assert main(["search", "--space", str(tmp_path / f"{name}.yaml"), "--replay", str(recording), "--run-dir", str(run),
                 "--quiet", "--seed", "1", "--trials", "40"]) == 0
    out = tmp_path / "out"
    export_runs([run], out)
    return run, out
