"""Hugging Face transformers: ``hf_attention`` as an ``AttentionInterface`` function and its
registration with sdpa's mask builder.

The 4-D masks sdpa's builder passes are read as the kernels' terms where that is exact:
per batch a key range [leftpad_k, seqlens_k) (left and right padding), top-left causal, and a
sliding window (left, right). ``mask_plan`` derives those terms and rebuilds the mask from them;
only a mask equal to its rebuild is served, any other is refused in one line (or, with
``fallback="sdpa"``, runs SDPA with the mask as given, counted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .features import PLAIN, CallFeatures, FallbackCounts, attend, check_fallback
from .held import HeldResults

UNSUPPORTED_KWARGS = {
    "position_bias": "a position bias",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}
_MASK_PLANS = HeldResults(1)  # the last mask's plan, while the mask lives unwritten


class MaskError(ValueError):
    """A mask the kernels cannot express exactly (``str()``: one line)."""


@dataclass(frozen=True)
class MaskPlan:
    """A mask in the kernels' terms: causal, a window, per-batch key ranges (None: none)."""

    causal: bool
    features: CallFeatures = PLAIN
    seqlens_k: Any = None
    leftpad_k: Any = None


def allowed_from_mask(mask: Any, q_len: int, kv_len: int) -> Any:
    """The boolean mask (True: attended) of an HF attention mask: boolean, or additive with 0 and
    -inf/the dtype's minimum only; MaskError for a general bias, another dtype or shape."""
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise MaskError("hf_attention: the attention mask is a general additive bias (values other than 0 and "
                            "-inf/the dtype's minimum); the exported kernels take no bias; use attn_implementation='sdpa'")
    else:
        raise MaskError(f"hf_attention: an attention mask of dtype {mask.dtype} is not understood")
    if allowed.dim() != 4 or tuple(allowed.shape[-2:]) not in ((q_len, kv_len), (1, kv_len), (q_len, 1), (1, 1)):
        raise MaskError(f"hf_attention: an attention mask of shape {tuple(mask.shape)} does not fit q_len {q_len}, "
                        f"kv_len {kv_len}")
    return allowed


@torch.compiler.disable
def mask_plan(mask: Any, batch: int, q_len: int, kv_len: int) -> MaskPlan:
    """The mask in the kernels' terms (computed once per mask tensor, ``HeldResults``); MaskError,
    one line, where no causal flag, window and per-batch key range rebuild it exactly. It reads the
    mask's values, so under torch.compile it runs eagerly, outside the graph (not traced into, where
    each of its reads would break the graph with a warning)."""
    return _MASK_PLANS.get((mask,), (batch, q_len, kv_len), lambda: _mask_plan(mask, batch, q_len, kv_len))


def _keys_of(mask: Any, kv_len: int) -> Any:
    """A 4-D mask cut to the first ``kv_len`` keys (as sdpa_attention_forward cuts a static cache's)."""
    return mask[:, :, :, :kv_len] if mask.dim() == 4 and mask.shape[-1] != kv_len else mask


def _mask_plan(mask: Any, batch: int, q_len: int, kv_len: int) -> MaskPlan:
    allowed = allowed_from_mask(_keys_of(mask, kv_len), q_len, kv_len)
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise MaskError("hf_attention: the attention mask differs between heads; the exported kernels take one mask "
                        "per batch")
    return _plan(allowed[:, 0].expand(batch, q_len, kv_len), batch, q_len, kv_len)


