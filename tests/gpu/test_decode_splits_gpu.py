"""The K/V split count chosen per call (SPLITS 0, ``runtime.grid.decode_splits``) on the GPU:
the kernels against fp32 SDPA under flash-attn's error rule on the decode shapes the rule is
for and on odd cache lengths, fp16 and bf16, grouped-query and not; the search's launcher and
an export choose the same count; the exported op serves them, also captured in a CUDA graph
(the count is a function of the shape, so a captured call stays valid).

flash-attn's rule: ``max|out - ref_fp32| <= 2 * max|out_lowp - ref_fp32| + eps``, ``out_lowp``
SDPA on the fp16/bf16 inputs, ``eps`` twice the rounding of the reference to the dtype.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoengineer.kernels import compile_source, render
from evoengineer.resources import builtin_spaces
from evoengineer.results import export_runs
from evoengineer.space import Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency, but keep collection safe
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def auto(block_n: int, groups: int, stages: int, pack: int) -> Config:
    return Config(PATH="mma", BLOCK_M=16, BLOCK_N=block_n, WARPS=groups, VEC=8, STAGES=stages, SMEM_LAYOUT="swizzle",
                  Q_IN_REGS=1, P_IN_REGS=1, SPLITS=0, KV_GROUPS=groups, PACK_GQA=pack)


CONFIGS = {
    "n64-g4-st1-pk": auto(64, 4, 1, 1),
    "n64-g1-st2": auto(64, 1, 2, 0),
    "n32-g8-st1": auto(32, 8, 1, 0),
}
ISSUE_SHAPES = [(8, 32, 8, 4096, 128), (2, 28, 4, 6000, 128), (4, 16, 16, 4096, 64), (64, 32, 8, 2048, 128),
                (1, 32, 32, 32768, 128)]
"""(B, H, H_kv, S_kv, D), q_len 1: the shapes the per-call split count is for."""
ODD_SHAPES = [(b, h, kv, s, d) for s in (1, 77, 4099) for b, h, kv, d in ((2, 28, 4, 128), (1, 8, 8, 64), (3, 8, 2, 128))]
"""Cache lengths of one key, of no whole tile, one past a power of two; grouped-query and not."""
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def _kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel

    rendered = render("flash_attention", config, variant)
    compiled = compile_source(rendered.source, "sm_%d%d" % torch.cuda.get_device_capability())
    assert compiled.ok, compiled.error
    return AttentionKernel(rendered, compiled.cubin_path)


def _inputs(batch: int, heads: int, heads_kv: int, seq_kv: int, head_dim: int, dtype: str, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, TORCH_DTYPES[dtype])
    q = torch.randn(batch, heads, 1, head_dim, generator=gen, device="cuda", dtype=dt)
    k, v = (torch.randn(batch, heads_kv, seq_kv, head_dim, generator=gen, device="cuda", dtype=dt) for _ in range(2))
    return q, k, v


def assert_flash_rule(out, q, k, v) -> None:
    """flash-attn's error rule against fp32 SDPA (see the module's docstring)."""
    import torch.nn.functional as F

    from evoengineer.gpu.evaluate import reference

    ref = reference(q, k, v, False, None)
    lowp = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1]).float()
    rounded = ref.to(q.dtype)
    eps = 2 * ((rounded + 0.3 - 0.3) - rounded).abs().max().item()
    assert torch.isfinite(out).all()
    err, bound = (out.float() - ref).abs().max().item(), 2 * (lowp - ref).abs().max().item() + eps
    assert err <= bound, (tuple(q.shape), tuple(k.shape), err, bound)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_call_splits_match_sdpa_on_the_decode_shapes(name: str, dtype: str) -> None:
    """Every output element written (NaN-poisoned), within flash-attn's bound; a few sequences over
    a long cache split over many CTAs, a batch of 64 not at all."""
    kernels = {d: _kernel(CONFIGS[name], Variant(d, False, dtype)) for d in (64, 128)}
    chosen = {}
    for shape in ISSUE_SHAPES + ODD_SHAPES:
        batch, heads, heads_kv, seq_kv, head_dim = shape
        q, k, v = _inputs(*shape, dtype, seed=seq_kv)
        kernel = kernels[head_dim]
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        torch.cuda.synchronize()
        assert_flash_rule(out, q, k, v)
        chosen[shape] = kernel.splits(q, k)
    assert chosen[(64, 32, 8, 2048, 128)] == 1
    assert chosen[(2, 28, 4, 6000, 128)] > 1 and chosen[(1, 32, 32, 32768, 128)] > 1
    assert all(chosen[s] == 1 for s in ODD_SHAPES if s[3] == 1)   # one key: one tile, nothing to split


def test_a_model_layout_cache_and_a_growing_cache() -> None:
    """k and v as views of a (B, S, H_kv, D) cache, read through their strides; one kernel serving
    a cache that grows token by token (its split count, grid and workspace follow each length)."""
    kernel = _kernel(CONFIGS["n64-g4-st1-pk"], Variant(128, False, "bf16"))
    cache = torch.randn(2, 2, 6100, 4, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 28, 1, 128, device="cuda", dtype=torch.bfloat16)
    seen = set()
    for length in (6000, 6001, 6064, 6065, 100, 6100):
        k, v = cache[0, :, :length].transpose(1, 2), cache[1, :, :length].transpose(1, 2)
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        torch.cuda.synchronize()
        assert_flash_rule(out, q, k, v)
        seen.add(kernel.splits(q, k))
    assert len(seen) >= 2


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """An export whose per-call split configurations win every decode shape (a hand-made run)."""
    from run_fixtures import load_module, make_run  # noqa: E402 - tests/ is on the path above

    root = tmp_path_factory.mktemp("decode-splits")
    packed, plain = CONFIGS["n64-g4-st1-pk"], CONFIGS["n64-g1-st2"]
    times = {f"B{b} H{h}{f'/{kv}' if kv != h else ''} S1/{s} D{d}": {packed: 20.0 if kv != h else 30.0,
                                                                     plain: 25.0}
             for b, h, kv, s, d in ISSUE_SHAPES}
    run = make_run(root / "run", times, sdpa={label: 25.0 for label in times}, name="h100-decode",
                   space=yaml.safe_load(builtin_spaces()["h100-decode"].read_text()))
    export_runs([run], root / "out")
    return load_module(root / "out")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_exported_op_chooses_the_harness_split_count(exported, dtype: str) -> None:
    """The module's call, and its custom op, on each shape: flash-attn's bound, and the split count
    its plan chose is the search harness's for the same configuration and shape."""
    module = exported
    harnesses: dict[tuple, object] = {}
    for shape in ISSUE_SHAPES + ODD_SHAPES:
        batch, heads, heads_kv, seq_kv, head_dim = shape
        q, k, v = _inputs(*shape, dtype, seed=seq_kv + 1)
        gqa = heads_kv != heads
        assert_flash_rule(module.attention(q, k, v, enable_gqa=gqa), q, k, v)
        assert_flash_rule(module.attention_op(q, k, v, False, None, gqa), q, k, v)
        plan = module.explain(q, k, v, enable_gqa=gqa)
        key = (plan["config"], head_dim)
        if key not in harnesses:
            harnesses[key] = _kernel(Config(module.CONFIGS[plan["config"]]["config"]), Variant(head_dim, False, dtype))
        harness = harnesses[key]
        assert plan["kv_splits"] == harness.splits(q, k), shape
        assert len(plan["launches"]) == (2 if plan["kv_splits"] > 1 else 1)
        assert plan["launches"][0]["grid"][2] == plan["kv_splits"]
        spec = module.KERNELS[(dtype, head_dim, False, plan["config"])]
        assert plan["workspace_bytes"] == (4 * batch * heads * plan["kv_splits"] * spec["workspace_floats_per_split"]
                                           if plan["kv_splits"] > 1 else 0)


def test_a_captured_decode_step_replays_with_new_inputs(exported) -> None:
    """A CUDA graph of decode calls on three shapes (three split counts) replays correctly on inputs
    copied into its static tensors."""
    module = exported
    shapes = [(2, 28, 4, 6000, 128), (64, 32, 8, 2048, 128), (1, 32, 32, 32768, 128)]
    static = [_inputs(*shape, "fp16", seed=i) for i, shape in enumerate(shapes)]
    for q, k, v in static:   # warm up: plans and kernels built outside the capture
        module.attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [module.attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1]) for q, k, v in static]
    assert len({module.explain(q, k, v, enable_gqa=k.shape[1] != q.shape[1])["kv_splits"] for q, k, v in static}) >= 2
    for seed in (10, 11):
        for (q, k, v), shape in zip(static, shapes):
            fresh = _inputs(*shape, "fp16", seed=seed)
            for dst, src in zip((q, k, v), fresh):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for out, (q, k, v) in zip(outs, static):
            assert_flash_rule(out, q, k, v)
