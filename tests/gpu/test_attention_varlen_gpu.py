"""Packed variable-length sequences on the GPU: exported modules' ``attention_varlen`` against fp32
SDPA per sequence, under flash-attn's rule (``gpu.backward.rule_check``: max|out - ref_fp32| <=
2 * max|ref_lowp - ref_fp32| + eps, ref_lowp the same computation in the inputs' dtype). Sequences
of 1, 17, 0, 1000 and 4099 queries in one batch (keys as many, or other counts: bottom-right
alignment, queries that see no key), fp16 and bf16, head dims 64 and 128, GQA, causal and not,
windows and soft-capping, on three exports whose varlen kernels differ (the fixtures' mma
fallback; K/V split over CTAs with packed GQA rows and a combine launch; K/V split over warp
groups); then torch.compile, CUDA-graph capture and the errors and fallback on CUDA tensors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run_fixtures import MMA, SMALL, SMALL_C, SPLIT, load_module, make_run, space_doc  # noqa: E402

from evoengineer.runtime import features as F  # noqa: E402
from evoengineer.runtime import varlen as V  # noqa: E402
from evoengineer.space import Config  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GROUPS = Config({"PATH": "mma", "BLOCK_M": 32, "BLOCK_N": 64, "WARPS": 8, "VEC": 8, "STAGES": 1, "KV_GROUPS": 4})
EXPORTS = {"mma": MMA, "split-pack": SPLIT, "kv-groups": GROUPS}
"""Each export's only configuration, so its varlen kernels are this configuration's."""

LENGTHS_Q = [1, 17, 0, 1000, 4099]   # the empty sequence sits between others: it must write nothing
KEYS = {
    "equal": [1, 17, 0, 1000, 4099],
    "other": [9, 17, 5, 700, 4150],     # more keys (bottom-right), keys without queries, fewer keys than queries
}


def export_each(tmp_path_factory: pytest.TempPathFactory, exports: dict[str, Config], prefix: str) -> dict:
    """An export over fp16 and bf16, head dims 64 and 128, per configuration of ``exports``."""
    from evoengineer.results import export_runs

    out = {}
    for name, config in exports.items():
        root = tmp_path_factory.mktemp(f"{prefix}_{name}")
        doc = space_doc()
        doc["problem"]["dtype"] = ["fp16", "bf16"]
        run = make_run(root / "run", {SMALL: {config: 10.0}, SMALL_C: {config: 10.0}}, space=doc,
                       sdpa={SMALL: 18.0, SMALL_C: 16.0})
        export_runs([run], root / "out")
        out[name] = load_module(root / "out")
    return out


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return export_each(tmp_path_factory, EXPORTS, "varlen")


def packed(lengths_q, lengths_k, heads: int, heads_kv: int, head_dim: int, dtype, seed: int, spread: float = 1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(sum(lengths_q), heads, head_dim, generator=gen, device="cuda") * spread).to(dtype)
    k = (torch.randn(sum(lengths_k), heads_kv, head_dim, generator=gen, device="cuda") * spread).to(dtype)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, generator=gen, device="cuda").to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu_q, cu_k


def lowp_reference(q, k, v, lengths_q, lengths_k, causal: bool, features: F.CallFeatures, scale=None):
    """Each sequence in the inputs' dtype (flash-attn's ``attention_ref(upcast=False)``), the
    causal mask and window bottom-right; rows that see no key 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, q0, k0 = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k):
        if lq and not lk:
            out.append(q.new_zeros(lq, *q.shape[1:]))
        elif lq:
            qs = q[q0:q0 + lq].transpose(0, 1)
            ks, vs = (F.repeat_kv(t[k0:k0 + lk].transpose(0, 1)[None], q.shape[1])[0] for t in (k, v))
            scores = (qs * scale) @ ks.transpose(-1, -2)
            if features.softcap > 0:
                scores = torch.tanh(scores / features.softcap) * features.softcap
            allowed = F.allowed_keys(1, lq, lk, causal, features, device=q.device, offset=lk - lq)[0]
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
            out.append((probs @ vs).masked_fill(~allowed.any(-1, keepdim=True), 0).transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(out)


def check_rule(out, q, k, v, cu_q, cu_k, causal: bool, features: F.CallFeatures, scale=None) -> None:
    from evoengineer.gpu.backward import rule_check

    lengths_q = (cu_q[1:] - cu_q[:-1]).tolist()
    lengths_k = (cu_k[1:] - cu_k[:-1]).tolist()
    ref = V.reference_varlen(q.float(), k.float(), v.float(), cu_q.tolist(), cu_k.tolist(), causal, scale, features)
    low = lowp_reference(q, k, v, lengths_q, lengths_k, causal, features, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    check = rule_check("out", out, ref, low)
    assert check.ok, str(check)


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("export", list(EXPORTS))
def test_packed_sequences_match_sdpa_per_sequence(modules, export: str, dtype: str, head_dim: int, causal: bool,
                                                  keys: str) -> None:
    module = modules[export]
    torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    lengths_k = KEYS[keys]
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, lengths_k, 8, 2, head_dim, torch_dtype, seed=head_dim + causal)
    module.fallback_counts(reset=True)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(lengths_k), is_causal=causal)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, cu_q, cu_k, causal, V.varlen_features())
    assert module.fallback_counts() == {}
    plan = module._export.varlen.plan(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(lengths_k), causal, None,
                                      V.varlen_features(), None)
    assert plan.varlen and plan.kernel.config == EXPORTS[export].key() and "varlen" in plan.kernel.switches