def _plan(a: Any, batch: int, q_len: int, kv_len: int) -> MaskPlan:
    """The plan of ``a`` (batch, q_len, kv_len), read as intervals: each row's first and last key and
    how many it sees (three passes over the mask; the rest is per row). A candidate (causal, window,
    ranges) is exact where every row's keys are the one interval it gives that row. Two reads on the
    host: the mask's summary, then every candidate's check."""
    if a.numel() == 0:
        return MaskPlan(False)
    device = a.device
    seen_keys = a.any(dim=1)                                        # (batch, kv_len): keys some query sees
    has = seen_keys.any(dim=1)
    j = torch.arange(kv_len, device=device)
    lo = torch.where(has, torch.where(seen_keys, j, kv_len).amin(dim=1), 0).to(torch.int32)
    hi = torch.where(has, torch.where(seen_keys, j + 1, 0).amax(dim=1), 0).to(torch.int32)
    bytes_ = a.to(torch.uint8)
    count = bytes_.sum(dim=2)                                       # (batch, q_len): keys each row sees
    first = bytes_.argmax(dim=2)                                    # its first key (argmax: the first maximum)
    last = kv_len - 1 - bytes_.flip(2).argmax(dim=2)                # its last key
    seeing = count > 0
    i = torch.arange(q_len, device=device).view(1, q_len)
    summary = torch.stack([
        (count == kv_len).all().long(), (lo > 0).any().long(), (hi < kv_len).any().long(),
        (seeing & (last > i)).any().long(),                           # a key after its row: not causal
        torch.where(seeing, i - first, -kv_len).max(),                # query position - key position, at most
        torch.where(seeing, last - i, -q_len).max()]).tolist()
    everything, padded_left, padded_right, after_row, left, right = summary
    if everything:
        return MaskPlan(False)
    leftpad = lo if padded_left else None
    seqlens = hi if padded_right else None
    candidates: list[tuple[bool, CallFeatures]] = [(False, PLAIN)]
    if q_len > 1:
        causal = not after_row
        candidates = [(causal, PLAIN)]
        if left >= 0 and (causal or right >= 0):
            candidates.append((causal, CallFeatures(window_left=left, window_right=-1 if causal else right)))
    contiguous = (last - first + 1 == count) | ~seeing
    range_lo, range_hi = lo.view(batch, 1).long(), hi.view(batch, 1).long() - 1   # the batch's keys
    checks = []
    for causal, features in candidates:
        want_lo, want_hi = range_lo.expand(batch, q_len), range_hi.expand(batch, q_len)
        if features.window_left >= 0:
            want_lo = torch.maximum(want_lo, i - features.window_left)
        if causal:
            want_hi = torch.minimum(want_hi, i)
        elif features.window_right >= 0:
            want_hi = torch.minimum(want_hi, i + features.window_right)
        sees = want_lo <= want_hi
        checks.append((contiguous & (sees == seeing) & (~seeing | ((first == want_lo) & (last == want_hi)))).all())
    for (causal, features), exact in zip(candidates, torch.stack(checks).tolist()):
        if exact:
            return MaskPlan(causal, features, seqlens_k=seqlens, leftpad_k=leftpad)
    raise MaskError(
        "hf_attention: the attention mask is not padding (left or right), top-left causal and a sliding window; "
        "the exported kernels express only those (packed sequences, a static cache's unused slots, queries after a "
        "cache with bottom-right alignment are not): use attn_implementation='sdpa', or register_hf(fallback='sdpa')")


def make_hf_attention(attention: Callable[..., Any], gqa: bool, fallback: str | None = None,
                      counts: FallbackCounts | None = None) -> Callable[..., Any]:
    """``hf_attention`` over an export's ``attention``; ``gqa``: whether every kernel takes a K/V
    head count (otherwise K/V are repeated to q's heads, as sdpa_attention_forward does);
    ``fallback="sdpa"``: a mask the kernels cannot express runs SDPA (counted in ``counts``), and
    ``attention`` is called with the same fallback."""
    check_fallback(fallback)

    def hf_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        """transformers' AttentionInterface function (as its sdpa_attention_forward): query (B, H,
        S_q, D), key and value (B, H_kv, S_k, D); returns (attn_output as (B, S_q, H, D), None).

        Without a mask: causal exactly when sdpa_attention_forward is (q_len > 1 and the module
        causal: ``is_causal`` kwarg, else ``module.is_causal``, default True), with a window of
        ``sliding_window - 1`` keys back where the keys outnumber it (the flash-attention
        integration's reading of the kwarg; a decode step sees the last ``sliding_window`` keys).
        A mask is read once per mask tensor (``mask_plan``): padding, causal and a sliding window
        are served (in training too: the backward kernels take the same terms); another mask
        raises ValueError (or runs SDPA with ``fallback``). ``softcap``
        (kwarg, else ``module.attn_logit_softcapping``) caps the scores. Dropout > 0, sinks, a
        position bias and paged caches raise ValueError."""
        if dropout:
            raise ValueError(f"hf_attention: dropout {dropout} is not supported (the kernels have no dropout; "
                             "evaluate with model.eval())")
        for name, what in UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"hf_attention: {what} ({name}={kwargs[name]!r}) is not supported by the exported kernels")
        if kwargs.get("cache") is not None:
            raise ValueError("hf_attention: paged caches (continuous batching) are not supported")
        batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
        softcap = kwargs.get("softcap")
        if softcap is None:
            softcap = getattr(module, "attn_logit_softcapping", None)
        softcap = float(softcap) if softcap else None
        try:   # the mask as given (its plan held across the layers), cut to the keys there
            plan = _call_plan(module, attention_mask, batch, q_len, kv_len, kwargs, query.device)
        except MaskError as exc:
            if fallback is None:
                raise
            if counts is not None:
                counts.add(str(exc).split(";")[0].removeprefix("hf_attention: "))
            mask = (_keys_of(attention_mask, kv_len) if attention_mask is not None
                    else _window_mask(q_len, kv_len, kwargs, query.device))
            out = attend(query, key, value, mask, scaling, softcap)
            return out.transpose(1, 2).contiguous(), None
        heads, heads_kv = query.shape[1], key.shape[1]
        grouped = heads != heads_kv
        if grouped and not gqa:  # kernels without a K/V head count: repeat K/V as sdpa_attention_forward does
            groups = heads // heads_kv
            b, _, s, d = key.shape
            key = key[:, :, None].expand(b, heads_kv, groups, s, d).reshape(b, heads, s, d)
            value = value[:, :, None].expand(b, heads_kv, groups, s, d).reshape(b, heads, s, d)
            grouped = False
        extra: dict[str, Any] = {}
        if plan.features.window_left >= 0 or plan.features.window_right >= 0:
            extra["window_size"] = (plan.features.window_left, plan.features.window_right)
        if softcap:
            extra["softcap"] = softcap
        if plan.seqlens_k is not None:
            extra["seqlens_k"] = plan.seqlens_k
        if plan.leftpad_k is not None:
            extra["leftpad_k"] = plan.leftpad_k
        if fallback is not None:
            extra["fallback"] = fallback
        out = attention(query, key, value, is_causal=plan.causal, scale=scaling, enable_gqa=grouped, **extra)
        return out.transpose(1, 2).contiguous(), None

    return hf_attention


