"""bf16 and grouped-query attention without a GPU: the space's dtype and H_KV keys, labels,
tolerances, the gate's cases, and every path rendered and compiled with NVRTC in bf16 for
sm_80, sm_89 and sm_90 (the tensor-core instructions checked in the SASS where nvdisasm is
installed)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.gpu import EDGE_SEQS, gate_cases
from evoengineer.gpu.evaluate import EDGE_GQA, check_output
from evoengineer.kernels import KERNEL_ARGS, RenderError, compile_many, render
from evoengineer.kernels.sass import nvdisasm
from evoengineer.space import DEFAULT_TOLERANCES, Case, Config, SpaceError, Variant, load_space

REPO = Path(__file__).resolve().parent.parent


def mma(BM: int, BN: int, warps: int, stages: int = 2, layout: str = "swizzle", q_regs: int = 1, p_regs: int = 1,
        splits: int = 1, groups: int = 1) -> Config:
    return Config(PATH="mma", BLOCK_M=BM, BLOCK_N=BN, WARPS=warps, VEC=8, STAGES=stages, SMEM_LAYOUT=layout,
                  Q_IN_REGS=q_regs, P_IN_REGS=p_regs, SPLITS=splits, KV_GROUPS=groups)


# Each path at its extremes and its switches; one (D, causal) pair each, every pair covered per path.
BUILDS = [
    (Config(PATH="scalar", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1), Variant(64, False, "bf16")),
    (Config(PATH="scalar", BLOCK_M=128, BLOCK_N=128, WARPS=8, VEC=8), Variant(128, True, "bf16")),
    (Config(PATH="scalar", BLOCK_M=64, BLOCK_N=32, WARPS=4, VEC=4), Variant(64, True, "bf16")),
    (Config(PATH="wmma", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1), Variant(128, False, "bf16")),
    (Config(PATH="wmma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8), Variant(64, True, "bf16")),
    (Config(PATH="wmma", BLOCK_M=128, BLOCK_N=64, WARPS=8, VEC=4), Variant(128, True, "bf16")),
    (Config(PATH="wmma", BLOCK_M=32, BLOCK_N=128, WARPS=2, VEC=2), Variant(64, False, "bf16")),
    (mma(64, 64, 4), Variant(64, False, "bf16")),
    (mma(128, 64, 4, stages=3, layout="pad", q_regs=0, p_regs=0), Variant(128, True, "bf16")),
    (mma(64, 128, 4, stages=1, splits=2), Variant(128, False, "bf16")),
    (mma(32, 64, 8, stages=1, groups=4), Variant(64, True, "bf16")),
    (mma(128, 64, 8, stages=1, q_regs=0, groups=2, splits=2), Variant(128, True, "bf16")),
]


def build_id(build: tuple[Config, Variant]) -> str:
    config, variant = build
    return f"{config['PATH']}-m{config['BLOCK_M']}n{config['BLOCK_N']}w{config['WARPS']}-{variant.label()}"


# -- space: dtype, H_KV, tolerances ------------------------------------------------------


def test_builtin_spaces_keep_fp16() -> None:
    for name in ("h100", "l4"):
        space = load_space(name)
        assert space.dtypes == ("fp16",)
        assert all(c.dtype == "fp16" and c.heads_kv == c.heads for c in space.cases)
        assert space.tolerance("fp16") == (space.atol, space.rtol) == (0.02, 0.02)
    assert [v.label() for v in load_space("h100").variants] == ["D64", "D64-causal", "D128", "D128-causal"]


def test_h100_bf16_space() -> None:
    space, fp16 = load_space("h100-bf16"), load_space("h100")
    assert space.dtypes == ("bf16",)
    assert [v.label() for v in space.variants] == ["D64-bf16", "D64-causal-bf16", "D128-bf16", "D128-causal-bf16"]
    assert {c.label() for c in space.cases} >= {"B2 H32/8 S2048 D128 bf16", "B2 H32/8 S2048 D128 causal bf16",
                                                 "B1 H8 S512 D64 bf16"}
    gqa = [c for c in space.cases if c.heads_kv != c.heads]
    assert [(c.batch, c.heads, c.heads_kv, c.seq, c.head_dim) for c in gqa] == [(2, 32, 8, 2048, 128)] * 2
    assert space.tolerance("bf16") == (0.03, 0.03)
    # the configurations of h100, its wgmma path (sm_90a) included, and the same budget
    assert space.target.arch == fp16.target.arch == "sm_90a"
    assert space.params == fp16.params and [c.text for c in space.constraints] == [c.text for c in fp16.constraints]
    assert space.search.budget == fp16.search.budget and space.search.strategy == fp16.search.strategy


@pytest.mark.slow
def test_h100_bf16_space_holds_the_configurations_of_h100() -> None:
    space, fp16 = load_space("h100-bf16"), load_space("h100")
    valid = set(space.valid_configs())
    assert valid == set(fp16.valid_configs())
    assert any(c["PATH"] == "wgmma" and c["LOAD"] == "tma" for c in valid)


def test_dtype_list_gives_both_variants_and_labels(space_file) -> None:
    def edit(d):
        d["problem"]["dtype"] = ["fp16", "bf16"]
        d["problem"]["shapes"] = [{"B": 1, "H": 8, "H_KV": 2, "S": 512, "D": 64, "causal": [False, True]}]

    space = load_space(space_file(edit))
    assert space.dtypes == ("fp16", "bf16")
    assert [c.label() for c in space.cases] == ["B1 H8/2 S512 D64", "B1 H8/2 S512 D64 causal",
                                                "B1 H8/2 S512 D64 bf16", "B1 H8/2 S512 D64 causal bf16"]
    assert [v.label() for v in space.variants] == ["D64", "D64-causal", "D64-bf16", "D64-causal-bf16"]
    assert len({c.label() for c in space.cases}) == len(space.cases)
    # --shape B,H,S,D selects by query heads, every dtype
    assert len(space.with_shapes([(1, 8, 512, 64)]).cases) == 4


def test_case_and_variant_defaults_are_the_old_ones() -> None:
    old = Case(1, 8, 512, 64, True)
    assert old == Case(1, 8, 512, 64, True, heads_kv=8, dtype="fp16") and hash(old) == hash(Case(1, 8, 512, 64, True, 8))
    assert old.heads_kv == 8 and old.variant == Variant(64, True) == Variant(64, True, "fp16")
    assert old.label() == "B1 H8 S512 D64 causal" and old.variant.label() == "D64-causal"
    gqa = Case(2, 32, 2048, 128, False, heads_kv=8, dtype="bf16")
    assert gqa.label() == "B2 H32/8 S2048 D128 bf16" and gqa.variant.label() == "D128-bf16"
    assert gqa.flops() == 4.0 * 2 * 32 * 2048 * 2048 * 128   # query heads count, K/V sharing does not
    with pytest.raises(ValueError, match="divide"):
        Case(1, 8, 16, 64, False, heads_kv=3)
    with pytest.raises(ValueError, match="dtype"):
        Case(1, 8, 16, 64, False, dtype="fp32")


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (lambda d: d["problem"]["shapes"][0].update(H_KV=3), "problem.shapes[0].H_KV", "must divide the query heads H=8, got 3"),
        (lambda d: d["problem"]["shapes"][0].update(H_KV=16), "problem.shapes[0].H_KV", "must divide the query heads H=8, got 16"),
        (lambda d: d["problem"]["shapes"][0].update(H_KV=0), "problem.shapes[0].H_KV", "expected an integer >= 1"),
        (lambda d: d["problem"]["shapes"][0].update(H_KV="two"), "problem.shapes[0].H_KV", "expected an integer"),
        (lambda d: d["problem"]["shapes"][0].update(HKV=2), "problem.shapes[0].HKV", "did you mean 'H_KV'"),
        (lambda d: d["problem"].update(dtype="fp32"), "problem.dtype", "expected one of fp16, bf16"),
        (lambda d: d["problem"].update(dtype="bf61"), "problem.dtype", "did you mean 'bf16'"),
        (lambda d: d["problem"].update(dtype=[]), "problem.dtype", "non-empty list"),
        (lambda d: d["problem"].update(dtype=["bf16", "bf16"]), "problem.dtype", "repeat"),
        (lambda d: (d["problem"].update(dtype="bf16"), d["target"].update(arch="sm_75")), "problem.dtype", "sm_80 or newer"),
        (lambda d: d["tolerances"].update(bf16={"atl": 0.1}), "tolerances.bf16.atl", "did you mean 'atol'"),
        (lambda d: d["tolerances"].update(bf16={"atol": 0}), "tolerances.bf16.atol", "positive"),
        (lambda d: d["tolerances"].update(bf16=0.05), "tolerances.bf16", "expected a mapping"),
        (lambda d: d["tolerances"].update(fp32={"atol": 0.1}), "tolerances.fp32", "unknown key"),
    ],
)
def test_dtype_and_gqa_errors_name_file_and_key(space_file, edit, key, words) -> None:
    path = space_file(edit)
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.key == key, str(err.value)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_h_kv_is_one_line_exit_2_in_the_cli(space_file) -> None:
    path = space_file(lambda d: d["problem"]["shapes"][0].update(H_KV=3))
    proc = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: problem.shapes[0].H_KV: K/V heads must divide the query heads H=8, got 3"]


@pytest.mark.parametrize(
    "tolerances, dtypes, fp16, bf16",
    [
        ({}, ["fp16", "bf16"], (0.02, 0.02), DEFAULT_TOLERANCES["bf16"]),
        ({"atol": 0.01, "rtol": 0.01}, ["fp16", "bf16"], (0.01, 0.01), (0.01, 0.01)),   # explicit values hold for every dtype
        ({"atol": 0.01, "rtol": 0.01, "bf16": {"atol": 0.05}}, ["fp16", "bf16"], (0.01, 0.01), (0.05, 0.01)),
        ({"bf16": {"atol": 0.04, "rtol": 0.05}}, ["bf16"], (0.02, 0.02), (0.04, 0.05)),
        ({"fp16": {"atol": 0.001}}, ["fp16"], (0.001, 0.02), DEFAULT_TOLERANCES["bf16"]),
    ],
)
def test_tolerance_per_dtype(space_file, tolerances, dtypes, fp16, bf16) -> None:
    def edit(d):
        d["tolerances"] = tolerances
        d["problem"]["dtype"] = dtypes

    space = load_space(space_file(edit))
    assert space.tolerance("fp16") == pytest.approx(fp16) and (space.atol, space.rtol) == pytest.approx(fp16)
    assert space.tolerance("bf16") == pytest.approx(bf16)


# -- the gate's cases ---------------------------------------------------------------------


def test_gate_cases_carry_dtype_and_add_gqa_edges_only_for_gqa(space_file) -> None:
    def edit(d):
        d["problem"]["dtype"] = ["fp16", "bf16"]
        d["problem"]["shapes"] = [{"B": 1, "H": 8, "S": 512, "D": 64, "causal": False},
                                  {"B": 2, "H": 32, "H_KV": 8, "S": 300, "D": 64, "causal": True}]

    space = load_space(space_file(edit))
    plain = gate_cases(space, Variant(64, False, "bf16"))
    assert all(c.dtype == "bf16" and c.variant == Variant(64, False, "bf16") for c in plain)
    assert [(c.batch, c.heads, c.seq) for c in plain] == [(1, 8, 512), *EDGE_SEQS]
    assert all(c.heads_kv == c.heads for c in plain)
    grouped = gate_cases(space, Variant(64, True, "fp16"))
    assert grouped[0].label() == "B2 H32/8 S300 D64 causal"
    assert [(c.batch, c.heads, c.heads_kv, c.seq) for c in grouped if c.heads_kv != c.heads][1:] == list(EDGE_GQA)
    assert {c.seq for c in grouped} >= {1, 5, 77, 257}
    # the fp16 built-in spaces gate exactly what they gated before
    h100 = load_space("h100")
    assert [c.label() for c in gate_cases(h100, Variant(64, True))] == [
        "B1 H8 S512 D64 causal", "B4 H16 S2048 D64 causal", "B1 H2 S1 D64 causal", "B2 H3 S77 D64 causal",
        "B1 H2 S5 D64 causal", "B1 H1 S257 D64 causal"]


# -- the bf16 tolerance against bf16 numerics ----------------------------------------------


def _bf16_kernel_numerics(q, k, v, causal: bool, block_n: int = 64):
    """What the tensor-core paths compute in bf16: fp32 scores and online softmax over K/V tiles,
    P rounded to bf16 for P.V, fp32 accumulation, O rounded to bf16."""
    import torch

    qf, kf, vf = q.float(), k.float(), v.float()
    seq_q, seq_k, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    m = torch.full((*q.shape[:-1], 1), -math.inf)
    l = torch.zeros_like(m)
    o = torch.zeros_like(qf)
    rows = torch.arange(seq_q)[:, None]
    for n0 in range(0, seq_k, block_n):
        s = qf @ kf[..., n0:n0 + block_n, :].transpose(-1, -2) / math.sqrt(dim)
        if causal:
            s = s.masked_fill(torch.arange(n0, min(n0 + block_n, seq_k))[None, :] > rows, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - m_use), torch.exp(s - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + p.to(torch.bfloat16).float() @ vf[..., n0:n0 + block_n, :]
        m = m_new
    return (o / l).to(torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_tolerance_has_margin_over_bf16_attention_error(causal: bool) -> None:
    """bf16 attention (torch's bf16 SDPA on the CPU, and the kernels' numerics: P and O rounded to
    bf16) passes the gate's check at a fifth of the bf16 default, on the edge shapes and a space shape."""
    import torch
    import torch.nn.functional as F

    atol, rtol = DEFAULT_TOLERANCES["bf16"]
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for batch, heads, seq, dim in [(1, 2, 1, 64), (2, 3, 77, 64), (1, 2, 5, 128), (1, 1, 257, 128), (1, 8, 512, 64)]:
        q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        for out in (F.scaled_dot_product_attention(q, k, v, is_causal=causal), _bf16_kernel_numerics(q, k, v, causal)):
            reason, _, _ = check_output(out, ref, atol / 5, rtol / 5)
            assert not reason, (batch, heads, seq, dim, reason)
            worst = max(worst, float(((out.float() - ref).abs() / (1 + ref.abs())).max()))
    assert worst > 1e-3, "bf16 rounding is visible in these figures (the inputs really are bf16)"


