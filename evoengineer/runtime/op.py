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