@pytest.mark.parametrize("causal, window, softcap", [(True, (64, 0), 0.0), (False, (32, 16), 0.0), (False, (-1, -1), 5.0),
                                                     (True, (100, -1), 3.0)])
@pytest.mark.parametrize("export", ["mma", "split-pack"])
def test_windows_and_soft_caps_compose_with_packed_sequences(modules, export: str, causal: bool, window, softcap: float
                                                             ) -> None:
    module = modules[export]
    lengths_q, lengths_k = [1, 300, 0, 77, 5], [40, 300, 8, 500, 0]   # the last: queries without keys give 0
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 1, 128, torch.float16, seed=3, spread=2.0 if softcap else 1.0)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, 300, 500, is_causal=causal, window_size=window, softcap=softcap,
                                  scale=0.1)
    check_rule(out, q, k, v, cu_q, cu_k, causal, V.varlen_features(window, softcap), scale=0.1)


def test_equal_lengths_agree_with_the_dense_kernels(modules) -> None:
    """Where every sequence has L queries and L keys the two alignments agree: a varlen call is a
    dense call over (batch, heads, L, head_dim) views."""
    module = modules["mma"]
    batch, length = 3, 333
    q, k, v, cu_q, cu_k = packed([length] * batch, [length] * batch, 8, 8, 64, torch.float16, seed=5)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, length, length, is_causal=True)
    dense = module.attention(*(t.view(batch, length, 8, 64).transpose(1, 2) for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out.view(batch, length, 8, 64), dense.transpose(1, 2), atol=2e-3, rtol=2e-3)


def test_torch_compile_fullgraph_runs_a_varlen_call(modules) -> None:
    module = modules["mma"]
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, KEYS["other"], 8, 2, 64, torch.float16, seed=6)

    def block(q, k, v, cu_q, cu_k):
        return module.attention_varlen(q * 1.5, k, v, cu_q, cu_k, 4099, 4150, is_causal=True).relu()

    compiled = torch.compile(block, fullgraph=True)
    out = compiled(q, k, v, cu_q, cu_k)
    ref = V.reference_varlen(q.float() * 1.5, k.float(), v.float(), cu_q.tolist(), cu_k.tolist(), True).relu()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_varlen_op_passes_opcheck(modules) -> None:
    module = modules["mma"]
    q, k, v, cu_q, cu_k = packed([3, 0, 70], [5, 2, 70], 4, 2, 64, torch.float16, seed=11)
    for kwargs in ({}, {"is_causal": True, "scale": 0.2}, {"window_left": 8, "window_right": 0, "softcap": 4.0}):
        torch.library.opcheck(module.attention_varlen_op, (q, k, v, cu_q, cu_k, 70, 70), kwargs)


def test_a_cuda_graph_captures_a_varlen_call_and_replays_it_with_new_inputs(modules) -> None:
    module = modules["split-pack"]
    lengths_q, lengths_k = [1, 17, 0, 1000], [1, 40, 3, 1000]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16, seed=7)
    module.attention_varlen(q, k, v, cu_q, cu_k, 1000, 1000, is_causal=True)   # compiles, plans: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.attention_varlen(q, k, v, cu_q, cu_k, 1000, 1000, is_causal=True)
    fresh = packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16, seed=8)
    for mine, new in zip((q, k, v), fresh):
        mine.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    check_rule(out, q, k, v, cu_q, cu_k, True, V.varlen_features())


def test_offsets_on_the_gpu_are_checked_and_uncovered_calls_run_the_fallback(modules) -> None:
    module = modules["mma"]
    q, k, v, cu_q, cu_k = packed([5, 9], [5, 9], 4, 4, 64, torch.float16, seed=9)
    bad = torch.tensor([0, 9, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"^attention_varlen: cu_seqlens_q must start at 0 and not decrease, got \[0, 9, 5\]"):
        module.attention_varlen(q, k, v, bad, cu_k, 9, 9)
    with pytest.raises(ValueError, match="sequence 1 has 9 queries, more than max_seqlen_q = 8"):
        module.attention_varlen(q, k, v, cu_q, cu_k, 8, 9)
    module.attention_varlen(q, k, v, cu_q, cu_k, 9, 9)
    cu_q[1] = 15  # after a call with this pair: written in place through torch, so read again
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0 and not decrease, got \[0, 15, 14\]"):
        module.attention_varlen(q, k, v, cu_q, cu_k, 9, 9)
    with pytest.raises(ValueError, match="cu_seqlens_k must be on q's device"):
        module.attention_varlen(q, k, v, cu_q, cu_k.cpu(), 9, 9)
    odd = packed([5, 9], [6, 9], 4, 4, 96, torch.float16, seed=10)
    with pytest.raises(ValueError, match="^attention_varlen: no exported kernel for fp16 head_dim 96"):
        module.attention_varlen(*odd, 9, 9, is_causal=True)
    module.fallback_counts(reset=True)
    out = module.attention_varlen(*odd, 9, 9, is_causal=True, fallback="sdpa")
    check_rule(out, *odd, True, V.varlen_features())
    assert list(module.fallback_counts()) == ["no exported kernel for fp16 head_dim 96 causal; this module covers "
                                              + module._export.coverage.covered()]
