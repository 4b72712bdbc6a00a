"""Packed variable-length shapes in a space, without a GPU: the ``lengths`` schema and its errors,
the case's label, FLOPs and features, the valid set (paths without ``varlen`` left out), an NVRTC
compile of its kernel, a replayed search in partitions, and an export whose varlen calls dispatch
to the packed case's winner with a varlen kernel."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoengineer import paths
from evoengineer.gpu import gate_cases
from evoengineer.gpu.evaluate import EDGE_LENGTHS, input_set_bytes
from evoengineer.kernels import build_config
from evoengineer.results import load_leaderboard, per_shape_winners
from evoengineer.runtime import varlen as V
from evoengineer.search.partition import split_cases
from evoengineer.space import Case, Config, SpaceError, load_space, parse_space

LENGTHS = [1, 17, 1000, 4099]
PACKED = {"H": 8, "H_KV": 2, "D": 64, "causal": [False, True], "lengths": [64, 300, 129]}
SPACE = {
    "name": "packed",
    "description": "A dense and a packed shape at D64, on the mma and wmma paths.",
    "target": {"name": "any", "arch": "sm_90", "sms": 132, "smem_per_block": 232448},
    "problem": {"shapes": [{"B": 2, "H": 8, "H_KV": 2, "S": 256, "D": 64, "causal": [False, True]}, PACKED]},
    "template": "flash_attention",
    "params": {"BLOCK_M": [64, 128], "BLOCK_N": [32, 64]},
    "paths": {"mma": {"params": {"WARPS": [4], "VEC": [8], "STAGES": [1, 2]}},
              "wmma": {"params": {"WARPS": [4], "VEC": [8]}}},
    "search": {"strategy": "random", "budget": 12, "top_k": 2},
}


def _space(**shape: object):
    doc = json.loads(json.dumps(SPACE))
    doc["problem"]["shapes"][1] = {**PACKED, **shape}
    return parse_space(doc, "packed.yaml")


def _error(**shape: object) -> SpaceError:
    with pytest.raises(SpaceError) as err:
        _space(**shape)
    assert "\n" not in str(err.value) and str(err.value).startswith("packed.yaml: problem.shapes[1]")
    return err.value


# -- the schema -------------------------------------------------------------------------------------


def test_a_packed_shape_lists_its_lengths_and_counts_them_as_its_batch() -> None:
    space = _space(lengths=LENGTHS, B=4, causal=True)
    case = next(c for c in space.cases if c.lengths)
    assert case == Case(4, 8, 4099, 64, True, heads_kv=2, seq_kv=4099, lengths=tuple(LENGTHS))
    assert case.features == ("varlen",) and case.variant.label() == "D64-causal-varlen"
    assert case.label() == "B4 H8/2 varlen 1..4099 T5117 D64 causal"
    assert case.shape == (4, 8, 4099, 64, 4099) and case.tokens == 5117
    pairs = sum(n * n / 2.0 for n in LENGTHS)   # per sequence, causal
    assert case.flops() == pytest.approx(4.0 * 8 * 64 * pairs)
    full = Case(4, 8, 4099, 64, False, heads_kv=2, lengths=tuple(LENGTHS))
    assert full.flops() == pytest.approx(4.0 * 8 * 64 * sum(n * n for n in LENGTHS))
    assert input_set_bytes(case) == 2 * 2 * 5117 * 64 * (8 + 2)
    assert space.with_shapes([(4, 8, 4099, 64)]).cases == (case,)   # --shape B,H,longest,D selects it


def test_a_length_distribution_is_one_fixed_list_per_seed() -> None:
    drawn = {"count": 16, "min": 64, "max": 4096, "seed": 0}
    one = next(c for c in _space(lengths=drawn).cases if c.lengths)
    again = next(c for c in _space(lengths=dict(drawn)).cases if c.lengths)
    other = next(c for c in _space(lengths={**drawn, "seed": 1}).cases if c.lengths)
    assert one.lengths == again.lengths and one.lengths != other.lengths
    assert len(one.lengths) == one.batch == 16 and all(64 <= n <= 4096 for n in one.lengths)
    assert one.seq == max(one.lengths)


@pytest.mark.parametrize("shape, key, words", [
    ({"B": 3, "lengths": LENGTHS}, "problem.shapes[1].B", "number of lengths (4)"),
    ({"S": 512}, "problem.shapes[1].S", "leave S and S_KV out"),
    ({"S_KV": 512}, "problem.shapes[1].S_KV", "leave S and S_KV out"),
    ({"lengths": []}, "problem.shapes[1].lengths", "list of 1 to 4096"),
    ({"lengths": "1,2"}, "problem.shapes[1].lengths", "list of 1 to 4096"),
    ({"lengths": [5, 0]}, "problem.shapes[1].lengths[1]", "from 1 to 1048576"),
    ({"lengths": [5, True]}, "problem.shapes[1].lengths[1]", "from 1 to 1048576"),
    ({"lengths": list(range(1, 5000))}, "problem.shapes[1].lengths", "list of 1 to 4096"),
    ({"lengths": {"count": 5000, "min": 1, "max": 9}}, "problem.shapes[1].lengths.count", "at most 4096"),
    ({"lengths": {"count": 4, "min": 9, "max": 8}}, "problem.shapes[1].lengths.max", ">= 9"),
    ({"lengths": {"count": 4, "min": 1, "max": 1 << 21}}, "problem.shapes[1].lengths.max", "at most 1048576"),
    ({"lengths": {"count": 4, "min": 1}}, "problem.shapes[1].lengths.max", "required key is missing"),
    ({"lengths": {"count": 4, "min": 1, "max": 9, "mean": 3}}, "problem.shapes[1].lengths.mean", "unknown key"),
    ({"lengths": {"count": 4, "min": 1, "max": 9, "seed": -1}}, "problem.shapes[1].lengths.seed", ">= 0"),
])
def test_a_bad_packed_shape_is_one_line_naming_the_key(shape: dict, key: str, words: str) -> None:
    err = _error(**shape)
    assert err.key == key and words in err.message, str(err)


def test_two_packed_shapes_with_one_label_are_refused() -> None:
    doc = json.loads(json.dumps(SPACE))
    doc["problem"]["shapes"].append({**PACKED, "lengths": [64, 299, 130]})   # 64..299 T493: another label
    parse_space(doc, "packed.yaml")
    doc["problem"]["shapes"][-1]["lengths"] = [300, 64, 129]                  # the same lengths in another order
    with pytest.raises(SpaceError, match=r"problem.shapes\[2\]: its label 'B3 H8/2 varlen 64..300 T493 D64' is "
                                         r"another shape's"):
        parse_space(doc, "packed.yaml")


def test_a_bad_packed_shape_exits_2_from_the_cli_in_one_line(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(SPACE))
    doc["problem"]["shapes"][1]["lengths"] = {"count": 2, "min": 1, "max": 9, "sigma": 1}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    for command in (["check", "--space", "bad.yaml", "--limit", "1"], ["search", "--space", "bad.yaml", "--trials", "1"]):
        proc = subprocess.run([sys.executable, "-m", "evoengineer", *command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == "error: bad.yaml: problem.shapes[1].lengths.sigma: unknown key"


def test_the_backward_takes_no_packed_shape() -> None:
    doc = yaml.safe_load((Path(paths.__file__).parents[2] / "search_spaces" / "h100-backward.yaml").read_text())
    doc["problem"]["shapes"].append({"H": 8, "D": 64, "lengths": [5, 9]})
    with pytest.raises(SpaceError, match="no soft cap, window, packed sequences or padded batch"):
        parse_space(doc, "bwd.yaml")
    doc["problem"]["shapes"][-1] = {"H": 8, "D": 64, "lengths": [5, 9], "padded": True}
    with pytest.raises(SpaceError, match="no soft cap, window, packed sequences or padded batch"):
        parse_space(doc, "bwd.yaml")


# -- the valid set, the gate's cases, a compile ------------------------------------------------------


def test_paths_without_packed_sequences_leave_the_space_but_not_its_dense_partition() -> None:
    space = _space()
    holding = {name for name in ("mma", "wmma") if "varlen" in paths.get(name).features}
    assert {c["PATH"] for c in space.valid_configs()} == holding == {"mma"}
    wmma = space.complete({"PATH": "wmma"})
    assert any(v.startswith("wmma.features:") for v in space.violations(wmma))
    assert space.violations(wmma, features=()) == []
    parts = dict(split_cases(space, "head-dim"))
    assert list(parts) == ["D64", "D64 varlen"]
    assert {c["PATH"] for c in parts["D64"].valid_configs()} == {"mma", "wmma"}
    assert {c["PATH"] for c in parts["D64 varlen"].valid_configs()} == {"mma"}
    shapes = dict(split_cases(space, "shape"))
    assert "B3 H8/2 varlen 64..300 T493 D64" in shapes


def test_the_llama_space_has_a_packed_case_whose_seeds_stay_in_their_partitions() -> None:
    space = load_space("llama3-8b")
    packed = [c for c in space.cases if c.packed]
    assert len(packed) == 2 and {c.dtype for c in packed} == {"fp16", "bf16"} and all(c.causal for c in packed)
    parts = dict(split_cases(space, "head-dim"))
    assert set(parts) == {"D128", "D128 bf16", "D128 decode", "D128 decode bf16", "D128 varlen", "D128 varlen bf16",
                          "D128 padded", "D128 padded bf16"}
    seeds = set(space.search.listed_seeds)
    assert {s for part in parts.values() for s in part.search.seeds} == seeds   # every seed searched somewhere
    assert all(s["PATH"] in {p for p in paths.PATHS if "varlen" in paths.get(p).features}
               for s in parts["D128 varlen"].search.seeds)


def test_a_packed_variant_is_gated_on_packed_edge_shapes() -> None:
    space = _space()
    variant = next(c.variant for c in space.cases if c.lengths and c.causal)
    cases = gate_cases(space, variant)
    assert all(c.lengths and c.variant == variant for c in cases)
    assert {c.lengths for c in cases} >= {n for _, n in EDGE_LENGTHS}
    assert any(c.heads_kv != c.heads for c in cases[1:])   # grouped heads: a packed GQA edge


def test_a_packed_case_renders_and_compiles_with_the_varlen_switch() -> None:
    space = _space()
    config = next(c for c in space.valid_configs() if c["STAGES"] == 2)
    report = build_config(space.template, config, space.variants, "sm_90", space.target.smem_per_block)
    assert report.status == "compiled", report.error
    packed = [v for v in space.variants if "varlen" in v.features]
    assert packed and all("varlen" in report.build(v).rendered.features for v in packed)
    assert all("varlen" not in report.build(v).rendered.features for v in space.variants if not v.features)


def test_offsets_and_sdpa_per_sequence_match_the_reference() -> None:
    import torch

    assert V.offsets_of([3, 0, 5]) == [0, 3, 3, 8]
    torch.manual_seed(0)
    offsets = V.offsets_of([3, 5, 1])
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    for causal in (False, True):
        ours = V.sdpa_per_sequence(q, k, v, offsets, offsets, causal)
        assert torch.allclose(ours, V.reference_varlen(q, k, v, offsets, offsets, causal), atol=1e-5)
    more_keys = V.offsets_of([4, 6, 1])
    k2, v2 = torch.randn(11, 2, 16), torch.randn(11, 2, 16)
    ours = V.sdpa_per_sequence(q, k2, v2, offsets, more_keys, True)   # bottom-right where the lengths differ
    assert torch.allclose(ours, V.reference_varlen(q, k2, v2, offsets, more_keys, True), atol=1e-5)


# -- a replayed search and its export ----------------------------------------------------------------


def _us(config: Config, label: str) -> float:
    """Made-up times: dense cases like BLOCK_N 64, packed ones BLOCK_N 32 and one stage."""
    packed = "varlen" in label
    fit = (config["BLOCK_N"] == 32 and config["STAGES"] == 1) if packed else config["BLOCK_N"] == 64
    return (200.0 if packed else 100.0) * (1.0 if fit else 1.4) * (1 + 0.01 * config["BLOCK_M"] // 64)


@pytest.fixture
def searched(tmp_path: Path) -> tuple[Path, Path]:
    """(a run of a replayed search of SPACE in partitions, its export directory)."""
    from run_fixtures import replayed_partitioned_search

    return replayed_partitioned_search(tmp_path, SPACE, _us, lambda c: 150.0 if c.lengths else 120.0)


def test_a_replayed_search_of_a_packed_case_ranks_it_in_its_own_partition(searched: tuple[Path, Path]) -> None:
    run, _ = searched
    board = load_leaderboard(run)
    assert [p["name"] for p in board["partitions"]] == ["D64", "D64 varlen"]
    packed = [e for e in board["entries"] if e["partition"] == "D64 varlen"]
    assert packed and all(e["config"]["PATH"] == "mma" for e in packed)
    labels = {c["label"] for e in packed for c in e["cases"]}
    assert labels == {"B3 H8/2 varlen 64..300 T493 D64", "B3 H8/2 varlen 64..300 T493 D64 causal"}
    assert all(e["speedup"] for e in packed)   # x SDPA from the recording's per-sequence SDPA
    meta = json.loads((run / "run.json").read_text())
    assert meta["case_flops"]["B3 H8/2 varlen 64..300 T493 D64"] == pytest.approx(
        4.0 * 8 * 64 * sum(n * n for n in (64, 300, 129)))


def test_the_export_serves_packed_calls_by_the_packed_case_winner(searched: tuple[Path, Path]) -> None:
    from run_fixtures import load_module

    from evoengineer.runtime.features import select_kernel

    run, out = searched
    per = per_shape_winners([run])
    won = {w.label: w for w in per.winners}
    packed = won["B3 H8/2 varlen 64..300 T493 D64 causal"]
    dense = won["B2 H8/2 S256 D64 causal"]
    assert packed.shape.varlen and packed.shape.lengths == (64, 300, 129)
    assert per.configs[packed.config].config["BLOCK_N"] == 32 and per.configs[dense.config].config["BLOCK_N"] == 64
    info = json.loads((out / "kernel.json").read_text())
    variant = next(v for v in info["dispatch"]["variants"] if v["head_dim"] == 64 and v["causal"])
    assert any(c.get("varlen") and c["config"] == packed.config for c in variant["cases"])
    assert any(k["config"] == packed.config and "varlen" in k["features"] and k["causal"] for k in info["kernels"])

    module = load_module(out)
    # a varlen call near the dense shape still goes to the packed case; a dense call to the dense case
    assert module.dispatch("fp16", 64, True, 2, 8, 256, 256, heads_kv=2, varlen=True) == packed.config
    assert module.dispatch("fp16", 64, True, 2, 8, 256, 256, heads_kv=2) == dense.config
    export = module._export
    spec = select_kernel(export.data.kernels, ("fp16", 64, True), packed.config,
                         export.table.variants[("fp16", 64, True)].fallback, ("varlen",))
    assert spec.config == packed.config and "varlen" in spec.features
