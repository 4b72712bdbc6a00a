"""What a call asks beyond plain attention (a sliding window, soft-capping, per-batch key ranges),
which kernels serve it, the explicit mask it means, and the SDPA fallback with its counts.

A call's features follow flash-attn's names: ``window_size=(left, right)`` (-1: unlimited on that
side; with ``is_causal`` the right side is 0), ``softcap`` (scores become
``softcap * tanh(score * scale / softcap)`` before the softmax; 0: none) and, per batch,
``seqlens_k`` (keys at or past ``seqlens_k[b]`` are masked, as flash-attn's ``cache_seqlens``),
``leftpad_k`` (keys before ``leftpad_k[b]`` are masked, as ``cache_leftpad``) and ``seqlens_q``
(query positions at or past ``seqlens_q[b]`` see no key: a padded batch's padding rows, skipped
as flash-attn's ``seqused_q`` skips them, give 0), int32 tensors of shape (batch,). The window is
aligned top-left, as ``is_causal``: query position i sees keys i - left .. i + right (flash-attn
aligns bottom-right; the two agree when S_q == S_k). A query that sees no key gives 0, as
flash-attn.

A kernel built with a feature's compile-time switch (``// FEATURES seqlens softcap varlen window``)
serves calls with or without it; kernel.json lists each kernel's features and a call runs a
kernel whose features include what it asks (``select_kernel``). ``varlen`` is the packed layout
of ``attention_varlen`` (``varlen.py``: offsets ``cu_seqlens_q``, ``cu_seqlens_k``; its causal
mask and window align bottom-right, as flash-attn's varlen); null offsets are the dense layout.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping


SWITCHES = ("seqlens", "softcap", "varlen", "window")
"""Features a kernel's compile-time switches add (kernel.json ``features``)."""
POINTER_ARGS = ("seqlens_k", "leftpad_k", "seqlens_q", "cu_seqlens_q", "cu_seqlens_k")
"""Kernel arguments of ``seqlens`` kernels (int32 pointers, per batch; null: none) and ``varlen``
kernels (int32 pointers, batch + 1 offsets into packed sequences; null: the dense layout)."""
SCALAR_ARGS = ("window_left", "window_right", "softcap")
"""Kernel arguments of ``window`` (i32) and ``softcap`` (f32) kernels."""
FALLBACKS = (None, "sdpa")


class Uncovered(ValueError):
    """No kernel of the export serves this call (its dtype, head dim, device or features); with
    ``fallback="sdpa"`` such a call runs SDPA instead, counted by this reason."""


class UncoveredDtype(TypeError, Uncovered):
    """A dtype no kernel takes (a TypeError, as before, and ``Uncovered``)."""


