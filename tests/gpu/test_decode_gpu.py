"""Decode on the GPU: the h100-decode space's split-K/V configurations (one 16-row strip per
warp, SPLITS CTAs per head and a combine launch) against fp32 SDPA on q_len 1 over K/V lengths
1, 77 and 4096 (and a few queries over a longer cache), grouped-query and not, full and causal,
fp16 and bf16, through the gate the search uses (also with the query heads of a K/V head
packed as the rows of one CTA, PACK_GQA, on decode and on prefill tiles); then a short search of the decode space,
exported with a prefill run, whose module serves decode calls with the decode configurations.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.kernels import compile_source, render
from evoengineer.space import DEFAULT_TOLERANCES, Case, Config, Variant, load_space

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency, but keep collection safe
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPACE = load_space("h100-decode")


def decode(block_n: int, groups: int, stages: int, splits: int, pack: int = 0) -> Config:
    return Config(PATH="mma", BLOCK_M=16, BLOCK_N=block_n, WARPS=groups, VEC=8, STAGES=stages, SMEM_LAYOUT="swizzle",
                  Q_IN_REGS=1, P_IN_REGS=1, SPLITS=splits, KV_GROUPS=groups, PACK_GQA=pack)


CONFIGS = {f"seed{i}-" + seed.short_label().replace(" ", "-"): seed for i, seed in enumerate(SPACE.search.seeds)}
CONFIGS.update({
    "n32-g1-st3-s32": decode(32, 1, 3, 32),     # the most splits: one or two tiles each at 4096 keys
    "n64-g2-st3-s16": decode(64, 2, 3, 16),
    "n32-g8-st1-s2": decode(32, 8, 1, 2),
    "n128-g2-st1-s16": decode(128, 2, 1, 16),
    "n32-g1-st3-s32-pk": decode(32, 1, 3, 32, pack=1),
    "n32-g8-st1-s2-pk": decode(32, 8, 1, 2, pack=1),
    "n128-g2-st1-s16-pk": decode(128, 2, 1, 16, pack=1),
})

LENGTHS = [(1, 1), (1, 77), (1, 4096), (5, 300), (17, 1000)]
"""(query length, K/V length): decode over one key, a cache not a multiple of any tile, a long
cache (4096: more tiles than SPLITS x KV_GROUPS warps), a few queries, more queries than BLOCK_M."""
HEADS = [(1, 8, 8), (3, 8, 2)]
"""(batch, query heads, K/V heads): plain and grouped-query (4 query heads per K/V head)."""


def _kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel

    rendered = render("flash_attention", config, variant)
    compiled = compile_source(rendered.source, "sm_%d%d" % torch.cuda.get_device_capability())
    assert compiled.ok, compiled.error
    return AttentionKernel(rendered, compiled.cubin_path)


def test_the_extra_configurations_are_in_the_space() -> None:
    assert all(SPACE.contains(config) for config in CONFIGS.values()), [n for n, c in CONFIGS.items() if not SPACE.contains(c)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_configuration_matches_sdpa(name: str, dtype: str, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu.evaluate import gate_launcher

    config = CONFIGS[name]
    assert config["SPLITS"] > 1 or name.startswith("seed")
    kernel = _kernel(config, Variant(head_dim, causal, dtype))
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    for batch, heads, heads_kv in HEADS:
        for seq, seq_kv in LENGTHS:
            case = Case(batch, heads, seq, head_dim, causal, heads_kv=heads_kv, dtype=dtype, seq_kv=seq_kv)
            result = gate_launcher(kernel, case, None, atol, rtol, seed=seq_kv + heads_kv, trials=1)
            assert result.status == "ok", result.reason


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_at_the_space_shapes_with_a_model_layout(dtype: str) -> None:
    """B8 H32 (and H32 over 8 K/V heads) q_len 1 over 4096 keys, k and v views of a (B, S, H, D)
    cache as a model keeps it, with SPLITS 16: every split's partial row merged by the combine launch."""
    from evoengineer.gpu.evaluate import reference
    from evoengineer.gpu.launch import torch_dtype

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    for name, heads_kv in (("n64-g2-st3-s16", 32), ("n64-g2-st3-s16", 8), ("n128-g2-st1-s16-pk", 8)):
        kernel = _kernel(CONFIGS[name], Variant(128, False, dtype))
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch_dtype(dtype))
        cache = torch.randn(2, 8, 4096, heads_kv, 128, device="cuda", dtype=torch_dtype(dtype))
        k, v = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(q, k, v, False, None), atol=atol, rtol=rtol)


PACKED_PREFILL = {
    "m64-n64-w4-st2-pk": Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SMEM_LAYOUT="swizzle",
                                Q_IN_REGS=1, P_IN_REGS=1, PACK_GQA=1),
    "m128-n64-w4-st2-pk": Config(PATH="mma", BLOCK_M=128, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SMEM_LAYOUT="swizzle",
                                 Q_IN_REGS=0, P_IN_REGS=1, PACK_GQA=1),
    "m32-n64-w8-g4-pk": Config(PATH="mma", BLOCK_M=32, BLOCK_N=64, WARPS=8, VEC=8, STAGES=1, SMEM_LAYOUT="swizzle",
                               Q_IN_REGS=1, P_IN_REGS=1, KV_GROUPS=4, PACK_GQA=1),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(PACKED_PREFILL))
