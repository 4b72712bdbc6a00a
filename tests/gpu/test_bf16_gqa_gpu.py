"""bf16 and grouped-query attention (K/V heads shared by groups of query heads) against fp32
SDPA on the GPU, for the scalar, wmma and mma paths, through the gate the search uses.

Odd shapes (S = 1, 5, 77, 257), 8 query heads over 2 K/V heads and 4 over 1, head dims 64
and 128, causal and not, S_q != S_k, strided inputs, the launcher's checks, SDPA's own bf16
and GQA error against the gate's tolerance, and one evaluation through the worker.
"""
from __future__ import annotations

import pytest

from evoengineer.kernels import compile_source, render
from evoengineer.space import DEFAULT_TOLERANCES, Case, Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency, but keep collection safe
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def mma(BM: int, BN: int, warps: int | None = None, stages: int = 2, layout: str = "swizzle",
        q_regs: int = 1, p_regs: int = 1, splits: int = 1, groups: int = 1) -> Config:
    return Config(PATH="mma", BLOCK_M=BM, BLOCK_N=BN, WARPS=warps or groups * BM // 16, VEC=8, STAGES=stages,
                  SMEM_LAYOUT=layout, Q_IN_REGS=q_regs, P_IN_REGS=p_regs, SPLITS=splits, KV_GROUPS=groups)


CONFIGS = {
    "scalar-m32n32w4": Config(PATH="scalar", BLOCK_M=32, BLOCK_N=32, WARPS=4, VEC=8),
    "scalar-m16n16w1v1": Config(PATH="scalar", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1),
    "scalar-m128n64w8v4": Config(PATH="scalar", BLOCK_M=128, BLOCK_N=64, WARPS=8, VEC=4),
    "wmma-m64n64w4": Config(PATH="wmma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8),
    "wmma-m16n16w1v1": Config(PATH="wmma", BLOCK_M=16, BLOCK_N=16, WARPS=1, VEC=1),
    "wmma-m64n32w2v4": Config(PATH="wmma", BLOCK_M=64, BLOCK_N=32, WARPS=2, VEC=4),
    "mma-m64n64": mma(64, 64),
    "mma-m128n64-w4-q0": mma(128, 64, warps=4, q_regs=0),          # two 16-row strips per warp
    "mma-m64n128-st1": mma(64, 128, stages=1),
    "mma-m64n64-pad-q0-p0-st3": mma(64, 64, stages=3, layout="pad", q_regs=0, p_regs=0),
    "mma-m64n64-split2": mma(64, 64, splits=2),                       # combine launch
    "mma-m32n64-g4": mma(32, 64, stages=1, groups=4),                 # K/V groups in the CTA
}

SHAPES = [  # (B, H, H_kv, S): grouped 8/2 and 4/1, and plain, at the edge lengths
    (1, 8, 2, 1),
    (1, 8, 2, 5),
    (2, 8, 2, 77),
    (1, 4, 1, 257),
    (1, 4, 1, 77),
    (2, 3, 3, 77),
    (1, 2, 2, 513),
]


def _kernel(config: Config, variant: Variant):
    from evoengineer.gpu import AttentionKernel

    rendered = render("flash_attention", config, variant)
    compiled = compile_source(rendered.source, "sm_%d%d" % torch.cuda.get_device_capability())
    assert compiled.ok, compiled.error
    return AttentionKernel(rendered, compiled.cubin_path)


def _reference(q, k, v, causal: bool):
    from evoengineer.gpu.evaluate import reference

    return reference(q, k, v, causal, None)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_path_matches_sdpa(name: str, dtype: str, causal: bool, head_dim: int) -> None:
    from evoengineer.gpu.evaluate import gate_launcher

    kernel = _kernel(CONFIGS[name], Variant(head_dim, causal, dtype))
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    for batch, heads, heads_kv, seq in SHAPES:
        case = Case(batch, heads, seq, head_dim, causal, heads_kv=heads_kv, dtype=dtype)
        result = gate_launcher(kernel, case, None, atol, rtol, seed=seq + heads, trials=1)
        assert result.status == "ok", result.reason


def test_reference_repeats_kv_heads_like_sdpa_enable_gqa() -> None:
    import torch.nn.functional as F

    q = torch.randn(2, 8, 33, 64, device="cuda")
    k, v = (torch.randn(2, 2, 40, 64, device="cuda") for _ in range(2))
    for causal in (False, True):
        ours = _reference(q, k, v, causal)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)
        # query head 5 reads K/V head 5 // 4 = 1
        one = F.scaled_dot_product_attention(q[:, 5:6], k[:, 1:2], v[:, 1:2], is_causal=causal)
        torch.testing.assert_close(ours[:, 5:6], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["scalar-m32n32w4", "wmma-m64n64w4", "mma-m64n64", "mma-m64n64-split2", "mma-m32n64-g4"])
