"""The backward's kernels and the LSE forward, rendered and compiled with NVRTC (no GPU needed)."""
from __future__ import annotations

import difflib
import itertools

import pytest

from evoengineer.kernels import RenderError, compile_many, render
from evoengineer.kernels.backward_rules import (
    BACKWARD_CONFIGS,
    BACKWARD_TEMPLATE,
    SPILLS_ALLOWED,
    backward_arguments,
    backward_config,
    backward_launches,
    default_config,
    deterministic,
    forward_lse_config,
    problems,
    smem_bytes,
)
from evoengineer.space import Config, Variant

ARCHS = ("sm_80", "sm_90")
SMEM_LIMIT_SM80 = 163 * 1024


def _body(source: str) -> str:
    """The rendered source without its first line (the header names the configuration)."""
    return source.split("\n", 1)[1]


FORWARD_CONFIGS = [
    Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SMEM_LAYOUT="swizzle", Q_IN_REGS=1, P_IN_REGS=1),
    Config(PATH="mma", BLOCK_M=128, BLOCK_N=64, WARPS=4, VEC=8, STAGES=1, SMEM_LAYOUT="pad", Q_IN_REGS=0, P_IN_REGS=0),
    Config(PATH="mma", BLOCK_M=32, BLOCK_N=64, WARPS=4, VEC=8, STAGES=1, KV_GROUPS=2),
    Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, PACK_GQA=1),
    Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, SPLITS=2),
]
VARIANTS = [Variant(d, c, t) for d, c, t in itertools.product((64, 128), (False, True), ("fp16", "bf16"))]


@pytest.mark.parametrize("config", FORWARD_CONFIGS, ids=lambda c: c.short_label())
def test_write_lse_0_renders_the_inference_kernel_unchanged(config: Config) -> None:
    for variant in VARIANTS:
        plain = render("flash_attention", config, variant)
        off = render("flash_attention", config.replace(WRITE_LSE=0), variant)
        assert _body(off.source) == _body(plain.source)
        assert off.launches == plain.launches and off.workspace_floats_per_row == plain.workspace_floats_per_row


@pytest.mark.parametrize("config", FORWARD_CONFIGS[:4], ids=lambda c: c.short_label())
def test_write_lse_1_only_adds_lines_and_one_workspace_float_per_row(config: Config) -> None:
    variant = Variant(128, True, "bf16")
    off = _body(render("flash_attention", config, variant).source).splitlines()
    on_rendered = render("flash_attention", config.replace(WRITE_LSE=1), variant)
    on = _body(on_rendered.source).splitlines()
    ops = [op for op in difflib.SequenceMatcher(a=off, b=on, autojunk=False).get_opcodes() if op[0] != "equal"]
    assert ops and all(op[0] == "insert" for op in ops)
    added = [line for op in ops for line in on[op[3]:op[4]]]
    assert any("WS[" in line for line in added)
    assert on_rendered.workspace_floats_per_row == 1


def test_write_lse_needs_one_split() -> None:
    config = FORWARD_CONFIGS[4].replace(WRITE_LSE=1)
    with pytest.raises(RenderError, match="WRITE_LSE_REQUIRES_SPLITS_1"):
        render("flash_attention", config, Variant(64, False))


def test_lse_forward_compiles_without_spills() -> None:
    jobs = [(arch, v) for arch in ARCHS for v in VARIANTS]
    sources = [render("flash_attention", forward_lse_config(v.head_dim), v).source for _, v in jobs]
    for (arch, variant), result in zip(jobs, _compile(sources, jobs)):
        assert result.ok, f"{arch} {variant.label()}: {result.error}"
        assert result.spill_bytes == 0, f"{arch} {variant.label()}: {result.spill_bytes} bytes spilled"


def _compile(sources: list[str], jobs: list[tuple[str, Variant]]) -> list:
    """Compile each source for its job's arch (one NVRTC process per arch batch)."""
    results: list = [None] * len(sources)
    for arch in ARCHS:
        idx = [i for i, (a, _) in enumerate(jobs) if a == arch]
        for i, res in zip(idx, compile_many([sources[i] for i in idx], arch, workers=2)):
            results[i] = res
    return results


BACKWARD_CASES = [(d, name, config) for d, named in BACKWARD_CONFIGS.items() for name, config in named.items()]


