"""What a call must satisfy, read from tensor metadata only (so it also runs on fake tensors)."""
from __future__ import annotations

from typing import Any

import torch

from .backward_file import BackwardData
from .dispatch import Variant
from .features import Uncovered, UncoveredDtype

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {t: name for name, t in TORCH_DTYPES.items()}


class Coverage:
    """What an export serves: its dtypes and (dtype, head_dim, causal) variants, and which
    variants take a K/V head count (grouped-query attention without copies)."""

    def __init__(self, dtypes: list[str], variant_gqa: dict[Variant, bool]) -> None:
        self.dtypes = list(dtypes)
        self.variant_gqa = dict(variant_gqa)

    def covered(self) -> str:
        return ", ".join(f"{d} D{h}{' causal' if c else ''}" for d, h, c in sorted(self.variant_gqa))


def check_layout(who: str, q: Any, k: Any, v: Any, scale: float | None) -> None:
    """ValueError (``who: ...``, one line) unless q, k and v have a contiguous last dimension and
    one device, and a scale given is positive."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{who}: {name} needs a contiguous last dimension (stride 1), got strides "
                             f"{tuple(t.stride())}; other strides are fine (or pass {name}.contiguous())")
    if scale is not None and not scale > 0:
        raise ValueError(f"{who}: scale must be positive, got {scale}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_inputs(coverage: Coverage, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None,
                 enable_gqa: bool) -> None:
    """TypeError or ValueError (``attention: ...``, one line) unless the export can serve this call;
    ``features.Uncovered`` where the call is well-formed but no kernel covers it (dtype, head dim,
    GQA, device): what a fallback may serve."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    variant = check_variant(coverage, q, k, v, is_causal, "attention")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(one batch; k and v of one shape)")
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads != heads_kv:
        if not enable_gqa:
            raise ValueError(f"attention: q has {heads} heads and k, v have {heads_kv}; pass enable_gqa=True for "
                             "grouped-query attention (as scaled_dot_product_attention)")
        if heads_kv == 0 or heads % heads_kv:
            raise ValueError(f"attention: q's heads ({heads}) must be a multiple of k and v's heads ({heads_kv})")
        if not coverage.variant_gqa[variant]:
            raise Uncovered(f"attention: k and v have {heads_kv} heads and q {heads}, but this export's kernels take no "
                             f"K/V head count (no grouped-query attention); repeat k and v to {heads} heads "
                             f"(k.repeat_interleave({heads // heads_kv}, dim=1)) or export from templates with GQA support")
    check_layout("attention", q, k, v, scale)
    if q.device.type not in ("cuda", "meta"):  # meta tensors: the outputs' shapes only (fake implementations)
        raise Uncovered(f"attention: q, k and v must be CUDA tensors, got device {q.device}")


def check_variant(coverage: Coverage, q: Any, k: Any, v: Any, is_causal: bool, who: str) -> Variant:
    """The call's (dtype, head_dim, causal) variant; TypeError or ValueError (``<who>: ...``, one line)
    where q, k and v differ in dtype or head dim, ``Uncovered`` where no kernel takes the variant."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{who}: q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    dtype = DTYPE_NAMES.get(q.dtype)
    if dtype not in coverage.dtypes:
        listed = ", ".join(str(TORCH_DTYPES[d]) for d in coverage.dtypes)
        raise UncoveredDtype(f"{who}: dtype {q.dtype} has no exported kernel; this module covers {listed}")
    head_dim = int(q.shape[-1])
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"{who}: q, k and v must have one head_dim, got q {head_dim}, k {k.shape[-1]}, v {v.shape[-1]}")
    variant = (dtype, head_dim, bool(is_causal))
    if variant not in coverage.variant_gqa:
        raise Uncovered(f"{who}: no exported kernel for {dtype} head_dim {head_dim}"
                        f"{' causal' if is_causal else ''}; this module covers {coverage.covered()}")
    return variant


def check_grad(backward: BackwardData | None, dtype: str, head_dim: int, causal: bool, who: str = "attention",
               needed: tuple[str, ...] = (), deterministic: bool = False) -> None:
    """NotImplementedError (one line) unless the export has a backward for (dtype, head_dim, causal)
    and, for a call whose features need the switches ``needed``, kernels built with them (an LSE
    forward and a backward, ``deterministic``: a deterministic one)."""
    label = f"{dtype} head_dim {head_dim}{' causal' if causal else ''}"
    if backward is None:
        raise NotImplementedError(
            f"{who}: a gradient is needed (q, k or v requires grad) but this export has no backward kernels; "
            "re-export with a current `evoengineer export` (it adds them), or call under torch.no_grad() or "
            "torch.inference_mode()")
    if (dtype, int(head_dim), bool(causal)) not in backward.variants:
        raise NotImplementedError(
            f"{who}: a gradient is needed (q, k or v requires grad) but this export has no backward for {label}; "
            f"its backward covers {backward.covered()}; call under torch.no_grad() for inference")
    missing = [f for f in needed if f not in backward.switches((dtype, int(head_dim), bool(causal)), deterministic)]
    if missing:
        raise NotImplementedError(
            f"{who}: a gradient is needed (q, k or v requires grad) but this export's backward for {label} has no "
            f"{' and '.join(missing)}{' (deterministic)' if deterministic else ''}; the backward kernels hold a window, "
            "a soft cap and per-batch key ranges (re-export with a current `evoengineer export`); call under "
            "torch.no_grad(), or with fallback='sdpa' (SDPA computes such calls and their gradients)")