# -- render and compile --------------------------------------------------------------------


def test_kernel_args_name_kv_heads() -> None:
    names = [a.split()[-1].lstrip("*") for a in KERNEL_ARGS.split(",")]
    assert names[:10] == ["Q", "K", "V", "O", "WS", "B", "H", "H_kv", "S_q", "S_k"]
    assert names[-1] == "scale_log2" and len(names) == 23


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("build", BUILDS, ids=build_id)
def test_every_path_reads_kv_through_the_kv_head(build, dtype: str) -> None:
    """K and V base pointers use the K/V head (h / (H / H_kv)), O and Q the query head."""
    config, variant = build
    source = render("flash_attention", config, Variant(variant.head_dim, variant.causal, dtype)).source
    assert re.search(r"h_kv = (PACK \? [^:]+ : )?h / \(H / H_kv\)", source)   # PACK_GQA: a grid row per K/V head
    body = [l for l in source.splitlines() if "long long k_sh" not in l]   # not the kernels' signatures
    kv_lines = [l for l in body if re.search(r"\b[kv]_sh\b", l)]
    assert len(kv_lines) == 2 and all("h_kv" in l for l in kv_lines), kv_lines
    qo_lines = [l for l in body if re.search(r"\b[qo]_sh\b", l)]
    assert qo_lines and not any("h_kv" in l for l in qo_lines), qo_lines