def _window_mask(q_len: int, kv_len: int, kwargs: dict[str, Any], device: Any) -> Any:
    """The causal sliding-window mask, aligned bottom-right (queries after a cache), as
    (1, 1, q_len, kv_len) booleans."""
    i = torch.arange(q_len, device=device).view(q_len, 1) + (kv_len - q_len)
    j = torch.arange(kv_len, device=device).view(1, kv_len)
    return ((j <= i) & (j > i - int(kwargs["sliding_window"]))).view(1, 1, q_len, kv_len)


def _call_plan(module: Any, mask: Any, batch: int, q_len: int, kv_len: int, kwargs: dict[str, Any],
               device: Any) -> MaskPlan:
    """The call in the kernels' terms, from the mask or, without one, the module and kwargs."""
    if mask is not None:
        return mask_plan(mask, batch, q_len, kv_len)
    module_causal = kwargs.get("is_causal")
    if module_causal is None:
        module_causal = getattr(module, "is_causal", True)
    causal = q_len > 1 and bool(module_causal)
    window = kwargs.get("sliding_window")
    if window is None or kv_len <= int(window):
        return MaskPlan(causal)
    if q_len == 1:  # a decode step: the last `window` keys
        start = torch.full((batch,), kv_len - int(window), dtype=torch.int32, device=device)
        return MaskPlan(False, leftpad_k=start)
    if not causal or q_len != kv_len:
        raise MaskError(f"hf_attention: a sliding window ({window}) without a mask over {q_len} queries and {kv_len} "
                        "keys (not causal, or after a cache) is not expressible")
    return MaskPlan(True, CallFeatures(window_left=int(window) - 1))


def register_hf(hf_attention: Callable[..., Any], name: str = "evo") -> str:
    """Register ``hf_attention`` with transformers under ``name`` (then
    ``model.set_attn_implementation(name)`` or ``from_pretrained(..., attn_implementation=name)``),
    with sdpa's mask builder (``mask_builder``), so padding and sliding windows reach hf_attention
    as a mask instead of being dropped. Returns ``name``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # older transformers build a mask for every implementation
        return name
    AttentionMaskInterface.register(name, mask_builder(ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]))
    return name


def mask_builder(sdpa_mask: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' mask builder for hf_attention: sdpa's, but where there is no padding mask and
    the causal (or full) pattern is all the mask would hold, None even while tracing
    (``torch.compile``, CUDA-graph capture), where sdpa's builds the whole mask: hf_attention then
    takes causal from the module, as without a mask, and reads no mask on the host
    (``mask_plan``'s reads would break the graph, or the capture)."""

    def evo_mask(*args: Any, **kwargs: Any) -> Any:
        if not args and needs_no_mask(kwargs):
            return None
        return sdpa_mask(*args, **kwargs)

    return evo_mask


def needs_no_mask(kwargs: dict[str, Any]) -> bool:
    """Whether a mask builder's call (transformers' keywords: q_length, kv_length, q_offset,
    attention_mask, local_size, allow_is_causal_skip, allow_is_bidirectional_skip) is served by
    no mask: no padding, no window that reaches past a key, and then a causal pattern sdpa's
    builder would also skip when not tracing (one query, as many queries as keys, or queries from
    position 0), or a full one it may skip."""
    q_length, kv_length, local = kwargs.get("q_length"), kwargs.get("kv_length"), kwargs.get("local_size")
    if kwargs.get("attention_mask") is not None or type(q_length) is not int or type(kv_length) is not int:
        return False
    if local is not None and kv_length >= local:
        return False
    if kwargs.get("allow_is_bidirectional_skip", False):
        return True
    q_offset = kwargs.get("q_offset", 0)
    return bool(kwargs.get("allow_is_causal_skip", True)) and (
        q_length == 1 or q_length == kv_length or (type(q_offset) is int and q_offset == 0))
