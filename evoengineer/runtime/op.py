"""The torch custom op ``<namespace>::attention`` with a fake implementation, and ``attention``:
the eager fast path for plain tensors, the op for everything else (torch.compile, tensor
subclasses, dispatch modes such as FakeTensorMode)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .checks import Coverage, check_inputs

SCHEMA = "(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor"

Forward = Callable[[Any, Any, Any, bool, "float | None", bool], Any]


def register_op(namespace: str, forward: Forward, coverage: Coverage) -> Any:
    """``torch.ops.<namespace>.attention.default``, registered on first use of the namespace (a
    second copy of the same export shares the op)."""
    def impl(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> Any:
        return forward(q, k, v, is_causal, scale, enable_gqa)

    def fake(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> Any:
        check_inputs(coverage, q, k, v, is_causal, scale, enable_gqa)
        return torch.empty_like(q)

    if not hasattr(getattr(torch.ops, namespace), "attention"):
        opdef = torch.library.custom_op(f"{namespace}::attention", impl, mutates_args=(), schema=SCHEMA)
        opdef.register_fake(fake)
    return getattr(torch.ops, namespace).attention.default


def make_attention(forward: Forward, op: Any) -> Callable[..., Any]:
    """``attention(q, k, v, is_causal=False, scale=None, enable_gqa=False)`` of one export."""
    compiling = torch.compiler.is_compiling
    tensor = torch.Tensor
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

    def attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> Any:
        """softmax(q k^T * scale) v as torch.nn.functional.scaled_dot_product_attention computes it
        (is_causal: top-left aligned; scale: default 1/sqrt(head_dim); enable_gqa: k, v may have
        fewer heads). q: (batch, heads, seq_q, head_dim), k and v: (batch, heads_kv, seq_k,
        head_dim), CUDA tensors of one dtype with a contiguous last dimension. Returns a new
        tensor shaped like q."""
        if compiling() or type(q) is not tensor or type(k) is not tensor or type(v) is not tensor or dispatch_modes():
            return op(q, k, v, is_causal, scale, enable_gqa)
        return forward(q, k, v, is_causal, scale, enable_gqa)

    return attention


# -- calls with features (window, soft cap, per-batch key ranges) or a fallback -------------------

FEATURES_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
                   "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? seqlens_k=None, "
                   "Tensor? leftpad_k=None, str? fallback=None) -> Tensor")

FeatureForward = Callable[..., Any]
"""``(q, k, v, is_causal, scale, enable_gqa, features.CallFeatures, seqlens_k, leftpad_k, fallback)``."""


def register_features_op(namespace: str, forward: FeatureForward, coverage: Coverage) -> Any:
    """``torch.ops.<namespace>.attention_features.default``: ``attention`` with a window, a soft
    cap, per-batch key ranges or a fallback, through the dispatcher."""
    from .features import Uncovered, call_features, check_fallback, check_ranges

    def impl(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             window_left: int = -1, window_right: int = -1, softcap: float = 0.0, seqlens_k: Any = None,
             leftpad_k: Any = None, fallback: str | None = None) -> Any:
        features = call_features((window_left, window_right), softcap, seqlens_k, leftpad_k)
        return forward(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, fallback)

    def fake(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             window_left: int = -1, window_right: int = -1, softcap: float = 0.0, seqlens_k: Any = None,
             leftpad_k: Any = None, fallback: str | None = None) -> Any:
        call_features((window_left, window_right), softcap, seqlens_k, leftpad_k)
        check_fallback(fallback)
        check_ranges(q, seqlens_k, leftpad_k)
        try:
            check_inputs(coverage, q, k, v, is_causal, scale, enable_gqa)
        except Uncovered:
            if fallback is None:
                raise
        return torch.empty_like(q)

    if not hasattr(getattr(torch.ops, namespace), "attention_features"):
        opdef = torch.library.custom_op(f"{namespace}::attention_features", impl, mutates_args=(), schema=FEATURES_SCHEMA)
        opdef.register_fake(fake)
    return getattr(torch.ops, namespace).attention_features.default


def make_feature_attention(plain: Callable[..., Any], forward: FeatureForward, op: Any) -> Callable[..., Any]:
    """``attention`` with the keywords of features and fallback; a call without them is ``plain``'s."""
    from .features import call_features, check_fallback

    compiling = torch.compiler.is_compiling
    tensor = torch.Tensor
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

    def attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                  *, window_size: Any = None, softcap: float | None = None, seqlens_k: Any = None,
                  leftpad_k: Any = None, fallback: str | None = None) -> Any:
        """softmax(q k^T * scale) v as torch.nn.functional.scaled_dot_product_attention computes it
        (is_causal: top-left aligned; scale: default 1/sqrt(head_dim); enable_gqa: k, v may have
        fewer heads). q: (batch, heads, seq_q, head_dim), k and v: (batch, heads_kv, seq_k,
        head_dim), CUDA tensors of one dtype with a contiguous last dimension. Returns a new
        tensor shaped like q.

        window_size=(left, right): query position i sees keys i - left .. i + right (-1:
        unlimited; with is_causal right is 0; aligned top-left as is_causal). softcap: scores
        become softcap * tanh(score * scale / softcap) before the softmax. seqlens_k, leftpad_k:
        int32 (batch,) tensors, batch b sees keys leftpad_k[b] .. seqlens_k[b] - 1 (padding); a
        query that sees no key gives 0. fallback='sdpa': a call no exported kernel covers runs
        SDPA (with the features as an explicit mask), counted per reason in fallback_counts();
        None (default): such a call raises ValueError."""
        if window_size is None and softcap is None and seqlens_k is None and leftpad_k is None and fallback is None:
            return plain(q, k, v, is_causal, scale, enable_gqa)
        features = call_features(window_size, softcap, seqlens_k, leftpad_k)
        check_fallback(fallback)
        if compiling() or type(q) is not tensor or type(k) is not tensor or type(v) is not tensor or dispatch_modes():
            return op(q, k, v, is_causal, scale, enable_gqa, features.window_left, features.window_right,
                      features.softcap, seqlens_k, leftpad_k, fallback)
        return forward(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, fallback)

    return attention