@pytest.mark.parametrize("build", BUILDS, ids=build_id)
def test_bf16_render_uses_bf16_instructions_only(build) -> None:
    config, variant = build
    bf16 = render("flash_attention", config, variant)
    fp16 = render("flash_attention", config, Variant(variant.head_dim, variant.causal))
    assert bf16.variant.dtype == "bf16" and bf16.launch_metadata()["variant"]["dtype"] == "bf16"
    assert bf16.launches == fp16.launches and bf16.workspace_floats_per_row == fp16.workspace_floats_per_row
    assert "DTYPE=bf16" in bf16.source.splitlines()[0] and "DTYPE" not in fp16.source.splitlines()[0]
    for instr in ("cvt.f32.bf16", "cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32"):
        assert instr in bf16.source and instr not in fp16.source
    assert not re.search(r"(?<!b)f16", bf16.source), "an fp16 instruction in a bf16 kernel"
    path = config["PATH"]
    if path == "mma":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in bf16.source
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in fp16.source
    if path == "wmma":
        assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32" in bf16.source
        assert "wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 { %0, %1, %2, %3 }" in bf16.source
        assert "wmma.load.a.sync.aligned.row.m16n16k16.shared.f16 { %0, %1, %2, %3, %4, %5, %6, %7 }" in fp16.source