@dataclass(frozen=True)
class CallFeatures:
    """A call's window, soft cap and whether it passes per-batch key ranges or query lengths (the
    tensors themselves travel per call)."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    seqlens: bool = False
    varlen: bool = False
    """Packed sequences (``attention_varlen``): offsets ``cu_seqlens_q``, ``cu_seqlens_k`` per call."""
    padded: bool = False
    """A padded batch (``seqlens_q``): dispatched among the measured padded cases (``dispatch``)."""

    def needed(self, causal: bool) -> tuple[str, ...]:
        """The switches a kernel needs to serve this call (sorted)."""
        window = self.window_left >= 0 or (self.window_right >= 0 and not causal)
        return tuple(name for name, on in (("seqlens", self.seqlens), ("softcap", self.softcap > 0),
                                           ("varlen", self.varlen), ("window", window)) if on)

    def values(self) -> dict[str, int | float]:
        """The scalar kernel arguments (every feature's; a kernel packs those it takes)."""
        return {"window_left": self.window_left, "window_right": self.window_right, "softcap": self.softcap}


PLAIN = CallFeatures()


def call_features(window_size: Any = None, softcap: float | None = None, seqlens_k: Any = None,
                  leftpad_k: Any = None, seqlens_q: Any = None) -> CallFeatures:
    """A call's features from ``attention``'s keywords; ValueError (one line) where malformed."""
    left, right = -1, -1
    if window_size is not None:
        try:
            left, right = (int(x) for x in window_size)
        except (TypeError, ValueError):
            raise ValueError(f"attention: window_size must be (left, right) integers, got {window_size!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"attention: window_size sides are -1 (unlimited) or >= 0, got {(left, right)}")
    cap = 0.0 if softcap is None else float(softcap)
    if not cap >= 0 or math.isinf(cap):
        raise ValueError(f"attention: softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    return CallFeatures(left, right, cap, seqlens_k is not None or leftpad_k is not None or seqlens_q is not None,
                        padded=seqlens_q is not None)


def check_ranges(q: Any, seqlens_k: Any, leftpad_k: Any, seqlens_q: Any = None) -> None:
    """ValueError (one line) unless each given range tensor is int32 (batch,) on q's device."""
    import torch

    for name, t in (("seqlens_k", seqlens_k), ("leftpad_k", leftpad_k), ("seqlens_q", seqlens_q)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (q.shape[0],):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"attention: {name} must be an int32 tensor of shape (batch,) = ({q.shape[0]},), got {got}")
        if t.device != q.device:
            raise ValueError(f"attention: {name} must be on q's device {q.device}, got {t.device}")
        if t.stride(0) != 1 and t.shape[0] > 1:
            raise ValueError(f"attention: {name} must be contiguous")


# -- which kernel ---------------------------------------------------------------------------------


def kernel_switches(features: Iterable[str]) -> tuple[str, ...]:
    """The compile-time switches among a kernel's features (sorted)."""
    return tuple(sorted(set(features) & set(SWITCHES)))


def select_kernel(kernels: Mapping[tuple, Any], variant: tuple[str, int, bool], config: str, fallback: str,
                  needed: tuple[str, ...]) -> Any:
    """The kernel of ``variant`` that serves a call needing ``needed``: the dispatched ``config``'s
    with the fewest switches, else the variant's ``fallback`` configuration's, else any
    configuration's (in key order); ``Uncovered`` naming the features where none has them."""
    candidates = [spec for key, spec in kernels.items() if key[:3] == variant
                  and set(needed) <= set(kernel_switches(spec.features))]
    if not candidates:
        dtype, head_dim, causal = variant
        raise Uncovered(f"attention: no exported kernel for {dtype} head_dim {head_dim}{' causal' if causal else ''} "
                        f"with {' and '.join(needed)}; export from a space whose shapes list these features")

    def rank(spec: Any) -> tuple[int, int, str]:
        return (0 if spec.config == config else 1 if spec.config == fallback else 2,
                len(kernel_switches(spec.features)), spec.config)

    return min(candidates, key=rank)


# -- the mask it means and the fallback -----------------------------------------------------------


def allowed_keys(batch: int, seq_q: int, seq_k: int, causal: bool, features: CallFeatures = PLAIN,
                 seqlens_k: Any = None, leftpad_k: Any = None, device: Any = "cpu", offset: int = 0,
                 seqlens_q: Any = None) -> Any:
    """The boolean mask (batch, 1, seq_q, seq_k) of the keys each query sees (True: attended);
    query i sits at key position i + ``offset`` for the causal mask and the window (0: top-left;
    ``seq_k - seq_q``: bottom-right, as flash-attn's varlen)."""
    import torch

    i = torch.arange(seq_q, device=device).view(seq_q, 1) + offset
    j = torch.arange(seq_k, device=device).view(1, seq_k)
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if features.window_left >= 0:
        allowed &= j >= i - features.window_left
    if features.window_right >= 0 and not causal:
        allowed &= j <= i + features.window_right
    allowed = allowed.expand(batch, 1, seq_q, seq_k)
    jb = j.view(1, 1, 1, seq_k)
    if seqlens_k is not None:
        allowed = allowed & (jb < seqlens_k.to(device=device, dtype=torch.long).view(batch, 1, 1, 1))
    if leftpad_k is not None:
        allowed = allowed & (jb >= leftpad_k.to(device=device, dtype=torch.long).view(batch, 1, 1, 1))
    if seqlens_q is not None:
        ib = i.view(1, 1, seq_q, 1)
        allowed = allowed & (ib < seqlens_q.to(device=device, dtype=torch.long).view(batch, 1, 1, 1))
    return allowed


def reference_attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, features: CallFeatures = PLAIN, seqlens_k: Any = None,
                        leftpad_k: Any = None, seqlens_q: Any = None) -> Any:
    """What a call computes, by torch alone (the fallback, and the tests' reference): SDPA, with
    the features as an explicit boolean mask; with soft-capping the scores in fp32. Rows that see
    no key give 0. The result has q's dtype (pass fp32 tensors for an fp32 reference)."""
    import torch.nn.functional as F

    if features.needed(bool(is_causal)) == () and seqlens_k is None and leftpad_k is None and seqlens_q is None:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(is_causal), scale=scale)
    mask = allowed_keys(q.shape[0], q.shape[2], k.shape[2], bool(is_causal), features, seqlens_k, leftpad_k, q.device,
                        seqlens_q=seqlens_q)
    return attend(q, k, v, mask, scale, features.softcap)


def repeat_kv(t: Any, heads: int) -> Any:
    """K or V with its heads repeated to ``heads`` (each K/V head serves a group of query heads)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def attend(q: Any, k: Any, v: Any, mask: Any, scale: float | None = None, softcap: float | None = None) -> Any:
    """softmax(q k^T * scale (soft-capped) + mask) v by torch: ``mask`` boolean (True: attended)
    or additive, broadcast to (batch, heads, seq_q, seq_k); k, v may have fewer heads. Rows a
    boolean mask masks entirely give 0."""
    import torch

    import torch.nn.functional as F

    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if softcap:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        out = torch.matmul(torch.softmax(scores, dim=-1).nan_to_num(0.0), v.float()).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask.dtype == torch.bool:
        out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0)
    return out


class FallbackCounts:
    """Calls that ran SDPA instead of a kernel, per reason (thread-safe)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self, reset: bool = False) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            if reset:
                self._counts.clear()
        return out


def check_fallback(fallback: Any) -> str | None:
    if fallback not in FALLBACKS:
        raise ValueError(f"attention: fallback must be None or 'sdpa', got {fallback!r}")
    return fallback
