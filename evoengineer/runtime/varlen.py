"""Packed variable-length sequences in flash-attn's varlen convention:

    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0, fallback=None)

q is (total_q, heads, head_dim), k and v (total_k, heads_kv, head_dim) with heads_kv dividing
heads (grouped-query attention, as flash-attn: no ``enable_gqa`` needed), each with a contiguous
last dimension; ``cu_seqlens_q``, ``cu_seqlens_k`` are int32 (batch + 1,) offsets on q's device:
sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (and of the
output, shaped like q), its keys rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v.
``max_seqlen_q``, ``max_seqlen_k`` are the longest sequence's lengths (Python ints; the grid
covers max_seqlen_q, the dispatch reads both as a dense call's (batch, heads, S_q, S_k)).

``is_causal`` and the window align bottom-right, as flash-attn 2.1+ and unlike the dense
``attention`` (top-left, as SDPA): query i of a sequence with L_q queries and L_k keys sits at
key position i + L_k - L_q (the two agree where L_q == L_k). A query that sees no key gives 0; a
sequence without queries writes nothing. The kernels are the mma or wgmma path's with the
``VARLEN`` switch (kernel.json ``features``: ``varlen``); every export carries one per variant.
A kernel that loads by TMA gets its tensor maps over the packed tensors as one batch of all
their tokens (``packed_view``): a sequence's tiles start at its offset row.

The offsets are read (one small copy to the host, which waits for the GPU) and checked: starting
at 0, not decreasing, ending at q's and k's token counts, no sequence longer than its max_seqlen.
A check holds for the same two tensors while torch's version counter says neither was written
(``CheckedOffsets``): a model's layers, called with one pair, copy it once. Contents written
behind torch's back (a raw kernel, a CUDA graph's replay) are not read again, nor, while a CUDA
graph is being captured, at all: they are taken as given, as flash-attn takes them.
A call whose inputs require grad trains through the export's dense kernels on a padded batch that
holds the sequences (``padded_layout``, ``train_packed``: its LSE forward and its backward with
per-batch ranges). ``fallback='sdpa'`` runs SDPA per sequence for a call no kernel covers, or whose
gradient the export's backward does not cover, counted in ``fallback_counts()``; without it such
calls raise in one line.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from .checks import DTYPE_NAMES, Coverage, check_grad, check_layout, check_variant
from .features import CallFeatures, FallbackCounts, Uncovered, allowed_keys, attend, call_features
from .features import check_fallback, select_kernel
from .held import HeldResults
from .launch import ALIGNMENT_ERROR, MAX_GRID_ROWS, MAX_PLANS, Launcher, Plan

WHO = "attention_varlen"
SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
          "bool is_causal=False, float? scale=None, int window_left=-1, int window_right=-1, float softcap=0.0, "
          "str? fallback=None) -> Tensor")
GRAD_REASON = "a gradient is needed (q, k or v requires grad) and this export's backward does not cover the call"
GRAD_ERROR = (f"{WHO}: {GRAD_REASON} ({{why}}); call under torch.no_grad(), or with fallback='sdpa' (SDPA per sequence "
              "computes such calls and their gradients)")
CAPTURING: Callable[[], bool] = torch.cuda.is_current_stream_capturing


def varlen_features(window_size: Any = (-1, -1), softcap: float | None = 0.0) -> CallFeatures:
    """A varlen call's features (its window and soft cap, and the packed layout itself)."""
    return replace(call_features(window_size, softcap), varlen=True)


# -- what a call must satisfy -----------------------------------------------------------------------


