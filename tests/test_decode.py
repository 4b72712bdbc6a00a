"""Decode without a GPU: cases whose K/V length differs from the query length (space files,
labels, --shape, the gate's inputs), the h100-decode space (valid configurations, seeds, NVRTC
compiles of split-K/V kernels, their launch geometry) and an export of a prefill run and a
decode run whose module sends q_len 1 calls to the decode configurations."""
from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from run_fixtures import LARGE64, LARGE128, MMA, SMALL, SMALL_C, TIMES, WMMA, load_module, make_run

from evoengineer.gpu import EDGE_KV, EDGE_SEQS, gate_cases
from evoengineer.gpu.evaluate import EDGE_GQA, EDGE_GQA_KV, input_set_bytes
from evoengineer.kernels import build_config, render
from evoengineer.resources import builtin_spaces
from evoengineer.results import Shape, export_runs, nearest, parse_label, per_shape_winners
from evoengineer.space import Case, Config, SpaceError, Variant, format_shape, load_space, parse_shape

DECODE_SPACE = "h100-decode"
ISSUE_SHAPES = [(8, 32, 8, 4096, 128), (2, 28, 4, 6000, 128), (4, 16, 16, 4096, 64), (64, 32, 8, 2048, 128),
                (1, 32, 32, 32768, 128)]
"""(B, H, H_kv, S_kv, D) of the decode shapes the per-call split count is for (q_len 1)."""
RECORDING = Path(__file__).resolve().parent / "data" / "replay_synthetic.jsonl"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


# -- Case ------------------------------------------------------------------------------------------


def test_a_case_without_a_kv_length_is_the_old_case() -> None:
    old = Case(1, 8, 512, 64, True)
    assert old.seq_kv == 512 and old == Case(1, 8, 512, 64, True, seq_kv=512) and hash(old) == hash(Case(1, 8, 512, 64, True, seq_kv=512))
    assert old.label() == "B1 H8 S512 D64 causal" and old.shape == (1, 8, 512, 64, 512)
    assert old.flops() == 4.0 * 8 * 512 * 512 * 64 / 2


def test_a_decode_case_shows_and_counts_its_kv_length() -> None:
    decode = Case(8, 32, 1, 128, False, seq_kv=4096)
    assert decode.label() == "B8 H32 S1/4096 D128" and decode.shape == (8, 32, 1, 128, 4096)
    assert decode.flops() == 4.0 * 8 * 32 * 1 * 4096 * 128
    gqa = Case(8, 32, 1, 128, False, heads_kv=8, dtype="bf16", seq_kv=4096)
    assert gqa.label() == "B8 H32/8 S1/4096 D128 bf16" and gqa.variant == Variant(128, False, "bf16")
    assert Case(1, 2, 1, 64, True, seq_kv=4096).flops() == 4.0 * 2 * 0.5 * 64   # top-left causal: S^2 / 2 pairs
    # more queries than keys, causal top-left: the first S_KV rows a triangle, the others every key
    assert Case(1, 1, 6, 64, True, seq_kv=4).flops() == 4.0 * 64 * (4 * 4 / 2 + 2 * 4)
    with pytest.raises(ValueError, match="sequence lengths must be >= 1"):
        Case(1, 1, 1, 64, False, seq_kv=0)


# -- the space file ---------------------------------------------------------------------------------


def test_s_kv_in_a_space_file(space_file) -> None:
    def edit(d):
        d["problem"]["shapes"] = [{"B": 8, "H": 32, "H_KV": 8, "S": 1, "S_KV": 4096, "D": 64, "causal": [False, True]},
                                  {"B": 1, "H": 8, "S": 512, "D": 64}]

    space = load_space(space_file(edit))
    assert [c.label() for c in space.cases] == ["B8 H32/8 S1/4096 D64", "B8 H32/8 S1/4096 D64 causal", "B1 H8 S512 D64"]
    assert [c.seq_kv for c in space.cases] == [4096, 4096, 512]


@pytest.mark.parametrize(
    "value, words",
    [(0, "expected an integer >= 1, got 0"), ("4k", "expected an integer, got '4k'"), (True, "expected an integer, got True")],
)
def test_bad_s_kv_names_file_and_key(space_file, value, words) -> None:
    path = space_file(lambda d: d["problem"]["shapes"][0].update(S_KV=value))
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.key == "problem.shapes[0].S_KV" and words in str(err.value) and "\n" not in str(err.value)


def test_misspelt_s_kv_is_one_line_exit_2_in_the_cli(space_file) -> None:
    path = space_file(lambda d: d["problem"]["shapes"][0].update(SKV=4096))
    proc = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", str(path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {path}: problem.shapes[0].SKV: unknown key (did you mean 'S_KV'?)"]


# -- --shape ----------------------------------------------------------------------------------------