@pytest.mark.parametrize("head_dim,name,config", BACKWARD_CASES, ids=[f"D{d}-{n}" for d, n, _ in BACKWARD_CASES])
def test_backward_config_compiles_for_sm80_and_sm90_within_its_spill_allowance(head_dim: int, name: str, config: Config) -> None:
    assert problems(config, head_dim) == []
    variants = [v for v in VARIANTS if v.head_dim == head_dim]
    jobs = [(arch, v) for arch in ARCHS for v in variants]
    rendered = [render(BACKWARD_TEMPLATE, config, v) for _, v in jobs]
    want_smem = smem_bytes(config, head_dim)
    for r in rendered:
        launches = backward_launches(r)
        assert {l.kernel: l.smem for l in launches} == want_smem
        assert max(want_smem.values()) <= SMEM_LIMIT_SM80
        assert [l.kernel for l in launches][:2] == ["attn_bwd_pre", "attn_bwd_dkdv"]
        assert [l.over for l in launches] == ["q", "kv", "q"]
        names = [n for n, _ in backward_arguments(r)]
        assert names[:11] == ["Q", "K", "V", "O", "dO", "LSE", "Dsum", "dQacc", "dQ", "dK", "dV"]
    report = []
    for (arch, variant), result in zip(jobs, _compile([r.source for r in rendered], jobs)):
        assert result.ok, f"{arch} {variant.label()}: {result.error}"
        assert set(result.kernels) == set(want_smem)
        report.append(f"{arch} {variant.label()}: " + ", ".join(
            f"{k} {v.registers} regs {v.spills} B spilled" for k, v in sorted(result.kernels.items())))
        assert result.spill_bytes <= SPILLS_ALLOWED.get((head_dim, name), 0), report[-1]
    print(f"\nD{head_dim} {name}:\n  " + "\n  ".join(report))


HALVES_CASES = [(64, backward_config(128, 128, dkdv="halves")), (128, backward_config(64, 128, dkdv="halves")),
                (64, backward_config(64, 128, dkdv="halves")), (128, backward_config(64, 128, dkdv="halves", dq_mode="separate"))]


@pytest.mark.parametrize("head_dim,config", [  # the fast suite compiles the first; the slow run (--slow) every one
    pytest.param(d, c, id=f"D{d}-{c.short_label()}", marks=[pytest.mark.slow] if i else []) for i, (d, c) in enumerate(HALVES_CASES)])
def test_halves_compile_without_spills_where_their_tiles_twins_spill(head_dim: int, config: Config) -> None:
    """DKDV=halves computes a warp's S and dP by column halves: the tiles that spill at 255 registers
    (128 x 128 at D64, 64 x 128 at D128) fit, on sm_80 and sm_90, fp16 and bf16, full and causal; the
    launches and shared memory are the tiles kernel's."""
    twin = config.replace(DKDV="tiles")
    assert problems(config, head_dim) == [] and smem_bytes(config, head_dim) == smem_bytes(twin, head_dim)
    variants = [v for v in VARIANTS if v.head_dim == head_dim]
    jobs = [(arch, v) for arch in ARCHS for v in variants]
    rendered = [render(BACKWARD_TEMPLATE, config, v) for _, v in jobs]
    for r, (_, v) in zip(rendered, jobs):
        assert backward_launches(r) == backward_launches(render(BACKWARD_TEMPLATE, twin, v))
    report = []
    for (arch, variant), result in zip(jobs, _compile([r.source for r in rendered], jobs)):
        assert result.ok, f"{arch} {variant.label()}: {result.error}"
        dkdv = result.kernels["attn_bwd_dkdv"]
        report.append(f"{arch} {variant.label()}: {dkdv.registers} regs {dkdv.spills} B spilled")
        assert result.spill_bytes == 0, report[-1]
    print(f"\nD{head_dim} {config.short_label()}:\n  " + "\n  ".join(report))


def test_halves_change_only_the_dkdv_kernel() -> None:
    """The preprocess, dQ conversion and separate dQ kernels of halves render as those of tiles."""
    variant = Variant(128, True, "bf16")
    for dq_mode in ("atomic", "separate"):
        tiles = _body(render(BACKWARD_TEMPLATE, backward_config(64, 128, dkdv="tiles", dq_mode=dq_mode), variant).source)
        halves = _body(render(BACKWARD_TEMPLATE, backward_config(64, 128, dkdv="halves", dq_mode=dq_mode), variant).source)
        assert tiles != halves
        for text in (tiles, halves):
            assert text.count("attn_bwd_dkdv(") == 1
        before = lambda text: text.split("attn_bwd_dkdv(")[0].rsplit("\n// DKDV=tiles", 1)[0]
        after = lambda text: text.split("attn_bwd_dkdv(")[1].split("\n}\n", 1)[1]
        assert before(tiles) == before(halves) and after(tiles) == after(halves)