def check_arguments(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                    max_seqlen_k: Any) -> None:
    """TypeError or ValueError (one line) unless the arguments are tensors and the maxima integers
    (what each call checks before its plan is looked up)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{WHO}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise TypeError(f"{WHO}: {name} must be an int, got {type(n).__name__}")
        if isinstance(n, int) and n < 0:
            raise ValueError(f"{WHO}: {name} must be >= 0, got {n}")


def check_varlen(coverage: Coverage, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                 max_seqlen_k: Any, is_causal: bool, scale: float | None) -> None:
    """TypeError or ValueError (``attention_varlen: ...``, one line) unless the call is well-formed,
    from metadata only (so it also runs on fake tensors); ``Uncovered`` where it is but no kernel
    covers it (dtype, head dim, GQA, device): what the fallback serves."""
    check_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{WHO}: {name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    variant = check_variant(coverage, q, k, v, is_causal, WHO)
    if k.shape != v.shape:
        raise ValueError(f"{WHO}: k and v must have one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"{WHO}: q's heads ({heads}) must be a multiple of k and v's heads ({heads_kv})")
    if heads != heads_kv and not coverage.variant_gqa[variant]:
        raise Uncovered(f"{WHO}: k and v have {heads_kv} heads and q {heads}, but this export's kernels take no K/V head "
                        f"count (no grouped-query attention); repeat k and v to {heads} heads")
    check_layout(WHO, q, k, v, scale)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{WHO}: {name} must be an int32 tensor of shape (batch + 1,), got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{WHO}: {name} must be on q's device {q.device}, got {t.device}")
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{WHO}: {name} must be contiguous")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{WHO}: cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if q.device.type not in ("cuda", "meta"):  # meta tensors: the output's shape only (fake implementations)
        raise Uncovered(f"{WHO}: q, k and v must be CUDA tensors, got device {q.device}")


def _shown(offsets: list[int]) -> str:
    return str(offsets) if len(offsets) <= 12 else f"[{', '.join(map(str, offsets[:10]))}, ..., {offsets[-1]}]"


def check_offsets(cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int, max_seqlen_q: int,
                  max_seqlen_k: int) -> tuple[list[int], list[int]]:
    """The offsets as lists (one copy to the host); ValueError (one line) unless each starts at
    0, does not decrease, ends at its tensor's token count and has no sequence longer than its
    max_seqlen."""
    offsets_q, offsets_k = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    for which, offsets, total, longest in (("q", offsets_q, total_q, max_seqlen_q), ("k", offsets_k, total_k, max_seqlen_k)):
        name = f"cu_seqlens_{which}"
        if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"{WHO}: {name} must start at 0 and not decrease, got {_shown(offsets)}")
        if offsets[-1] != total:
            raise ValueError(f"{WHO}: {name} ends at {offsets[-1]} but {which} holds {total} tokens (its first dimension)")
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if lengths and max(lengths) > longest:
            seq = lengths.index(max(lengths))
            raise ValueError(f"{WHO}: sequence {seq} has {max(lengths)} {'queries' if which == 'q' else 'keys'}, more "
                             f"than max_seqlen_{which} = {longest}")
    return offsets_q, offsets_k


class CheckedOffsets:
    """``check_offsets`` of the last few (cu_seqlens_q, cu_seqlens_k) pairs it passed, held while
    both tensors live unwritten (``HeldResults``): a call with the same pair, token counts and
    maxima reuses the check instead of copying the offsets to the host again."""

    SIZE = 8

    def __init__(self) -> None:
        self._held = HeldResults(self.SIZE)

    def get(self, cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int, max_seqlen_q: int,
            max_seqlen_k: int) -> tuple[list[int], list[int]]:
        """``check_offsets(...)``, or its result for this pair when it holds still."""
        return self._held.get((cu_seqlens_q, cu_seqlens_k), (total_q, total_k, max_seqlen_q, max_seqlen_k),
                              lambda: check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                                                    max_seqlen_k))


def offsets_of(lengths: Any) -> list[int]:
    """The offsets (``cu_seqlens``, batch + 1) of packed sequences of these lengths."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return offsets


# -- the reference (the fallback) --------------------------------------------------------------------