def test_parse_shape_takes_a_kv_length_after_a_slash() -> None:
    assert parse_shape("1,8,512,64") == (1, 8, 512, 64, 512)
    assert parse_shape(" 8, 32, 1/4096, 128") == (8, 32, 1, 128, 4096)
    for bad in ("8,32,1/,128", "8,32,1/4096/2,128", "8,32,0/4096,128", "8,32,1,4096,128", "8,32,1/x,128", "1,8,512"):
        with pytest.raises(ValueError, match="B,H,S,D"):
            parse_shape(bad)
    assert format_shape((8, 32, 1, 128, 4096)) == "8,32,1/4096,128" and format_shape((1, 8, 512, 64)) == "1,8,512,64"


def test_with_shapes_selects_by_query_and_kv_length() -> None:
    space = load_space(DECODE_SPACE)
    d128 = space.with_shapes([parse_shape("8,32,1/4096,128")])
    assert [c.label() for c in d128.cases] == ["B8 H32 S1/4096 D128", "B8 H32 S1/4096 D128 bf16",
                                               "B8 H32/8 S1/4096 D128", "B8 H32/8 S1/4096 D128 bf16"]
    assert len(space.with_shapes([(1, 32, 1, 128, 8192)]).cases) == 2
    with pytest.raises(SpaceError, match=r"no shape 8,32,1,128 .*it has 8,32,1/4096,128, 8,32,1/4096,64, 1,32,1/8192,128, "
                                         r"2,28,1/6000,128, 4,16,1/4096,64, 64,32,1/2048,128, 1,32,1/32768,128$"):
        space.with_shapes([(8, 32, 1, 128)])   # four numbers: S_KV = S


