"""Sliding windows, soft-capping and per-batch key ranges on the wgmma path (sm_90a), against fp32
with the equivalent explicit mask under flash-attn's rule (test_attention_features_gpu.py's
helpers): every loader and schedule of the kernel (cp.async by every thread or a producer
warpgroup, TMA, overlap 1 and 2, ping-pong, persistent CTAs by stride or counter, SPLIT_TAIL,
Q in registers, the softmax pin, O by TMA) x the settings x odd shapes (S 77, 333, S_q != S_k,
GQA), fp16 and bf16; work tiles whose rows see no key; long sequences where most K/V tiles are
skipped; head dim 256."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_attention_features_gpu import ALL, SETTINGS, call_ranges, check_rule, inputs, kernel  # noqa: E402
from test_wgmma_features_cpu import CONFIGS as ALL_CONFIGS  # noqa: E402
from test_wgmma_features_cpu import D256  # noqa: E402

from evoengineer.runtime import features as F  # noqa: E402
from evoengineer.space import Variant  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90a GPU (H100, H200)"),
]

NAMES = ["c1-n64", "c1-n128-tma-ovl-st3", "c2-n192-pp", "c3-n64-st4", "ptma-ov2", "dtmao-q-pp", "stmao-pp",
         "htmao-c3-pin3"]
CONFIGS = {name: ALL_CONFIGS[name] for name in NAMES}

SHAPES = [  # (B, H, H_kv, S_q, S_k, D)
    (2, 4, 2, 77, 77, 64),
    (1, 6, 3, 333, 333, 128),
    (3, 4, 1, 130, 301, 64),
]


def run(config, shape, setting: str, dtype: str, seed: int):
    """The kernel of ``config`` with every switch on a call of ``setting``, checked by the rule."""
    causal, window, softcap, kind = SETTINGS[setting]
    torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    q, k, v = inputs(shape, torch_dtype, seed=seed, spread=2.0 if softcap else 1.0)
    seqlens, leftpad, seqlens_q = call_ranges(kind, shape, seed=shape[4])
    features = F.CallFeatures(window[0], window[1], softcap, bool(kind))
    out = torch.full_like(q, float("nan"))
    values = {"window_left": window[0], "window_right": window[1], "softcap": softcap, "seqlens_k": seqlens,
              "leftpad_k": leftpad, "seqlens_q": seqlens_q}
    kernel(config, Variant(shape[-1], causal, dtype, ALL))(q, k, v, out, features=values)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, causal, features, seqlens, leftpad, seqlens_q)
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}/{}S{}/{}D{}".format(*s))
@pytest.mark.parametrize("name", NAMES)
def test_a_wgmma_kernel_with_every_switch_matches_the_masked_reference(name: str, shape, setting: str) -> None:
    dtype = ("fp16", "bf16")[(NAMES.index(name) + SHAPES.index(shape)) % 2]   # each configuration sees both
    run(CONFIGS[name], shape, setting, dtype, seed=hash((name, shape, setting)) % 10_000)


@pytest.mark.parametrize("name", NAMES)
def test_rows_that_see_no_key_give_zero_and_their_work_tiles_finish(name: str) -> None:
    """S_q > S_k with a window: queries past S_k + 17 see no key (their CTAs visit no K/V tile)."""
    out = run(CONFIGS[name], (2, 4, 2, 400, 100, 64), "window-causal", "fp16", seed=3)
    assert (out[:, :, 117:] == 0).all()


LONG = {  # name -> (causal, window, softcap): Gemma-2's and Mistral's calls, most K/V tiles skipped
    "gemma-local": (True, (255, 0), 50.0),
    "mistral": (True, (1023, 0), 0.0),
    "both-sides": (False, (300, 200), 30.0),
}


@pytest.mark.parametrize("setting", list(LONG))
@pytest.mark.parametrize("name", ["ptma-ov2", "dtmao-q-pp", "stmao-pp", "htmao-c3-pin3"])
def test_long_sequences_with_a_window_skip_tiles_and_match(name: str, setting: str) -> None:
    causal, window, softcap = LONG[setting]
    shape = (2, 8, 4, 2048, 2048, 64 if name == "htmao-c3-pin3" else 128)
    q, k, v = inputs(shape, torch.bfloat16, seed=11, spread=2.0 if softcap else 1.0)
    features = F.CallFeatures(window[0], window[1], softcap, False)
    out = torch.full_like(q, float("nan"))
    values = {"window_left": window[0], "window_right": window[1], "softcap": softcap}
    kernel(CONFIGS[name], Variant(shape[-1], causal, "bf16", ALL))(q, k, v, out, features=values)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, causal, features)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_head_dim_256_with_every_switch(setting: str) -> None:
    run(D256, (2, 4, 2, 200, 333, 256), setting, "bf16", seed=5)


@pytest.mark.parametrize("feature, setting", [("window", "window-both"), ("softcap", "softcap"), ("seqlens", "ranges-causal"),
                                              ("seqlens", "queries-causal")])
@pytest.mark.parametrize("name", ["tma-pp", "stmao-pp"])
def test_a_wgmma_kernel_with_one_switch_matches_the_masked_reference(name: str, feature: str, setting: str) -> None:
    """One switch alone: SPLIT_TAIL stays on with the soft cap alone (5 query blocks x 28 heads =
    140 work tiles on 132 multiprocessors: a last round of 8, cut over every CTA)."""
    causal, window, softcap, kind = SETTINGS[setting]
    shape = (4, 7, 1, 600, 600, 128)
    q, k, v = inputs(shape, torch.float16, seed=7, spread=2.0 if softcap else 1.0)
    seqlens, leftpad, seqlens_q = call_ranges(kind, shape, seed=1)
    features = F.CallFeatures(window[0], window[1], softcap, bool(kind))
    out = torch.full_like(q, float("nan"))
    values = {"window_left": window[0], "window_right": window[1], "softcap": softcap, "seqlens_k": seqlens,
              "leftpad_k": leftpad, "seqlens_q": seqlens_q}
    kernel(ALL_CONFIGS[name], Variant(128, causal, "fp16", (feature,)))(q, k, v, out, features=values)
    torch.cuda.synchronize()
    check_rule(out, q, k, v, causal, features, seqlens, leftpad, seqlens_q)