def reference_varlen(q: Any, k: Any, v: Any, offsets_q: list[int], offsets_k: list[int], is_causal: bool = False,
                     scale: float | None = None, features: CallFeatures = CallFeatures(varlen=True)) -> Any:
    """What a varlen call computes, by torch alone, sequence by sequence (SDPA with the causal mask
    and window aligned bottom-right as an explicit mask; soft-capping in fp32): the fallback, and
    the tests' reference (pass fp32 tensors for an fp32 one). Differentiable."""
    pieces = []
    for b in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:   # no keys: every query sees none
            pieces.append(q.new_zeros(q1 - q0, *q.shape[1:]))
            continue
        qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t, lo, hi in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        mask = allowed_keys(1, q1 - q0, k1 - k0, bool(is_causal), features, device=q.device, offset=(k1 - k0) - (q1 - q0))
        pieces.append(attend(qs, ks, vs, mask, scale, features.softcap)[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else q.new_zeros(q.shape)


def sdpa_per_sequence(q: Any, k: Any, v: Any, offsets_q: list[int], offsets_k: list[int], is_causal: bool = False,
                      scale: float | None = None) -> Any:
    """SDPA sequence by sequence over packed q, k, v, outputs concatenated: what a caller without
    packed kernels runs (grouped heads through ``enable_gqa``; causal through ``is_causal`` where a
    sequence has as many keys as queries, else a bottom-right mask). Sequences without queries are
    left out; every sequence needs a key."""
    import torch.nn.functional as F

    gqa = k.shape[1] != q.shape[1]
    pieces = []
    for b in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[b], offsets_q[b + 1], offsets_k[b], offsets_k[b + 1]
        if q1 == q0:
            continue
        qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t, lo, hi in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        mask, causal = None, bool(is_causal)
        if causal and q1 - q0 != k1 - k0:
            mask = allowed_keys(1, q1 - q0, k1 - k0, True, device=q.device, offset=(k1 - k0) - (q1 - q0))
            causal = False
        pieces.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                                     enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else q.new_zeros(q.shape)


# -- training: packed sequences through the padded batch's kernels ----------------------------------


@dataclass(frozen=True)
class PaddedLayout:
    """Packed sequences placed in a padded batch (``batch`` rows of ``seq`` positions) where the dense
    kernels' top-left causal mask and window are the packed call's bottom-right ones: sequence b's
    queries sit at positions shift_q .. shift_q + L_q - 1 and its keys at shift_k .. shift_k + L_k - 1,
    shift_q - shift_k = L_k - L_q (one of them 0). Positions before shift_q hold zero queries whose
    outputs are dropped (their output gradient is 0, so they add nothing to dK, dV). Tensors on the
    offsets' device: ``rows_q``, ``rows_k`` each packed token's row (b * seq + position) in the padded
    layout (int64), ``seqlens_q``, ``leftpad_k``, ``seqlens_k`` the padded call's ranges (int32)."""

    batch: int
    seq: int
    rows_q: Any
    rows_k: Any
    seqlens_q: Any
    leftpad_k: Any
    seqlens_k: Any


def padded_layout(cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int, max_seqlen_q: int,
                  max_seqlen_k: int) -> PaddedLayout:
    """The padded batch of ``max(max_seqlen_q, max_seqlen_k)`` positions that holds packed sequences of
    these offsets (``PaddedLayout``), computed on their device without reading them."""
    batch = int(cu_seqlens_q.shape[0]) - 1
    seq = max(int(max_seqlen_q), int(max_seqlen_k), 1)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    shift_q, shift_k = (len_k - len_q).clamp_min(0), (len_q - len_k).clamp_min(0)
    sequences = torch.arange(batch, device=cu_q.device)

    def rows(lengths: Any, cu: Any, shift: Any, total: int) -> Any:
        b = torch.repeat_interleave(sequences, lengths, output_size=total)   # each token's sequence
        return b * seq + shift[b] + torch.arange(total, device=cu.device) - cu[b]

    return PaddedLayout(batch, seq, rows(len_q, cu_q, shift_q, total_q), rows(len_k, cu_k, shift_k, total_k),
                        (shift_q + len_q).int(), shift_k.int(), (shift_k + len_k).int())


def train_packed(attention: Callable[..., Any], q: Any, k: Any, v: Any, layout: PaddedLayout, is_causal: bool,
                 scale: float | None, features: CallFeatures) -> Any:
    """A packed call computed by ``attention`` (the export's, or a reference) on the padded batch of
    ``layout``: q, k and v copied into it, the output copied back; differentiable (the copies are
    torch's index operations, the attention its own autograd)."""
    rows_q, rows_k = layout.rows_q, layout.rows_k
    ranges = {name: getattr(layout, name) for name in ("seqlens_q", "leftpad_k", "seqlens_k")}

    def padded(t: Any, rows: Any) -> Any:
        flat = t.new_zeros(layout.batch * layout.seq, *t.shape[1:]).index_copy(0, rows, t)
        return flat.view(layout.batch, layout.seq, *t.shape[1:]).transpose(1, 2)   # (batch, heads, seq, head_dim)

    out = attention(padded(q, rows_q), padded(k, rows_k), padded(v, rows_k), is_causal=bool(is_causal), scale=scale,
                    enable_gqa=k.shape[1] != q.shape[1], window_size=(features.window_left, features.window_right),
                    softcap=features.softcap or None, **ranges)
    return out.transpose(1, 2).reshape(layout.batch * layout.seq, *q.shape[1:]).index_select(0, rows_q)


# -- the launches -------------------------------------------------------------------------------------


def _empty_output(q: Any, k: Any, v: Any) -> Any:
    return torch.empty_like(q)


def _zero_output(q: Any, k: Any, v: Any) -> Any:
    return torch.zeros_like(q)


def packed_view(t: Any) -> Any:
    """A packed (tokens, heads, head_dim) tensor as the (batch, heads, seq, head_dim) tensor a
    tensor map describes: one batch of every token (a view, same data)."""
    return t.transpose(0, 1).unsqueeze(0)


def packed_strides(t: Any) -> tuple[int, int, int]:
    """(batch, head, row) element strides of a packed (tokens, heads, head_dim) tensor: batch 0,
    a dimension of size 1 0 (never stepped)."""
    return (0, 0 if t.shape[1] == 1 else t.stride(1), 0 if t.shape[0] == 1 else t.stride(0))


class VarlenLauncher:
    """Plans (per thread, in the launcher's cache) and the forward of varlen calls of one export."""

    def __init__(self, launcher: Launcher, attention: Callable[..., Any] | None = None) -> None:
        self.launcher = launcher
        self.attention = attention   # the export's dense attention: calls that need a gradient train through it
        self.fallbacks: FallbackCounts = launcher.fallbacks
        self.checked = CheckedOffsets()
        self.forward = self._make_forward()

    def plan(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
             max_seqlen_k: int, is_causal: bool, scale: float | None, features: CallFeatures,
             fallback: str | None) -> Plan:
        """This thread's plan of such a call (a fallback plan where no kernel serves it and
        ``fallback`` is set), built once per key."""
        key = ("varlen", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, cu_seqlens_q.shape, cu_seqlens_k.shape, cu_seqlens_q.stride(),
               cu_seqlens_k.stride(), cu_seqlens_q.dtype, cu_seqlens_k.dtype, cu_seqlens_q.device, cu_seqlens_k.device,
               max_seqlen_q, max_seqlen_k, bool(is_causal), scale, features, fallback)
        plans = self.launcher.plans()
        plan = plans.get(key)
        if plan is None:
            try:
                plan = self._build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                   features)
            except Uncovered as exc:
                if fallback is None:
                    raise
                plan = Plan(_empty_output, fallback=str(exc).removeprefix(f"{WHO}: ").removeprefix("attention: "))
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plans[key] = plan
        return plan

    def _build(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
               max_seqlen_k: int, is_causal: bool, scale: float | None, features: CallFeatures) -> Plan:
        launcher = self.launcher
        check_varlen(launcher.coverage, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
        batch = int(cu_seqlens_q.shape[0]) - 1
        total_q, heads, head_dim = (int(x) for x in q.shape)
        heads_kv = int(k.shape[1])
        if total_q == 0 or batch == 0 or heads == 0 or q.is_meta:
            return Plan(_empty_output)
        if max_seqlen_q == 0 or int(k.shape[0]) == 0:   # no query row, or no key for any (the offsets say so too)
            return Plan(_zero_output)
        if batch * heads > MAX_GRID_ROWS:
            raise ValueError(f"{WHO}: batch * heads = {batch * heads} exceeds the grid's {MAX_GRID_ROWS} (the kernels "
                             "put one (sequence, head) per grid row); split the batch")
        out_meta = torch.empty_like(q, device="meta")
        strides = (packed_strides(q), packed_strides(k), packed_strides(v), packed_strides(out_meta))
        if any(s % 8 for group in strides for s in group):
            raise ValueError(f"{WHO}: strides must be multiples of 8 elements (16 bytes), got q {tuple(q.stride())}, "
                             f"k {tuple(k.stride())}, v {tuple(v.stride())}; pass .contiguous() copies")
        dtype, causal = DTYPE_NAMES[q.dtype], bool(is_causal)
        table = launcher.table
        cid = table.choose(dtype, head_dim, causal, batch, heads, max_seqlen_q, max_seqlen_k, heads_kv, varlen=True)
        spec = select_kernel(launcher.data.kernels, (dtype, head_dim, causal), cid,
                             table.variants[(dtype, head_dim, causal)].fallback, features.needed(causal))
        try:
            maps, map_at, keep = launcher._encode_maps(spec, *(packed_view(t) for t in (q, k, v, out_meta)))
        except ValueError as exc:
            raise ValueError(str(exc).replace("attention:", f"{WHO}:", 1)) from None
        return launcher.plan_launches(spec, q.get_device(), (batch, heads, heads_kv, max_seqlen_q, max_seqlen_k, head_dim),
                                      strides, scale, features=features, maps=maps, map_at=map_at, keep=keep)

    def _make_forward(self) -> Callable[..., Any]:
        plan_of, counts, capturing, checked = self.plan, self.fallbacks, CAPTURING, self.checked.get

        def forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
                    is_causal: bool, scale: float | None, features: CallFeatures, fallback: str | None) -> Any:
            check_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            plan = plan_of(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, features,
                           fallback)
            offsets = None
            if not (q.is_meta or cu_seqlens_q.is_meta or (q.is_cuda and capturing())):
                offsets = checked(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
            if plan.fallback is not None:
                counts.add(plan.fallback)
                if offsets is None:
                    offsets = (cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
                return reference_varlen(q, k, v, *offsets, is_causal, scale, features)
            if plan.varlen:
                if (cu_seqlens_q.data_ptr() | cu_seqlens_k.data_ptr()) & 3:
                    raise ValueError(ALIGNMENT_ERROR.replace("attention:", f"{WHO}:"))
                struct = plan.packed.values  # type: ignore[union-attr]
                struct.cu_seqlens_q = cu_seqlens_q.data_ptr()
                struct.cu_seqlens_k = cu_seqlens_k.data_ptr()
            return plan.run(q, k, v)

        return forward

    def with_grad(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                  max_seqlen_k: int, is_causal: bool, scale: float | None, features: CallFeatures,
                  fallback: str | None) -> Any:
        """A call whose inputs require grad: the export's attention on the padded batch that holds the
        sequences (``train_packed``: its LSE forward and backward with per-batch ranges) where its backward
        covers the call; else SDPA per sequence (differentiable, counted) with ``fallback``, otherwise
        NotImplementedError in one line."""
        why = ""
        try:
            check_varlen(self.launcher.coverage, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         is_causal, scale)
            why = self.untrainable(q, is_causal, features)
        except Uncovered as exc:
            why = str(exc)
        if why and fallback is None:
            raise NotImplementedError(GRAD_ERROR.format(why=why.removeprefix(f"{WHO}: ").removeprefix("attention: ")))
        offsets = self.checked.get(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
        if not why:
            layout = padded_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
            return train_packed(self.attention, q, k, v, layout, is_causal, scale, features)
        self.fallbacks.add(GRAD_REASON)
        return reference_varlen(q, k, v, *offsets, is_causal, scale, features)

    def untrainable(self, q: Any, is_causal: bool, features: CallFeatures) -> str:
        """Why the export's backward cannot train such a call on a padded batch ('' where it can): its
        (dtype, head dim, causal) with per-batch ranges and the call's window and soft cap."""
        if self.attention is None:
            return "no attention to train through"
        needed = replace(features, varlen=False, seqlens=True).needed(bool(is_causal))
        try:
            check_grad(self.launcher.data.backward, DTYPE_NAMES.get(q.dtype, str(q.dtype)), int(q.shape[-1]),
                       bool(is_causal), WHO, needed)
        except NotImplementedError as exc:
            return str(exc).split(" but ", 1)[-1].split("; ", 1)[0]
        return ""


# -- the custom op and the function a user calls ----------------------------------------------------


Forward = Callable[..., Any]
"""``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, features, fallback)``."""


def register_varlen_op(namespace: str, forward: Forward, coverage: Coverage) -> Any:
    """``torch.ops.<namespace>.attention_varlen.default`` with a fake implementation (metadata
    checks, the output's shape), so ``torch.compile(fullgraph=True)`` traces a varlen call."""

    def impl(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
             is_causal: bool = False, scale: float | None = None, window_left: int = -1, window_right: int = -1,
             softcap: float = 0.0, fallback: str | None = None) -> Any:
        features = varlen_features((window_left, window_right), softcap)
        return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, features,
                       fallback)

    def fake(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
             is_causal: bool = False, scale: float | None = None, window_left: int = -1, window_right: int = -1,
             softcap: float = 0.0, fallback: str | None = None) -> Any:
        varlen_features((window_left, window_right), softcap)
        check_fallback(fallback)
        try:
            check_varlen(coverage, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
        except Uncovered:
            if fallback is None:
                raise
        return torch.empty_like(q)

    if not hasattr(getattr(torch.ops, namespace), "attention_varlen"):
        opdef = torch.library.custom_op(f"{namespace}::attention_varlen", impl, mutates_args=(), schema=SCHEMA)
        opdef.register_fake(fake)
    return getattr(torch.ops, namespace).attention_varlen.default


def make_varlen_attention(forward: Forward, op: Any, with_grad: Forward) -> Callable[..., Any]:
    """``attention_varlen`` of one export: eager calls on plain tensors run ``forward`` directly,
    traced ones (torch.compile, tensor subclasses, dispatch modes) go through ``op``."""
    compiling = torch.compiler.is_compiling
    grad_enabled = torch.is_grad_enabled
    tensor = torch.Tensor
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

    def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                         max_seqlen_k: int, *, is_causal: bool = False, scale: float | None = None,
                         window_size: Any = (-1, -1), softcap: float = 0.0, fallback: str | None = None) -> Any:
        """Attention over packed variable-length sequences, as flash-attn's
        ``flash_attn_varlen_func``: q (total_q, heads, head_dim), k and v (total_k, heads_kv,
        head_dim) CUDA tensors of one dtype (heads_kv divides heads), ``cu_seqlens_q``,
        ``cu_seqlens_k`` int32 (batch + 1,) offsets (sequence b: rows cu_seqlens[b] ..
        cu_seqlens[b + 1] - 1), ``max_seqlen_q``, ``max_seqlen_k`` the longest lengths. Returns a
        new tensor shaped like q. ``is_causal`` and ``window_size=(left, right)`` align
        bottom-right (query i of L_q sees keys up to i + L_k - L_q); ``scale`` defaults to
        1/sqrt(head_dim); ``softcap``: scores become softcap * tanh(score * scale / softcap). A
        query that sees no key gives 0. ``fallback='sdpa'``: SDPA per sequence where no kernel
        serves the call or its inputs require grad (counted in fallback_counts()); None: such a
        call raises. The offsets are checked (one copy to the host, again only once either tensor
        is written through torch or another pair is passed) except while a CUDA graph is captured."""
        features = varlen_features(window_size, softcap)
        check_fallback(fallback)
        if grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
            return with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                             features, fallback)
        if compiling() or dispatch_modes() or not all(type(t) is tensor for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)):
            check_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            return op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(is_causal), scale,
                      features.window_left, features.window_right, features.softcap, fallback)
        return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, features,
                       fallback)

    return attention_varlen