def test_search_restricted_to_a_decode_shape(tmp_path: Path, space_yaml: Path) -> None:
    """``search --shape B,H,S/S_KV,D`` on a replayed search: the run records the shape and its cases."""
    doc = yaml.safe_load(space_yaml.read_text())
    doc["problem"]["shapes"].append({"B": 2, "H": 4, "S": 1, "S_KV": 300, "D": 64, "causal": [False]})
    path = tmp_path / "with_decode.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    base = ["search", "--space", str(path), "--replay", str(RECORDING), "--strategy", "random", "--quiet"]
    done = cli(*base, "--trials", "3", "--shape", "2,4,1/300,64", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    meta = json.loads((run / "run.json").read_text())
    assert meta["shapes"] == ["2,4,1/300,64"] and meta["case_flops"] == {"B2 H4 S1/300 D64": 4.0 * 2 * 4 * 300 * 64}
    missing = cli(*base, "--trials", "3", "--shape", "2,4,1,64", "--run-dir", str(tmp_path / "other"), cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "no shape 2,4,1,64" in missing.stderr and "2,4,1/300,64" in missing.stderr


# -- the gate ---------------------------------------------------------------------------------------


def test_gate_adds_kv_length_edges_only_where_the_space_has_decode_shapes() -> None:
    space = load_space(DECODE_SPACE)
    grouped = gate_cases(space, Variant(128, False, "bf16"))
    assert [c.label() for c in grouped[:6]] == ["B8 H32 S1/4096 D128 bf16", "B8 H32/8 S1/4096 D128 bf16",
                                                "B1 H32 S1/8192 D128 bf16", "B2 H28/4 S1/6000 D128 bf16",
                                                "B64 H32/8 S1/2048 D128 bf16", "B1 H32 S1/32768 D128 bf16"]
    shapes = [(c.batch, c.heads, c.heads_kv, c.seq, c.seq_kv) for c in grouped[6:]]
    assert shapes == ([(b, h, h, s, s) for b, h, s in EDGE_SEQS] + [(b, h, kv, s, s) for b, h, kv, s in EDGE_GQA]
                      + [(b, h, h, s, skv) for b, h, s, skv in EDGE_KV] + list(EDGE_GQA_KV))
    assert {(c.seq, c.seq_kv) for c in grouped} >= {(1, 1), (1, 77), (1, 257), (1, 4096)}
    plain = gate_cases(space, Variant(64, False))
    assert not any(c.heads_kv != c.heads for c in plain) and any(c.seq_kv != c.seq for c in plain[1:])
    prefill = load_space("h100")   # spaces without decode shapes gate what they gated before
    assert all(c.seq_kv == c.seq for v in prefill.variants for c in gate_cases(prefill, v))


def test_timing_inputs_are_sized_by_the_kv_length() -> None:
    decode = Case(8, 32, 1, 128, False, heads_kv=8, seq_kv=4096)
    assert input_set_bytes(decode) == 2 * 2 * 8 * 128 * (32 * 1 + 8 * 4096)   # q and out: one row; k and v: the cache
    assert input_set_bytes(Case(4, 16, 2048, 64, False)) == 2 * (16 + 16) * 4 * 2048 * 64 * 2


# -- the h100-decode space ---------------------------------------------------------------------------


def test_the_decode_space_holds_split_kv_configurations_for_q_len_1() -> None:
    assert DECODE_SPACE in builtin_spaces()
    space = load_space(DECODE_SPACE)
    assert space.target.arch == "sm_90a" and space.dtypes == ("fp16", "bf16")
    assert all(c.seq == 1 and c.seq_kv >= 2048 and not c.causal for c in space.cases)
    assert {(c.head_dim, c.heads_kv) for c in space.cases} == {(128, 32), (64, 32), (64, 16), (128, 8), (128, 4)}
    assert {(c.batch, c.heads, c.heads_kv, c.seq_kv, c.head_dim) for c in space.cases} >= set(ISSUE_SHAPES)
    valid = list(space.valid_configs())
    assert 100 <= len(valid) <= 300
    assert {c["PATH"] for c in valid} == {"mma"} and {c["BLOCK_M"] for c in valid} == {16}
    assert {c["SPLITS"] for c in valid} == {0, 1, 2, 4, 8, 16, 32} and {c["KV_GROUPS"] for c in valid} == {1, 2, 4, 8}
    assert all(c["WARPS"] == c["KV_GROUPS"] for c in valid)
    assert space.search.seeds and all(space.contains(seed) for seed in space.search.seeds)
    assert sum(seed["SPLITS"] > 1 for seed in space.search.seeds) >= 4
    assert space.search.seeds[0]["SPLITS"] == 0   # the per-call split count is timed first
    assert {c["PACK_GQA"] for c in valid} == {0, 1} and any(seed.get("PACK_GQA") for seed in space.search.seeds)


def test_the_decode_seeds_compile_without_spills_for_sm_90a() -> None:
    space = load_space(DECODE_SPACE)
    for seed in space.search.seeds:
        report = build_config(space.template, seed, space.variants, space.target.arch, space.target.smem_per_block)
        assert report.status == "compiled", (seed.label(), report.error)
        assert report.spill_bytes == 0 and report.smem <= space.target.smem_per_block, seed.label()


@pytest.mark.parametrize("splits", [16, 32])
def test_a_decode_launch_covers_every_split(splits: int) -> None:
    """B8 H32 q_len 1: one row of CTAs per (batch, head) and ``SPLITS`` K/V slices each (256 x SPLITS CTAs
    for 132 SMs), then the combine launch over the same rows; the workspace holds each split's row."""
    config = Config(PATH="mma", BLOCK_M=16, BLOCK_N=64, WARPS=4, VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=1,
                    P_IN_REGS=1, SPLITS=splits, KV_GROUPS=4)
    rendered = render("flash_attention", config, Variant(128, False, "bf16"))
    main, combine = rendered.launches
    assert (main.kernel, combine.kernel) == ("attn_fwd", "attn_combine")
    assert main.grid(8, 32, 1) == (1, 256, splits) and combine.grid(8, 32, 1) == (1, 256, 1)
    assert rendered.workspace_floats(8, 32, 1) == 256 * splits * (128 + 1)
    assert "float lse[SPLITS];" in rendered.source and f"constexpr int SPLITS = {splits};" in rendered.source


def test_a_packed_launch_has_a_grid_row_per_kv_head() -> None:
    """PACK_GQA: the query heads of one K/V head are rows of one CTA, so B8 H32/8 q_len 1 runs
    64 grid rows of 4 useful rows each (not 256 of 1); the combine launch keeps one per query head."""
    config = Config(PATH="mma", BLOCK_M=16, BLOCK_N=64, WARPS=4, VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=1,
                    P_IN_REGS=1, SPLITS=4, KV_GROUPS=4, PACK_GQA=1)
    rendered = render("flash_attention", config, Variant(128, False, "fp16"))
    main, combine = rendered.launches
    assert main.pack_gqa and not combine.pack_gqa
    assert main.grid(8, 32, 1, heads_kv=8) == (1, 64, 4) and combine.grid(8, 32, 1, heads_kv=8) == (1, 256, 1)
    assert main.grid(2, 8, 77, heads_kv=2) == (20, 4, 4)       # 77 positions x 4 heads = 308 rows in 16-row tiles
    assert main.grid(8, 32, 1) == main.grid(8, 32, 1, heads_kv=32) == (1, 256, 4)   # no grouping: a head a row
    assert rendered.launch_metadata()["launches"][0]["pack_gqa"] is True
    assert "pack_gqa" not in rendered.launch_metadata()["launches"][1]
    assert rendered.workspace_floats(8, 32, 1) == 256 * 4 * (128 + 1)   # the workspace stays per query head
    assert config.short_label() == "mma 16x64 w4 q p s4 g4 pk"
    plain = render("flash_attention", config.replace(PACK_GQA=0), Variant(128, False, "fp16"))
    assert not plain.launches[0].pack_gqa and "constexpr bool PACK = false;" in plain.source
    assert "constexpr bool PACK = true;" in rendered.source


# -- labels and dispatch -----------------------------------------------------------------------------


def test_labels_with_a_kv_length_read_back_as_shapes() -> None:
    assert parse_label("B8 H32 S1/4096 D128 bf16") == Shape("bf16", 8, 32, 32, 1, 4096, 128, False)
    assert parse_label("B8 H32/8 S1/4096 D128 causal") == Shape("fp16", 8, 32, 8, 1, 4096, 128, True)
    assert parse_label("B8 H32 Sq1 Sk4096 D128") == parse_label("B8 H32 S1/4096 D128")   # the older spelling
    assert parse_label("B8/2 H32 S1 D128") is None
    shape = Shape("fp16", 8, 32, 8, 1, 4096, 128, False)
    assert shape.label() == "B8 H32/8 S1/4096 D128 fp16" and parse_label(shape.label()) == shape


def test_a_decode_shape_looks_only_at_decode_cases() -> None:
    prefill, decode, far = (Shape("fp16", 1, 8, 8, 32, 32, 64, False), Shape("fp16", 8, 32, 32, 1, 4096, 64, False),
                            Shape("fp16", 1, 8, 8, 1, 32, 64, False))
    table = [(prefill, "prefill"), (decode, "decode")]
    assert nearest(table, far) == "decode"                     # the L1 distance alone would pick the prefill case
    assert nearest(table, Shape("fp16", 1, 8, 8, 2, 32, 64, False)) == "prefill"   # q_len 2 is not decode
    assert nearest([(prefill, "prefill")], far) == "prefill"   # no decode case measured: the nearest case
    assert nearest(table, Shape("fp16", 1, 8, 8, 1, 32, 64, True)) is None   # another variant


DEC_A = Config(PATH="mma", BLOCK_M=16, BLOCK_N=64, WARPS=4, VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=1,
               P_IN_REGS=1, SPLITS=4, KV_GROUPS=4)
DEC_B = DEC_A.replace(WARPS=1, KV_GROUPS=1, STAGES=2, SPLITS=8)
DEC_C = DEC_A.replace(SPLITS=16)
TINY = "B1 H8 S32 D64"
"""A short prefill case, nearer to a q_len 1 call over 32 keys than any decode case."""

PREFILL_TIMES = {**{label: times for label, times in TIMES.items() if "Sk" not in label}, TINY: {WMMA: 8.0, MMA: 9.0}}
DECODE_TIMES = {
    "B8 H32 S1/4096 D128": {DEC_A: 190.0, DEC_B: 200.0, DEC_C: 210.0},
    "B8 H32 S1/4096 D128 bf16": {DEC_A: 192.0, DEC_B: 201.0, DEC_C: 212.0},
    "B8 H32 S1/4096 D64": {DEC_A: 105.0, DEC_B: 100.0, DEC_C: 110.0},
    "B8 H32 S1/4096 D64 bf16": {DEC_A: 106.0, DEC_B: 101.0, DEC_C: 111.0},
    "B8 H32/8 S1/4096 D128": {DEC_A: 70.0, DEC_B: 80.0, DEC_C: 60.0},
    "B8 H32/8 S1/4096 D128 bf16": {DEC_A: 71.0, DEC_B: 81.0, DEC_C: 61.0},
    "B1 H32 S1/8192 D128": {DEC_A: 70.0, DEC_B: 90.0, DEC_C: 50.0},
    "B1 H32 S1/8192 D128 bf16": {DEC_A: 71.0, DEC_B: 91.0, DEC_C: 51.0},
}
DECODE_SDPA = {label: min(times.values()) * 1.1 for label, times in DECODE_TIMES.items()}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory):
    """A prefill run (the h100 shapes, fp16) and a decode run (the h100-decode space) exported together."""
    root = tmp_path_factory.mktemp("decode-export")
    prefill = make_run(root / "prefill", PREFILL_TIMES)
    decode = make_run(root / "decode", DECODE_TIMES, sdpa=DECODE_SDPA, name=DECODE_SPACE,
                      space=yaml.safe_load(builtin_spaces()[DECODE_SPACE].read_text()))
    export_runs([prefill, decode], root / "out")
    return root, prefill, decode, load_module(root / "out")


def test_decode_cases_of_a_decode_run_win_with_their_configuration(both) -> None:
    _, prefill, decode, _ = both
    per = per_shape_winners([prefill, decode])
    won = {w.label: w for w in per.winners}
    for label, times in DECODE_TIMES.items():
        assert won[label].config == min(times, key=times.get).key() and won[label].run == str(decode), label
    assert won["B8 H32/8 S1/4096 D128"].shape == Shape("fp16", 8, 32, 8, 1, 4096, 128, False)
    assert won["B8 H32 S1/4096 D128"].sdpa_us == pytest.approx(190.0 * 1.1)
    assert won[LARGE128].config == MMA.key() and per.fallback == MMA.key()   # the first run's geometric-mean winner


def test_the_module_sends_decode_calls_to_the_decode_configurations(both) -> None:
    import torch

    _, _, _, module = both
    a, b, c = DEC_A.key(), DEC_B.key(), DEC_C.key()
    assert module.dispatch("fp16", 128, False, 8, 32, 1, 4096) == a
    assert module.dispatch(torch.bfloat16, 128, False, 8, 32, 1, 4096) == a
    assert module.dispatch("fp16", 128, False, 8, 32, 1, 4096, heads_kv=8) == c       # grouped-query decode
    assert module.dispatch("fp16", 128, False, 1, 32, 1, 8192) == c                   # one long sequence
    assert module.dispatch("fp16", 128, False, 2, 32, 1, 32768) == c
    assert module.dispatch("fp16", 64, False, 8, 32, 1, 4096) == b
    assert module.dispatch("fp16", 64, False, 16, 16, 1, 1000) == b
    assert module.dispatch("fp16", 64, False, 1, 8, 1, 32) == b      # nearer to the TINY prefill case, still decode
    assert module.dispatch("fp16", 64, False, 1, 8, 2, 32) == WMMA.key()               # two queries: prefill
    # prefill calls keep the prefill winners
    assert module.dispatch("fp16", 64, False, 1, 8, 512, 512) == WMMA.key()
    assert module.dispatch("fp16", 64, False, 4, 16, 2048, 2048) == MMA.key()
    assert module.dispatch("fp16", 128, False, 4, 16, 2048, 2048) == MMA.key()
    assert module.dispatch("bf16", 64, False, 4, 16, 2048, 2048) == b   # bf16 was only measured on decode
    # the decode space measures no causal case: causal decode calls take the nearest prefill case
    assert module.dispatch("fp16", 64, True, 1, 8, 1, 512) == WMMA.key()
    assert module.dispatch("bf16", 128, True, 8, 32, 1, 4096) == MMA.key()   # nothing measured: the fallback


def test_the_module_and_the_python_rule_agree_on_decode_and_prefill_calls(both) -> None:
    root, prefill, decode, module = both
    table = per_shape_winners([prefill, decode]).table()
    rng = random.Random(11)
    for _ in range(400):
        heads = rng.choice([8, 16, 32])
        shape = Shape(rng.choice(["fp16", "bf16"]), rng.choice([1, 2, 8, 32]), heads, heads // rng.choice([1, 2, 4]),
                      rng.choice([1, 1, 1, 2, 7, 512, 3000]), rng.choice([1, 32, 77, 512, 4096, 20000]), rng.choice([64, 128]),
                      rng.random() < 0.3)
        expected = nearest(table, shape) or module.FALLBACK
        assert module.dispatch(shape.dtype, shape.head_dim, shape.causal, shape.batch, shape.heads, shape.seq_q,
                               shape.seq_k, heads_kv=shape.heads_kv) == expected, shape


def test_kernel_json_tells_how_decode_calls_are_served(both) -> None:
    root, _, _, module = both
    info = json.loads((root / "out" / "kernel.json").read_text())
    rule = info["dispatch"]["rule"]
    assert "S_q" in rule and "S_k" in rule and "decode call (S_q = 1)" in rule and rule == module.DISPATCH_RULE
    rows = {row["case"]: row for row in info["dispatch"]["table"]}
    row = rows["B8 H32/8 S1/4096 D128 bf16"]
    assert (row["seq_q"], row["seq_k"], row["heads_kv"], row["dtype"], row["config"]) == (1, 4096, 8, "bf16", DEC_C.key())
    assert row["config_short"] == "mma 16x64 w4 q p s16 g4" == DEC_C.short_label()
    assert {rows[label]["config"] for label in (SMALL, SMALL_C, LARGE64)} == {WMMA.key(), MMA.key()}
    measured = {m["case"]: m["config"] for m in info["decode"]["measured_cases"]}
    assert measured == {label: min(times, key=times.get).key() for label, times in DECODE_TIMES.items()}
    assert set(info["decode"]["configs"]) == {DEC_A.key(), DEC_B.key(), DEC_C.key()}
    examples = {e["call"]: e["config"] for e in info["decode"]["examples"]}
    assert examples["B8 H32 S1/4096 D128 fp16"] == DEC_A.key() and examples["B8 H16 S1/4096 D64 bf16"] == DEC_B.key()
    split16 = module.KERNELS[("bf16", 128, False, DEC_C.key())]
    assert [(l["kernel"], l["grid_z"]) for l in split16["launches"]] == [("attn_fwd", 16), ("attn_combine", 1)]
    assert info["runs"][1]["space"] == DECODE_SPACE


def test_leaderboard_per_shape_and_export_of_both_runs_in_the_cli(both, tmp_path: Path) -> None:
    _, prefill, decode, _ = both
    table = cli("leaderboard", str(prefill), str(decode), "--per-shape", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    at = next(i for i, line in enumerate(lines) if line.startswith("B1 H32 S1/8192 D128 bf16"))
    row = " ".join(lines[at:at + 2])   # the configuration column folds onto the next line
    assert DEC_C.key()[:6] in lines[at] and "51.0" in lines[at] and "s16 g4" in row
    done = cli("export", str(prefill), str(decode), "--out", str(tmp_path / "best"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import evo_attention as m\n"
                            "print(m.dispatch('bf16', 128, False, 4, 32, 1, 6000, heads_kv=8))", str(tmp_path / "best")],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == [DEC_C.key()], probe.stderr


def test_old_and_new_decode_labels_are_one_case(tmp_path: Path) -> None:
    """A run that recorded the decode case as ``Sq1 Sk4096`` and one that records ``S1/4096``
    measured the same case: the faster of the two wins it."""
    old = make_run(tmp_path / "old", {SMALL: {WMMA: 20.0}, "B8 H32 Sq1 Sk4096 D128": {WMMA: 90.0}})
    new = make_run(tmp_path / "new", {"B8 H32 S1/4096 D128": {DEC_A: 80.0}}, sdpa={"B8 H32 S1/4096 D128": 85.0},
                   space=yaml.safe_load(builtin_spaces()[DECODE_SPACE].read_text()), name=DECODE_SPACE)
    winners = [w for w in per_shape_winners([old, new]).winners if w.shape.seq_q == 1]
    assert [(w.config, w.median_us, w.candidates) for w in winners] == [(DEC_A.key(), 80.0, 2)]


# -- the split count chosen per call (SPLITS 0) ----------------------------------------------------

AUTO = DEC_A.replace(SPLITS=0, PACK_GQA=1)
"""The K/V split count of each call chosen from its shape (``runtime.grid.decode_splits``)."""
SLOTS = (132, 264, 396)
"""CTAs an H100 holds at once: one, two or three resident CTAs on each of its 132 multiprocessors."""


def _kernel_cut(tiles: int, splits: int) -> list[int]:
    """Tiles of each split as the kernel cuts them: ceil(tiles / splits) each, from the start."""
    per = -(-tiles // splits)
    return [max(0, min(per, tiles - z * per)) for z in range(splits)]


def _efficiency(ctas: int, slots: int) -> float:
    waves = ctas / slots
    return waves / -(-ctas // slots)


@pytest.mark.parametrize("block_n, groups, pack", [(64, 4, 1), (64, 1, 0), (32, 8, 1), (128, 2, 0)])
@pytest.mark.parametrize("slots", SLOTS)
def test_the_split_rule_fills_whole_waves_on_the_issue_shapes(block_n: int, groups: int, pack: int, slots: int) -> None:
    """On each decode shape: no split where the grid already fills 80% of a wave; otherwise every
    split gets at least one K/V tile per warp group, and the count reaches 90% of the best wave
    efficiency any such count reaches, with as few splits as that allows."""
    from evoengineer.paths.mma import decode_splits
    from evoengineer.runtime.grid import FILLED, MAX_SPLITS, NEAR_BEST

    config = AUTO.replace(BLOCK_N=block_n, WARPS=groups, KV_GROUPS=groups, PACK_GQA=pack)
    main = render("flash_attention", config, Variant(128, False, "fp16")).launches[0]
    for batch, heads, heads_kv, seq_kv, _ in ISSUE_SHAPES:
        x, y, _ = main.grid(batch, heads, 1, heads_kv=heads_kv)
        ctas = x * y
        splits = decode_splits(ctas, seq_kv, block_n, groups, slots)
        assert 1 <= splits <= min(MAX_SPLITS, slots)
        tiles = -(-seq_kv // block_n)
        cut = _kernel_cut(tiles, splits)
        assert sum(cut) == tiles and min(cut) >= (groups if splits > 1 else 1), (batch, heads, splits)
        if ctas >= FILLED * slots:
            assert splits == 1
            continue
        allowed = [s for s in range(1, min(MAX_SPLITS, slots) + 1) if min(_kernel_cut(tiles, s)) >= groups]
        best = max(_efficiency(ctas * s, slots) for s in allowed)
        assert _efficiency(ctas * splits, slots) >= NEAR_BEST * best
        assert all(_efficiency(ctas * s, slots) < NEAR_BEST * best for s in allowed if s < splits)


def test_the_split_rule_spreads_a_few_heads_over_every_multiprocessor() -> None:
    """One resident CTA per multiprocessor (132): the small-batch shapes split until the grid covers
    at least 80% of the GPU; a batch of 64 is not split; a longer cache never gets fewer splits."""
    from evoengineer.paths.mma import decode_splits

    for batch, heads, heads_kv, seq_kv, head_dim in ISSUE_SHAPES:
        for ctas in (batch * heads, batch * heads_kv):   # a CTA per query head, or per K/V head (packed)
            splits = decode_splits(ctas, seq_kv, 64, 4, 132)
            if batch == 64:
                assert splits == 1
            else:
                assert ctas * splits >= 0.8 * 132, (batch, heads, heads_kv, ctas, splits)
    assert decode_splits(8, 6000, 64, 4, 132) > decode_splits(8, 600, 64, 4, 132) == 2   # 10 tiles: two splits of 5
    assert decode_splits(8, 1, 64, 4, 132) == decode_splits(8, 255, 64, 4, 132) == 1     # fewer tiles than warp groups
    # one CTA on 100 slots: 100 splits fill the wave, 90 are the fewest within 90% of that; 128 splits at most
    assert decode_splits(1, 10 ** 7, 64, 1, 100) == 90 and 0.9 * 128 <= decode_splits(1, 10 ** 7, 64, 1, 10 ** 4) <= 128


def test_an_auto_split_kernel_declares_its_per_call_launches() -> None:
    """SPLITS 0: the main launch's z is the call's split count, the combine launch runs only above
    one split, the workspace holds a partial row (head_dim + 1 floats) per split, and both kernels
    take ``int kv_splits`` after the features' arguments."""
    rendered = render("flash_attention", AUTO, Variant(128, False, "bf16"))
    main, combine = rendered.launches
    assert main.auto_split == (64, 4) and main.pack_gqa and not main.split_combine
    assert combine.split_combine and combine.auto_split is None
    assert main.grid(2, 28, 1, heads_kv=4, splits=16) == (1, 8, 16) and combine.grid(2, 28, 1, splits=16) == (1, 56, 1)
    assert rendered.workspace_floats(2, 28, 1, 16) == 56 * 16 * 129 and rendered.workspace_floats(2, 28, 1, 1) == 0
    assert rendered.features == () and rendered.arguments[-1] == ("kv_splits", "i32")
    assert AUTO.short_label() == "mma 16x64 w4 q p sauto g4 pk"
    meta = rendered.launch_metadata()
    assert meta["launches"][0]["auto_split"] == {"block_n": 64, "kv_groups": 4} and meta["workspace_floats_per_split"] == 129
    with_features = render("flash_attention", AUTO, Variant(64, True, "fp16", ("seqlens", "softcap", "varlen", "window")))
    assert "// FEATURES seqlens softcap varlen window" in with_features.source
    assert [name for name, _ in with_features.arguments[-9:]] == ["seqlens_k", "leftpad_k", "seqlens_q", "softcap",
                                                                 "cu_seqlens_q", "cu_seqlens_k", "window_left",
                                                                 "window_right", "kv_splits"]
    for kernel in ("attn_fwd(", "attn_combine("):
        signature = next(line for line in with_features.source.splitlines() if kernel in line)
        assert signature.endswith("int window_left, int window_right, int kv_splits) {")
    with pytest.raises(ValueError, match="WRITE_LSE_REQUIRES_SPLITS_1"):
        render("flash_attention", AUTO.replace(WRITE_LSE=1), Variant(128, False, "fp16"))


# sha256 (first 16 hex digits) of decode renders made before SPLITS 0 existed (seqlens: since it
# takes seqlens_q): the fixed split counts must render exactly these
FIXED_SPLITS = {
    (DEC_A, 128, False, "fp16", ()): "8a775176988ba45b",
    (DEC_C.replace(PACK_GQA=1), 64, True, "bf16", ()): "5a15d5de80ad4f1f",
    (DEC_B, 128, False, "bf16", ("seqlens", "softcap", "window")): "c4cece0406f5dda1",
    (DEC_A.replace(SPLITS=1), 64, False, "fp16", ("varlen",)): "b3b8cbcac2cd45da",
}


@pytest.mark.parametrize("key", list(FIXED_SPLITS), ids=lambda k: f"{k[0].short_label()}-D{k[1]}{k[4]}")
def test_fixed_split_counts_render_as_before(key) -> None:
    config, head_dim, causal, dtype, features = key
    source = render("flash_attention", config, Variant(head_dim, causal, dtype, features)).source
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == FIXED_SPLITS[key]
    assert "kv_splits" not in source and "auto_split" not in source and "split_combine" not in source


@pytest.mark.slow
def test_auto_split_kernels_compile_without_spills_for_sm_90a() -> None:
    """The per-call split kernels (plain, packed, one warp, and with every feature) compile for
    sm_90a without spills; the decode seeds with SPLITS 0 are among them."""
    space = load_space(DECODE_SPACE)
    configs = [AUTO, AUTO.replace(PACK_GQA=0), DEC_B.replace(SPLITS=0), AUTO.replace(BLOCK_N=32, WARPS=8, KV_GROUPS=8)]
    assert sum(seed["SPLITS"] == 0 for seed in space.search.seeds) >= 2
    variants = (Variant(128, False, "bf16"), Variant(64, False, "fp16"),
                Variant(128, True, "fp16", ("seqlens", "softcap", "varlen", "window")))
    for config in configs:
        report = build_config(space.template, config, variants, "sm_90a", space.target.smem_per_block)
        assert report.status == "compiled", (config.short_label(), report.error)
        assert report.spill_bytes == 0, config.short_label()


def test_the_export_sizes_an_auto_split_call_as_the_harness_does(tmp_path: Path) -> None:
    """An export of a run whose per-call split configuration wins: kernel.json carries its launches,
    ``kv_splits`` argument and workspace per split; the runtime's split count, grids and workspace
    for each decode shape are the rule's and the search harness's."""
    from evoengineer.runtime import read_kernel_file
    from evoengineer.runtime.grid import call_splits, decode_splits, runs, workspace_floats

    times = {f"B{b} H{h}{f'/{kv}' if kv != h else ''} S1/{s} D{d}": {AUTO: 20.0, DEC_A: 30.0}
             for b, h, kv, s, d in ISSUE_SHAPES}
    run = make_run(tmp_path / "decode", times, sdpa={label: 25.0 for label in times}, name=DECODE_SPACE,
                   space=yaml.safe_load(builtin_spaces()[DECODE_SPACE].read_text()))
    export_runs([run], tmp_path / "out")
    data = read_kernel_file(tmp_path / "out" / "kernel.json")
    for batch, heads, heads_kv, seq_kv, head_dim in ISSUE_SHAPES:
        spec = data.kernels[("fp16", head_dim, False, AUTO.key())]
        rendered = render("flash_attention", AUTO, Variant(head_dim, False, "fp16"))
        assert spec.launches == rendered.launches and spec.args[-1] == ("kv_splits", "i32") == rendered.arguments[-1]
        assert spec.workspace_floats_per_split == rendered.workspace_floats_per_split == head_dim + 1
        assert data.dispatch[("fp16", head_dim, False)].choose(batch, heads, heads_kv, 1, seq_kv) == AUTO.key()
        for slots in SLOTS:
            splits = call_splits(spec.launches, batch, heads, heads_kv, 1, seq_kv, slots)
            assert splits == call_splits(rendered.launches, batch, heads, heads_kv, 1, seq_kv, slots)
            assert splits == decode_splits(batch * heads_kv, seq_kv, 64, 4, slots)   # packed: a CTA per K/V head
            floats = workspace_floats(spec.workspace_floats_per_row, spec.workspace_floats_per_split, batch, heads, 1, splits)
            assert floats == rendered.workspace_floats(batch, heads, 1, splits)
            assert floats == (batch * heads * splits * (head_dim + 1) if splits > 1 else 0)
            grids = [launch.grid(batch, heads, 1, heads_kv=heads_kv, splits=splits) for launch in spec.launches
                     if runs(launch, splits)]
            assert grids == [(1, batch * heads_kv, splits)] + ([(1, batch * heads, 1)] if splits > 1 else [])


def test_the_export_benchmark_has_a_row_per_decode_shape_with_its_bandwidth() -> None:
    """benchmarks/exported_vs_sdpa.py --decode: a row per issue shape; each shows the bytes of K and
    V over each implementation's device time, within 80 columns."""
    from evoengineer.bench.exported import bandwidth_line, decode_shapes, kv_bytes

    rows = {(b, h, kv, s, d) for _, (b, h, kv, _, s, d), _ in decode_shapes()}
    assert set(ISSUE_SHAPES) <= rows and all(dims[3] == 1 for _, dims, _ in decode_shapes())
    dims = (2, 28, 4, 1, 6000, 128)
    assert kv_bytes(dims) == 2 * 2 * 4 * 6000 * 128 * 2 == 24_576_000
    measured = [{"impl": "evo", "status": "ok", "device_us": 12.288}, {"impl": "evo op", "status": "ok", "device_us": 12.3},
                {"impl": "sdpa", "status": "ok", "device_us": 22.8}, {"impl": "fa4", "status": "unsupported"}]
    line = bandwidth_line(measured, kv_bytes(dims), 3352.0)
    assert line == "  K+V 24.6 MB, GB/s (% of 3352): evo 2000 (60%), sdpa 1078 (32%)" and len(line) <= 80
    assert bandwidth_line(measured, kv_bytes(dims), None).endswith(": evo 2000, sdpa 1078")
