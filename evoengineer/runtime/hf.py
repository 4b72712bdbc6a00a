"""Hugging Face transformers: ``hf_attention`` as an ``AttentionInterface`` function and its
registration with sdpa's mask builder."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "sliding_window": "a sliding window",
    "position_bias": "a position bias",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}
_MASK_SEEN: list[Any] = [None]  # (weak reference to the mask, its version, q_len, kv_len, causal?) of the last mask


def mask_causal(mask: Any, q_len: int, kv_len: int) -> bool:
    """False when ``mask`` masks nothing, True when it is exactly the top-left causal mask;
    otherwise a ValueError naming what the kernels cannot honour."""
    seen = _MASK_SEEN[0]
    if seen is not None and seen[0]() is mask and seen[1:4] == (mask._version, q_len, kv_len):
        return bool(seen[4])
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise ValueError("hf_attention: the attention mask is a general additive bias (values other than 0 and "
                             "-inf/the dtype's minimum); the exported kernels take no bias; use attn_implementation='sdpa'")
    else:
        raise ValueError(f"hf_attention: an attention mask of dtype {mask.dtype} is not understood")
    if tuple(allowed.shape[-2:]) not in ((q_len, kv_len), (1, kv_len), (q_len, 1), (1, 1)):
        raise ValueError(f"hf_attention: an attention mask of shape {tuple(mask.shape)} does not fit q_len {q_len}, "
                         f"kv_len {kv_len}")
    if bool(allowed.all()):
        verdict = False
    else:
        tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
        if q_len > 1 and bool((allowed == tril).all()):
            verdict = True
        else:
            raise ValueError(
                "hf_attention: the attention mask masks positions other than the plain causal pattern (padding, a "
                "sliding window, packed sequences, a static cache's unused slots, or queries after a cache with "
                "bottom-right alignment); the exported kernels compute full or top-left causal attention only. "
                "Use attn_implementation='sdpa' for such batches")
    _MASK_SEEN[0] = (weakref.ref(mask), mask._version, q_len, kv_len, verdict)
    return verdict


def make_hf_attention(attention: Callable[..., Any], gqa: bool) -> Callable[..., Any]:
    """``hf_attention`` over an export's ``attention``; ``gqa``: whether every kernel takes a K/V
    head count (otherwise K/V are repeated to q's heads, as sdpa_attention_forward does)."""

    def hf_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        """transformers' AttentionInterface function (as its sdpa_attention_forward): query (B, H,
        S_q, D), key and value (B, H_kv, S_k, D); returns (attn_output as (B, S_q, H, D), None).

        Causal exactly when sdpa_attention_forward is: no mask, q_len > 1 and the module causal
        (``is_causal`` kwarg, else ``module.is_causal``, default True); decode (q_len 1) attends
        the whole cache. A mask is inspected (once per mask tensor): one that masks nothing, or
        equals the top-left causal mask, is honoured; any other (padding, sliding window, a bias)
        raises ValueError, as do dropout > 0, soft-capping, sinks and paged caches."""
        if dropout:
            raise ValueError(f"hf_attention: dropout {dropout} is not supported (the kernels have no dropout; "
                             "evaluate with model.eval())")
        for name, what in UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"hf_attention: {what} ({name}={kwargs[name]!r}) is not supported by the exported kernels")
        if kwargs.get("cache") is not None:
            raise ValueError("hf_attention: paged caches (continuous batching) are not supported")
        q_len, kv_len = query.shape[2], key.shape[2]
        module_causal = kwargs.get("is_causal")
        if module_causal is None:
            module_causal = getattr(module, "is_causal", True)
        if attention_mask is None:
            causal = q_len > 1 and bool(module_causal)
        else:
            causal = mask_causal(attention_mask, q_len, kv_len)
        heads, heads_kv = query.shape[1], key.shape[1]
        grouped = heads != heads_kv
        if grouped and not gqa:  # kernels without a K/V head count: repeat K/V as sdpa_attention_forward does
            groups = heads // heads_kv
            b, _, s, d = key.shape
            key = key[:, :, None].expand(b, heads_kv, groups, s, d).reshape(b, heads, s, d)
            value = value[:, :, None].expand(b, heads_kv, groups, s, d).reshape(b, heads, s, d)
            grouped = False
        out = attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=grouped)
        return out.transpose(1, 2).contiguous(), None

    return hf_attention


def register_hf(hf_attention: Callable[..., Any], name: str = "evo") -> str:
    """Register ``hf_attention`` with transformers under ``name`` (then
    ``model.set_attn_implementation(name)`` or ``from_pretrained(..., attn_implementation=name)``),
    with sdpa's mask builder, so padding reaches hf_attention as a mask (and is refused)
    instead of being dropped. Returns ``name``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # older transformers build a mask for every implementation
        return name
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