def test_unknown_dtype_or_unknown_path_is_a_render_error() -> None:
    config = Config(PATH="scalar", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8)
    with pytest.raises(RenderError, match="UNSUPPORTED_DTYPE"):
        render("flash_attention", config, Variant(64, False, "fp8"))
    with pytest.raises(RenderError, match="UNKNOWN_PATH"):
        render("flash_attention", config.replace(PATH="tma"), Variant(64, False, "bf16"))


@pytest.fixture(scope="module")
def compiled() -> dict:
    sources = [render("flash_attention", c, v).source for c, v in BUILDS]
    workers = max(1, min(8, os.cpu_count() or 1))
    out = {}
    for arch in ("sm_80", "sm_90"):
        out.update({(i, arch): r for i, r in enumerate(compile_many(sources, arch, workers=workers))})
    # sm_89 (L4): one configuration per path
    picks = [0, 4, 7]
    out.update({(i, "sm_89"): r for i, r in zip(picks, compile_many([sources[i] for i in picks], "sm_89", workers=workers))})
    return out


def _compiled_cases() -> list:
    return [pytest.param(i, arch, id=f"{build_id(BUILDS[i])}-{arch}") for arch in ("sm_80", "sm_90") for i in range(len(BUILDS))] + [
        pytest.param(i, "sm_89", id=f"{build_id(BUILDS[i])}-sm_89") for i in (0, 4, 7)]