def test_packed_query_heads_on_prefill_tiles_match_sdpa(name: str, dtype: str, causal: bool) -> None:
    """Packed rows mix positions and heads in one tile: the causal limit is a row's position
    (r / group), the last tile is partial, and seq_q != seq_kv aligns top-left as SDPA does."""
    from evoengineer.gpu.evaluate import gate_launcher

    kernel = _kernel(PACKED_PREFILL[name], Variant(128, causal, dtype))
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    for batch, heads, heads_kv, seq, seq_kv in ((2, 8, 2, 77, 77), (1, 6, 1, 257, 257), (3, 4, 4, 33, 100),
                                                (2, 8, 2, 100, 33), (1, 32, 8, 1, 5)):
        case = Case(batch, heads, seq, 128, causal, heads_kv=heads_kv, dtype=dtype, seq_kv=seq_kv)
        result = gate_launcher(kernel, case, None, atol, rtol, seed=seq + heads_kv, trials=1)
        assert result.status == "ok", (case.label(), result.reason)


PREFILL = """
name: tiny-prefill
target: {name: any, arch: sm_90, sms: 132, smem_per_block: 232448}
problem:
  dtype: [fp16, bf16]
  shapes:
    - {B: 2, H: 8, S: 512, D: 128, causal: [false, true]}
template: flash_attention
params:
  PATH: [mma]
  BLOCK_M: [64]
  BLOCK_N: [64]
  WARPS: [4]
  VEC: [8]
timing: {warmup: 3, repetitions: 20, flush_l2: true, timeout_s: 30}
search: {strategy: grid, budget: 1, top_k: 1}
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=1200)


def test_decode_search_exported_with_a_prefill_run(tmp_path: Path) -> None:
    import importlib.util

    from evoengineer.gpu.evaluate import reference

    decode_run, prefill_run, out = tmp_path / "decode", tmp_path / "prefill", tmp_path / "best"
    done = cli("search", "--space", "h100-decode", "--trials", "3", "--top-k", "2", "--retime-rounds", "1",
               "--partition", "none", "--run-dir", str(decode_run), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads(line) for line in (decode_run / "results.jsonl").read_text().splitlines()]
    assert len(results) == 3 and all(r["status"] == "ok" for r in results), [(r["status"], r["reason"]) for r in results]
    labels = {c.label() for c in SPACE.cases}
    for r in results:   # seeds first: split-K/V configurations timed on every decode case
        assert r["config"]["BLOCK_M"] == 16
        assert labels <= {c["label"] for c in r["cases"] if c.get("time")}
    assert set(json.loads((decode_run / "baseline.json").read_text())) == labels
    assert any(r["config"]["SPLITS"] != 1 for r in results)   # a fixed split, or the call's (SPLITS 0)

    (tmp_path / "prefill.yaml").write_text(PREFILL)
    done = cli("search", "--space", "prefill.yaml", "--run-dir", str(prefill_run), "--retime-rounds", "1",
               "--partition", "none", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("export", str(prefill_run), str(decode_run), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    info = json.loads((out / "kernel.json").read_text())
    assert "S_q" in info["dispatch"]["rule"] and {m["case"] for m in info["decode"]["measured_cases"]} == labels

    package = out / "evo_attention"   # the exported runtime package, beside kernel.json
    spec = importlib.util.spec_from_file_location("evo_attention_decode", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its relative imports find it here
    spec.loader.exec_module(module)
    decode_keys = {r["key"] for r in results}
    for dtype in (torch.float16, torch.bfloat16):
        atol, rtol = DEFAULT_TOLERANCES["bf16" if dtype == torch.bfloat16 else "fp16"]
        for batch, heads, heads_kv, seq_kv, head_dim in ((8, 32, 32, 4096, 128), (8, 32, 8, 4096, 128), (2, 32, 32, 777, 64),
                                                         (1, 32, 8, 8192, 128)):
            q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, heads_kv, seq_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
            assert module.dispatch(dtype, head_dim, False, batch, heads, 1, seq_kv, heads_kv) in decode_keys
            got = module.attention(q, k, v, enable_gqa=heads_kv != heads)
            torch.testing.assert_close(got.float(), reference(q, k, v, False, None), atol=atol, rtol=rtol)
        q = torch.randn(2, 8, 512, 128, device="cuda", dtype=dtype)   # prefill: the prefill run's configuration
        k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=dtype) for _ in range(2))
        assert module.dispatch(dtype, 128, True, 2, 8, 512, 512) not in decode_keys
        torch.testing.assert_close(module.attention(q, k, v, is_causal=True).float(), reference(q, k, v, True, None),
                                   atol=atol, rtol=rtol)