def test_the_dq_mode_picks_the_last_kernel_and_determinism() -> None:
    variant = Variant(64, True)
    atomic = backward_launches(render(BACKWARD_TEMPLATE, backward_config(64, 64), variant))
    separate = backward_launches(render(BACKWARD_TEMPLATE, backward_config(64, 64, dq_mode="separate"), variant))
    assert atomic[-1].kernel == "attn_bwd_dq_convert" and separate[-1].kernel == "attn_bwd_dq"
    assert separate[-1].rows_per_cta == 64 and separate[-1].block == (128, 1, 1)
    assert not deterministic(backward_config(64, 64)) and deterministic(backward_config(64, 64, dq_mode="separate"))
    assert deterministic(default_config(128, deterministic_dq=True)) and not deterministic(default_config(128))


def test_grids_run_over_query_rows_or_key_rows() -> None:
    launches = backward_launches(render(BACKWARD_TEMPLATE, backward_config(32, 128), Variant(128, False)))
    pre, dkdv, convert = launches
    assert pre.grid(2, 8, 2, 77, 257) == (-(-77 // pre.rows_per_cta), 16, 1)
    assert dkdv.grid(2, 8, 2, 77, 257) == (3, 4, 1)   # ceil(257 / 128) key tiles x B * H_kv
    assert convert.grid(2, 8, 2, 1, 5) == (1, 16, 1)


@pytest.mark.parametrize("config,head_dim,fragment", [
    (backward_config(64, 96), 64, "BLOCK_N 96"),
    (backward_config(128, 64), 64, "BLOCK_M 128"),
    (backward_config(64, 64, stages=3), 64, "STAGES 3"),
    (backward_config(64, 64, dq_mode="sometimes"), 64, "DQ_MODE"),
    (backward_config(64, 64, dq_block_n=48), 64, "DQ_BLOCK_M"),
    (backward_config(64, 64), 96, "HEAD_DIM 96"),
    (backward_config(64, 64).replace(PATH="wmma"), 64, "PATH"),
    (backward_config(32, 128, dkdv="tiles"), 128, "BLOCK_M 32"),
    (backward_config(64, 128, dkdv="diagonal"), 128, "DKDV"),
    (backward_config(64, 64, dkdv="halves"), 64, "mma.halves"),
    (backward_config(32, 128, dkdv="halves"), 64, "BLOCK_M 32"),
])
def test_invalid_backward_configs_are_named_by_the_rules_and_refused_by_the_template(
        config: Config, head_dim: int, fragment: str) -> None:
    found = problems(config, head_dim)
    assert found and any(fragment in line for line in found)
    with pytest.raises(RenderError):
        render(BACKWARD_TEMPLATE, config, Variant(head_dim, False))


def test_reference_gradients_are_top_left_causal_and_sum_grouped_heads() -> None:
    """The gate's references (on the CPU here): SDPA's math autograd equals a hand-written attention's
    with a top-left causal mask over seq_q != seq_k and K/V repeated over each group of query heads."""
    import math

    import torch

    from evoengineer.gpu.backward import reference_lse, rule_check, sdpa_gradients

    gen = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 4, 5, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(2))
    o, dq, dk, dv = sdpa_gradients(q, k, v, do, True, None, torch.float32)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    scores = qq @ kk.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(16)
    scores = scores.masked_fill(~torch.ones(5, 9, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(scores, -1) @ vv.repeat_interleave(2, 1)
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    for ours, ref in zip((o, dq, dk, dv), (out, *grads)):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_lse(q, k, True, None), torch.logsumexp(scores, -1).detach())
    _, *low = sdpa_gradients(q.half(), k.half(), v.half(), do.half(), True, None)
    assert low[0].dtype == torch.float16
    assert rule_check("dq", dq.half(), dq, low[0]).ok
    assert not rule_check("dq", torch.full_like(dq, float("nan")), dq, low[0]).ok
    assert not rule_check("dq", dq + 10 * (low[0].float() - dq).abs().max() + 1, dq, low[0]).ok
