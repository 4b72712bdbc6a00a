"""Packed variable-length sequences on the wgmma path (VARLEN), on the GPU: exports of wgmma
configurations (TMA from a producer thread, one CTA a work tile; persistent CTAs storing O by TMA
elsewhere, here from registers; persistent CTAs taking work tiles from a counter with Q in
registers; cp.async from a producer warpgroup, and from every thread) run ``attention_varlen``
against fp32 SDPA per sequence under flash-attn's rule (test_attention_varlen_gpu.check_rule):
sequences of 1, 17, 0, 1000 and 4099 queries in one batch, keys as many or other counts
(bottom-right alignment, queries that see no key), fp16 and bf16, head dims 64 and 128, GQA,
causal and not, windows and soft-capping; and the same kernels serve dense calls with features
(null offsets)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_attention_varlen_gpu import KEYS, LENGTHS_Q, check_rule, export_each, packed  # noqa: E402

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

_PP = {"PATH": "wgmma", "CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PRODUCER": 1,
       "INTRA_WG_OVERLAP": 1, "PINGPONG": 1}
EXPORTS = {
    "tma": Config({**_PP, "REG_PRODUCER": 24, "REG_CONSUMER": 240, "LOAD": "tma"}),
    "ptmao": Config({**_PP, "REG_PRODUCER": 24, "REG_CONSUMER": 240, "LOAD": "tma", "PERSISTENT": 1, "O_TMA": 1}),
    "dtmao-q": Config({**_PP, "REG_PRODUCER": 32, "REG_CONSUMER": 232, "LOAD": "tma", "PERSISTENT": 2, "O_TMA": 1,
                       "Q_IN_REGS": 1, "SOFTMAX_PIN": 3}),
    "cpasync-producer": Config({**_PP, "PINGPONG": 0, "REG_PRODUCER": 24, "REG_CONSUMER": 240}),
    "cpasync": Config({"PATH": "wgmma", "CONSUMER_WGS": 1, "BLOCK_M": 64, "BLOCK_N": 64, "STAGES": 2}),
}
"""Each export's only configuration (h100.yaml's seeds), so its varlen kernels are this one's."""


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return export_each(tmp_path_factory, EXPORTS, "wgvarlen")


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("export", list(EXPORTS))
def test_packed_sequences_on_wgmma_kernels_match_sdpa_per_sequence(modules, export: str, dtype: str, head_dim: int,
                                                                   causal: bool, keys: str) -> None:
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
    assert plan.varlen and plan.kernel.config == EXPORTS[export].key() and plan.kernel.switches == tuple(F.SWITCHES)
    if EXPORTS[export].get("LOAD") == "tma":
        assert [m.arg for m in plan.kernel.tensor_maps] == ["tm_q", "tm_k", "tm_v"]


@pytest.mark.parametrize("causal, window, softcap", [(True, (64, 0), 0.0), (False, (32, 16), 0.0), (False, (-1, -1), 5.0),
                                                     (True, (100, -1), 3.0), (False, (300, 200), 2.0)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("export", list(EXPORTS))
def test_windows_and_soft_caps_compose_with_packed_sequences_on_wgmma(modules, export: str, dtype: str, causal: bool,
                                                                      window, softcap: float) -> None:
    module = modules[export]
    torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    lengths_q, lengths_k = [1, 300, 0, 77, 5, 1000], [40, 300, 8, 500, 0, 1000]   # queries without keys give 0
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 1, 128, torch_dtype, seed=3, spread=2.0 if softcap else 1.0)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, 1000, 1000, is_causal=causal, window_size=window, softcap=softcap,
                                  scale=0.1)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, cu_q, cu_k, causal, V.varlen_features(window, softcap), scale=0.1)


@pytest.mark.parametrize("export", list(EXPORTS))
def test_the_every_feature_wgmma_kernel_serves_dense_calls_with_null_offsets(modules, export: str) -> None:
    """The kernel with VARLEN also serves ``attention`` calls with a window or a soft cap (null
    offsets: the dense layout, top-left), and a GQA batch of equal lengths agrees with the dense
    kernels through attention_varlen."""
    module = modules[export]
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(2, h, 777, 64, generator=gen, device="cuda").half() for h in (8, 2, 2))
    for causal, window, softcap in ((True, (100, 0), 0.0), (False, (50, 60), 4.0)):
        features = F.call_features(window, softcap)
        plan = module._export.launcher.feature_plan(q, k, v, causal, None, True, features, None)
        assert plan.kernel.config == EXPORTS[export].key()
        out = module.attention(q, k, v, is_causal=causal, enable_gqa=True, window_size=window, softcap=softcap)
        ref = F.reference_attention(q.float(), k.float(), v.float(), causal, None, True, features)
        torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)
    batch, length = 3, 333
    q, k, v, cu_q, cu_k = packed([length] * batch, [length] * batch, 8, 2, 64, torch.float16, seed=5)
    out = module.attention_varlen(q, k, v, cu_q, cu_k, length, length, is_causal=True)
    dense = module.attention(*(t.view(batch, length, t.shape[1], 64).transpose(1, 2) for t in (q, k, v)), is_causal=True,
                             enable_gqa=True)
    torch.testing.assert_close(out.view(batch, length, 8, 64), dense.transpose(1, 2), atol=2e-3, rtol=2e-3)


def test_a_batch_of_many_short_and_one_long_sequence_on_persistent_ctas(modules) -> None:
    """Most work tiles of a persistent grid lie past their sequence's queries: PERSISTENT=1's
    producer and consumers skip them alike (the K/V ring and barrier phases carry on over them);
    PERSISTENT=2's counter hands out only the sequences' own query blocks (empty sequences, and
    lengths at and around a multiple of the block, included)."""
    lengths = [3, 0, 5000, 1, 64, 65, 127, 128, 129, 0, 2, 4096]
    for export in ("ptmao", "dtmao-q"):
        module = modules[export]
        for causal in (False, True):
            q, k, v, cu_q, cu_k = packed(lengths, lengths[::-1], 16, 4, 128, torch.bfloat16, seed=13)
            out = module.attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), is_causal=causal)
            torch.cuda.synchronize()
            check_rule(out, q, k, v, cu_q, cu_k, causal, V.varlen_features())