def test_query_and_key_lengths_may_differ(name: str, dtype: str) -> None:
    from evoengineer.gpu.launch import torch_dtype

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    for causal in (False, True):
        kernel = _kernel(CONFIGS[name], Variant(64, causal, dtype))
        for seq_q, seq_k in ((100, 37), (37, 100), (1, 300)):
            q = torch.randn(2, 8, seq_q, 64, device="cuda", dtype=torch_dtype(dtype))
            k, v = (torch.randn(2, 2, seq_k, 64, device="cuda", dtype=torch_dtype(dtype)) for _ in range(2))
            out = torch.full_like(q, float("nan"))
            kernel(q, k, v, out)
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), _reference(q, k, v, causal), atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", ["scalar-m32n32w4", "wmma-m64n64w4", "mma-m64n64", "mma-m128n64-w4-q0"])
def test_strided_gqa_inputs(name: str) -> None:
    """(B, S, H, D) storage for q and (B, S, H_kv, D) for k and v, as a model's projections give."""
    atol, rtol = DEFAULT_TOLERANCES["bf16"]
    for causal in (False, True):
        kernel = _kernel(CONFIGS[name], Variant(128, causal, "bf16"))
        q = torch.randn(2, 130, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(2, 130, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        out = torch.full((2, 8, 130, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel(q, k, v, out)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _reference(q, k, v, causal), atol=atol, rtol=rtol)


def test_launcher_checks_dtype_and_heads() -> None:
    from evoengineer.gpu import LaunchError

    kernel = _kernel(CONFIGS["mma-m64n64"], Variant(64, False, "bf16"))
    q = torch.randn(1, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kernel(q, k, k, out)   # 8 over 2 heads: accepted
    with pytest.raises(LaunchError, match="expected bfloat16"):
        kernel(q.half(), k.half(), k.half(), out.half())
    k3 = torch.randn(1, 3, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="divides"):
        kernel(q, k3, k3, out)
    with pytest.raises(LaunchError, match="divides"):
        kernel(q, k, k[:, :1].contiguous(), out)
    fp16 = _kernel(CONFIGS["mma-m64n64"], Variant(64, False))
    with pytest.raises(LaunchError, match="expected float16"):
        fp16(q, k, k, out)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_bf16_error_is_well_inside_the_bf16_tolerance(causal: bool) -> None:
    """The bf16 tolerance is validated against bf16 SDPA: each backend that runs passes the gate's
    check at the bf16 default; flash (which, like the kernels, rounds P to bf16) at a third of it."""
    from evoengineer.gpu.evaluate import SDPA_BACKENDS, _random_inputs, check_output, sdpa_op

    atol, rtol = DEFAULT_TOLERANCES["bf16"]
    ran = set()
    figures = []
    for batch, heads, heads_kv, seq in [*SHAPES, (2, 32, 8, 2048)]:
        case = Case(batch, heads, seq, 128, causal, heads_kv=heads_kv, dtype="bf16")
        q, k, v = _random_inputs(case, seed=seq)
        ref = _reference(q, k, v, causal)
        for backend in SDPA_BACKENDS:
            try:
                out = sdpa_op(backend, q, k, v, causal, None)()
                torch.cuda.synchronize()
            except RuntimeError:
                torch.cuda.synchronize()
                continue   # this backend does not take bf16 or grouped K/V here
            ran.add(backend)
            margin = 3 if backend == "flash" else 1
            reason, max_abs, _ = check_output(out, ref, atol / margin, rtol / margin)
            figures.append(f"{case.label()} {backend}: max abs err {max_abs:.4f}")
            assert not reason, f"{backend} {case.label()}: {reason}"
    print("\n".join(figures))
    assert {"flash", "math"} <= ran, ran


def test_evaluator_gates_and_times_bf16_gqa(tmp_path) -> None:
    """One mma and one scalar configuration through the worker on a space of fp16 and bf16 with a
    grouped shape: ok, every case labelled with its K/V heads and dtype, SDPA timed with GQA."""
    from evoengineer.gpu import Evaluator, fastest_sdpa
    from evoengineer.space import load_space

    (tmp_path / "space.yaml").write_text("""
name: gqa
target: {name: any, arch: sm_90, sms: 132, smem_per_block: 232448}
problem:
  dtype: [fp16, bf16]
  shapes:
    - {B: 2, H: 8, H_KV: 2, S: 300, D: 64, causal: [false, true]}
template: flash_attention
params:
  PATH: [scalar, mma]
  BLOCK_M: [64]
  BLOCK_N: [64]
  WARPS: [4]
  VEC: [8]
timing: {warmup: 3, repetitions: 20, flush_l2: true, timeout_s: 30}
""")
    space = load_space(tmp_path / "space.yaml")
    with Evaluator(space, arch="sm_%d%d" % torch.cuda.get_device_capability()) as evaluator:
        for path in ("mma", "scalar"):
            result = evaluator.evaluate(Config(PATH=path, BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8))
            assert result.status == "ok", result.reason
            labels = {c["label"] for c in result.cases}
            assert {"B2 H8/2 S300 D64", "B2 H8/2 S300 D64 causal bf16", "B2 H8/2 S77 D64 bf16", "B1 H4/1 S1 D64 causal"} <= labels
            assert all(c["time"]["median_us"] > 0 for c in result.cases[:4])
        baseline = evaluator.baseline()
    assert set(baseline) == {c.label() for c in space.cases}
    assert set(fastest_sdpa(baseline)) == set(baseline), baseline


def test_exported_module_runs_bf16_and_gqa(tmp_path) -> None:
    """A run over fp16 and bf16 (answered from a recording), exported: the module's kernels take
    grouped K/V in either dtype."""
    import json
    import subprocess
    import sys

    import yaml

    space = {
        "name": "tiny-mixed",
        "target": {"name": "any", "arch": "sm_90", "sms": 132, "smem_per_block": 232448},
        "problem": {"dtype": ["fp16", "bf16"], "shapes": [{"B": 1, "H": 8, "H_KV": 2, "S": 256, "D": 64, "causal": [False, True]}]},
        "template": "flash_attention",
        "params": {"PATH": ["mma"], "BLOCK_M": [64], "BLOCK_N": [64], "WARPS": [4], "VEC": [8], "SPLITS": [2]},
        "search": {"strategy": "grid", "budget": 1, "top_k": 1},
    }
    config = Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, SPLITS=2)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(space, sort_keys=False))
    (tmp_path / "rec.jsonl").write_text(json.dumps({"header": {"space_inline": space}}) + "\n" + json.dumps(
        {"config": config.to_dict(), "key": config.key(), "status": "ok", "reason": "", "objective_us": 10.0}) + "\n")
    run, out = tmp_path / "run", tmp_path / "best"
    for args in (("search", "--space", "tiny.yaml", "--replay", "rec.jsonl", "--run-dir", str(run), "--quiet"),
                 ("export", str(run), "--rank", "1", "--out", str(out))):
        done = subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr + done.stdout
    import importlib.util

    # a name of its own: another test imports another export as evo_attention in this process
    package = out / "evo_attention"   # the exported runtime package, beside kernel.json
    spec = importlib.util.spec_from_file_location("evo_attention_bf16_gqa", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its relative imports find it here
    spec.loader.exec_module(module)
    attention = module.attention
    for dtype in (torch.float16, torch.bfloat16):
        atol, rtol = DEFAULT_TOLERANCES["bf16" if dtype == torch.bfloat16 else "fp16"]
        for causal in (False, True):
            q = torch.randn(2, 8, 333, 64, device="cuda", dtype=dtype)
            k, v = (torch.randn(2, 2, 333, 64, device="cuda", dtype=dtype) for _ in range(2))
            got = attention(q, k, v, is_causal=causal, enable_gqa=True)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), _reference(q, k, v, causal), atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        attention(q, k, v)
    with pytest.raises(ValueError, match=r"must be a multiple of k and v's heads \(3\)"):
        attention(q, k[:, :1].expand(2, 3, 333, 64).contiguous(), v[:, :1].expand(2, 3, 333, 64).contiguous(),
                  enable_gqa=True)