@pytest.mark.parametrize("index, arch", _compiled_cases())
def test_bf16_paths_compile(index: int, arch: str, compiled: dict) -> None:
    config, variant = BUILDS[index]
    result = compiled[(index, arch)]
    assert result.ok, f"{build_id(BUILDS[index])} {arch}: {result.error}\n{result.log[-2000:]}"
    assert "attn_fwd" in result.kernels and result.static_smem == 0
    assert ("attn_combine" in result.kernels) == (config.get("SPLITS", 1) > 1)


@pytest.mark.parametrize("index", [1, 4, 7, 11], ids=lambda i: build_id(BUILDS[i]))
def test_bf16_costs_no_more_registers_than_fp16(index: int, compiled: dict) -> None:
    config, variant = BUILDS[index]
    fp16 = compile_many([render("flash_attention", config, Variant(variant.head_dim, variant.causal)).source], "sm_90")
    fp16, bf16 = next(fp16), compiled[(index, "sm_90")]
    assert fp16.ok and bf16.ok
    assert bf16.registers <= fp16.registers and bf16.spill_bytes <= fp16.spill_bytes, (fp16.kernels, bf16.kernels)


@pytest.mark.parametrize("index", [3, 4, 7, 8, 11], ids=lambda i: build_id(BUILDS[i]))
def test_bf16_tensor_core_paths_run_bf16_hmma(index: int, compiled: dict) -> None:
    """The SASS of a bf16 tensor-core kernel holds bf16 HMMAs and no fp16 ones (needs nvdisasm)."""
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    for arch in ("sm_80", "sm_90"):
        sass = subprocess.run([tool, compiled[(index, arch)].cubin_path], capture_output=True, text=True, timeout=120).stdout
        hmma = re.findall(r"HMMA\.\w+(?:\.\w+)*", sass)
        assert hmma and all(op.endswith(".BF16") for op in hmma), (arch, sorted(set(hmma)))
        assert re.search(r"F2FP\.BF16", sass), arch


def test_check_command_on_the_bf16_space(tmp_path: Path) -> None:
    import json

    proc = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", "h100-bf16", "--limit", "3", "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["summary"]["variants"] == ["D64-bf16", "D64-causal-bf16", "D128-bf16", "D128-causal-bf16"]
    assert data["summary"]["compiled"] == 3 and data["summary"]["failed"] == 0


TINY_MIXED = {
    "name": "tiny-mixed",
    "target": {"name": "any", "arch": "sm_90", "sms": 132, "smem_per_block": 232448},
    "problem": {"dtype": ["fp16", "bf16"], "shapes": [{"B": 1, "H": 8, "H_KV": 2, "S": 256, "D": 64, "causal": [False, True]}]},
    "template": "flash_attention",
    "params": {"PATH": ["scalar", "mma"], "BLOCK_M": [64], "BLOCK_N": [64], "WARPS": [4], "VEC": [8]},
    "search": {"strategy": "grid", "budget": 2, "top_k": 1},
}


def test_export_of_a_mixed_dtype_run(tmp_path: Path) -> None:
    """A run over fp16 and bf16 exports one kernel per (head dim, causal, dtype); the module
    takes either dtype and names both when it rejects another."""
    import json

    import yaml

    recording = tmp_path / "recording.jsonl"
    records = [{"header": {"space_inline": TINY_MIXED}}]
    for path, us in (("scalar", 50.0), ("mma", 20.0)):
        config = Config(PATH=path, BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8)
        records.append({"config": config.to_dict(), "key": config.key(), "status": "ok", "reason": "", "objective_us": us})
    recording.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_MIXED, sort_keys=False))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)

    run, out = tmp_path / "run", tmp_path / "best"
    done = cli("search", "--space", "tiny.yaml", "--replay", str(recording), "--run-dir", str(run), "--quiet")
    assert done.returncode == 0, done.stderr + done.stdout
    exported = cli("export", str(run), "--rank", "1", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    info = json.loads((out / "kernel.json").read_text())
    assert info["config"]["PATH"] == "mma"
    plain = [k for k in info["kernels"] if set(k.get("features", ())) <= {"gqa"}]  # the others: padding, window, cap
    assert sorted((k["head_dim"], k["causal"], k["dtype"]) for k in plain) == [
        (64, False, "bf16"), (64, False, "fp16"), (64, True, "bf16"), (64, True, "fp16")]
    assert len(info["kernels"]) == 2 * len(plain)  # and one kernel with every feature per variant
    bf16_causal = next(k for k in plain if k["dtype"] == "bf16" and k["causal"])
    assert (out / bf16_causal["source"]).read_text().count("f32.bf16.bf16.f32") == 1
    check = subprocess.run(
        [sys.executable, "-c",
         "import sys, torch; sys.path.insert(0, sys.argv[1]); from evo_attention import attention, KERNELS, DTYPES\n"
         "print(sorted({k[:3] for k in KERNELS}), DTYPES)\n"
         "q = torch.zeros(1, 8, 8, 64)\n"
         "try:\n    attention(q, q[:, :2], q[:, :2])\nexcept (TypeError, ValueError) as e:\n    print('rejected:', e)\n",
         str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "[('bf16', 64, False), ('bf16', 64, True), ('fp16', 64, False), ('fp16', 64, True)] ['bf16', 'fp16']" in check.stdout, check.stdout + check.stderr
    assert "rejected: attention: dtype torch.float32 has no exported kernel; this module covers torch.bfloat16, torch.float16" in check.stdout
