"""The torch custom ops of an export and ``attention``, the function a user calls.

Four ops in the export's namespace, each with a fake implementation (so torch.compile traces
them and FakeTensorMode runs them without a GPU):

- ``attention(q, k, v, is_causal, scale, enable_gqa, deterministic) -> out``: inference; no LSE is
  written. Its registered backward recomputes the LSE (one LSE forward) for callers that hold
  the op itself;
- ``attention_lse(..., window_left, window_right, softcap, seqlens_k, leftpad_k, seqlens_q) -> (out,
  lse)``: the forward a gradient needs (the row log-sum-exp beside the output), with
  ``torch.library.register_autograd``: it saves q, k, v, out, lse and the range tensors only; a
  window, a soft cap or per-batch key ranges and query lengths (a padded batch) run kernels built
  with them;
- ``attention_backward(do, q, k, v, out, lse, ..., window_left, window_right, softcap, seqlens_k,
  leftpad_k, seqlens_q) -> (dq, dk, dv)``, whose own backward (a double backward) is refused in one line;
- ``attention_features(q, k, v, ..., window_left, window_right, softcap, seqlens_k, leftpad_k,
  seqlens_q, fallback) -> out``: a call with features or a fallback, for inference (``attention`` sends the
  calls with features that need a gradient to ``attention_lse``).

``attention(...)`` takes the eager fast path for plain tensors that need no gradient, the
``attention_lse`` op where one is needed (grad mode on and q, k or v requiring grad), and the
inference op for everything else (torch.compile, tensor subclasses, dispatch modes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .checks import DTYPE_NAMES, Coverage, check_grad, check_inputs
from .features import PLAIN, CallFeatures, check_ranges

SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
          "bool deterministic=False) -> Tensor")
LSE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
              "bool deterministic=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
              "Tensor? seqlens_k=None, Tensor? leftpad_k=None, Tensor? seqlens_q=None) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool is_causal, float? scale, "
                   "bool enable_gqa, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0, "
                   "Tensor? seqlens_k=None, Tensor? leftpad_k=None, Tensor? seqlens_q=None) -> (Tensor, Tensor, Tensor)")
NO_GRADS = (None,) * 10
"""``attention_lse``'s gradients of its arguments after q, k and v (none)."""
DOUBLE_BACKWARD_ERROR = ("attention: double backward (a gradient of the attention's gradients, e.g. create_graph=True) "
                         "is not supported by the exported kernels")

Forward = Callable[[Any, Any, Any, bool, "float | None", bool], Any]


@dataclass
class Settings:
    """Module-level switches of an export."""

    deterministic: bool = False
    """Run the deterministic backward (dQ without atomics, bit-identical run to run) for every
    call that does not pass ``deterministic=``; ``torch.use_deterministic_algorithms(True)`` asks
    for it too."""


@dataclass
class Ops:
    """The three ops of an export (``OpOverload``s)."""

    attention: Any
    attention_lse: Any
    attention_backward: Any


def register_ops(namespace: str, forward: Forward, forward_lse: Callable[..., Any], backward: Callable[..., Any],
                 coverage: Coverage, grad_check: Callable[..., None]) -> Ops:
    """The export's ops, registered on first use of the namespace (a second copy of the same export
    shares them). ``forward_lse(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k,
    seqlens_q)`` and ``backward(..., deterministic, features, seqlens_k, leftpad_k, seqlens_q)`` take the
    call's ``features.CallFeatures`` and range tensors (None: none);
    ``grad_check(q, is_causal, needed=(), deterministic=False)`` raises unless a backward covers
    such a call (metadata only, so it also runs on fake tensors)."""
    ns = getattr(torch.ops, namespace)
    if not hasattr(ns, "attention"):
        _define(namespace, forward, forward_lse, backward, coverage, grad_check)
    return Ops(ns.attention.default, ns.attention_lse.default, ns.attention_backward.default)


def _define(namespace: str, forward: Forward, forward_lse: Callable[..., Any], backward: Callable[..., Any],
            coverage: Coverage, grad_check: Callable[..., None]) -> None:
    def impl(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             deterministic: bool = False) -> Any:
        return forward(q, k, v, is_causal, scale, enable_gqa)

    def fake(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             deterministic: bool = False) -> Any:
        check_inputs(coverage, q, k, v, is_causal, scale, enable_gqa)
        return torch.empty_like(q)

    def lse_impl(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                 seqlens_k: Any = None, leftpad_k: Any = None, seqlens_q: Any = None) -> tuple[Any, Any]:
        features = op_features(q, window_left, window_right, softcap, seqlens_k, leftpad_k, seqlens_q)
        out, lse = forward_lse(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, seqlens_q)
        return out, lse

    def lse_fake(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                 seqlens_k: Any = None, leftpad_k: Any = None, seqlens_q: Any = None) -> tuple[Any, Any]:
        check_inputs(coverage, q, k, v, is_causal, scale, enable_gqa)
        features = op_features(q, window_left, window_right, softcap, seqlens_k, leftpad_k, seqlens_q)
        grad_check(q, is_causal, features.needed(bool(is_causal)), deterministic)
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward_impl(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, is_causal: bool, scale: float | None,
                      enable_gqa: bool, deterministic: bool, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, seqlens_k: Any = None, leftpad_k: Any = None,
                      seqlens_q: Any = None) -> tuple[Any, Any, Any]:
        features = op_features(q, window_left, window_right, softcap, seqlens_k, leftpad_k, seqlens_q)
        return backward(grad_out, q, k, v, out, lse, is_causal, scale, enable_gqa, deterministic, features, seqlens_k,
                        leftpad_k, seqlens_q)

    def backward_fake(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, is_causal: bool, scale: float | None,
                      enable_gqa: bool, deterministic: bool, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, seqlens_k: Any = None, leftpad_k: Any = None,
                      seqlens_q: Any = None) -> tuple[Any, Any, Any]:
        devices = {t.device for t in (grad_out, q, k, v, out, lse)}
        if len(devices) != 1:
            raise ValueError(f"attention: backward inputs must be on one device, got {', '.join(sorted(map(str, devices)))}")
        features = op_features(q, window_left, window_right, softcap, seqlens_k, leftpad_k, seqlens_q)
        grad_check(q, is_causal, features.needed(bool(is_causal)), deterministic)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    lib = f"{namespace}::"
    inference = torch.library.custom_op(lib + "attention", impl, mutates_args=(), schema=SCHEMA)
    inference.register_fake(fake)
    with_lse = torch.library.custom_op(lib + "attention_lse", lse_impl, mutates_args=(), schema=LSE_SCHEMA)
    with_lse.register_fake(lse_fake)
    gradients = torch.library.custom_op(lib + "attention_backward", backward_impl, mutates_args=(), schema=BACKWARD_SCHEMA)
    gradients.register_fake(backward_fake)
    ns = getattr(torch.ops, namespace)
    lse_op, backward_op = ns.attention_lse.default, ns.attention_backward.default

    def lse_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        out, lse = output
        ctx.mark_non_differentiable(lse)
        (q, k, v, is_causal, scale, enable_gqa, deterministic, window_left, window_right, softcap, seqlens_k, leftpad_k,
         seqlens_q) = inputs
        ctx.save_for_backward(q, k, v, out, lse, seqlens_k, leftpad_k, seqlens_q)
        ctx.is_causal, ctx.scale, ctx.enable_gqa, ctx.deterministic = is_causal, scale, enable_gqa, deterministic
        ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap

    def lse_backward(ctx: Any, grad_out: Any, grad_lse: Any) -> tuple:
        q, k, v, out, lse, seqlens_k, leftpad_k, seqlens_q = ctx.saved_tensors
        if grad_out is None:
            return (None, None, None, *NO_GRADS)
        dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale, ctx.enable_gqa, ctx.deterministic,
                                 ctx.window_left, ctx.window_right, ctx.softcap, seqlens_k, leftpad_k, seqlens_q)
        return (dq, dk, dv, *NO_GRADS)

    def inference_setup(ctx: Any, inputs: tuple, output: Any) -> None:
        q, k, v, is_causal, scale, enable_gqa, deterministic = inputs
        grad_check(q, is_causal)
        ctx.save_for_backward(q, k, v)
        ctx.is_causal, ctx.scale, ctx.enable_gqa, ctx.deterministic = is_causal, scale, enable_gqa, deterministic

    def inference_backward(ctx: Any, grad_out: Any) -> tuple:
        """The inference op kept no LSE: one LSE forward recomputes it (and the output it goes with)."""
        q, k, v = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None
        out, lse = lse_op(q, k, v, ctx.is_causal, ctx.scale, ctx.enable_gqa, ctx.deterministic)
        dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale, ctx.enable_gqa, ctx.deterministic)
        return dq, dk, dv, None, None, None, None

    def refuse_double_backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)

    def backward_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    with_lse.register_autograd(lse_backward, setup_context=lse_setup)
    inference.register_autograd(inference_backward, setup_context=inference_setup)
    gradients.register_autograd(refuse_double_backward, setup_context=backward_setup)


def op_features(q: Any, window_left: int, window_right: int, softcap: float, seqlens_k: Any, leftpad_k: Any,
                seqlens_q: Any) -> CallFeatures:
    """The ``CallFeatures`` of an ``attention_lse`` or ``attention_backward`` call (as ``call_features``
    makes them); its range tensors checked (ValueError, one line), metadata only."""
    ranges = seqlens_k is not None or leftpad_k is not None or seqlens_q is not None
    if ranges:
        check_ranges(q, seqlens_k, leftpad_k, seqlens_q)
    return CallFeatures(window_left, window_right, softcap, ranges, padded=seqlens_q is not None)


def make_attention(forward: Forward, ops: Ops, train: Callable[..., Any]) -> Callable[..., Any]:
    """``attention(q, k, v, is_causal=False, scale=None, enable_gqa=False, deterministic=None)`` of one
    export; a call whose inputs require grad is ``train``'s (``make_training``)."""
    compiling = torch.compiler.is_compiling
    tensor = torch.Tensor
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
    grad_enabled = torch.is_grad_enabled
    op = ops.attention

    def attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False, deterministic: bool | None = None) -> Any:
        """softmax(q k^T * scale) v as torch.nn.functional.scaled_dot_product_attention computes it
        (is_causal: top-left aligned; scale: default 1/sqrt(head_dim); enable_gqa: k, v may have
        fewer heads). q: (batch, heads, seq_q, head_dim), k and v: (batch, heads_kv, seq_k,
        head_dim), CUDA tensors of one dtype with a contiguous last dimension. Returns a new
        tensor shaped like q. Differentiable: where q, k or v requires grad, the forward keeps
        the row log-sum-exp and ``backward()`` runs the exported backward kernels;
        ``deterministic=True`` (default: the module's ``set_deterministic``, or
        ``torch.use_deterministic_algorithms``) picks a backward whose gradients are
        bit-identical run to run."""
        plain = type(q) is tensor and type(k) is tensor and type(v) is tensor
        if plain and not (grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            if not compiling() and not dispatch_modes():
                return forward(q, k, v, is_causal, scale, enable_gqa)
            return op(q, k, v, is_causal, scale, enable_gqa)
        if grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
            return train(q, k, v, is_causal, scale, enable_gqa, deterministic)
        return op(q, k, v, is_causal, scale, enable_gqa)

    return attention


def grad_checker(backward: Any) -> Callable[..., None]:
    """``grad_check(q, is_causal, needed=(), deterministic=False)`` for ``register_ops`` over an
    export's backward section (``needed``: the switches a call's features need)."""
    def grad_check(q: Any, is_causal: bool, needed: tuple[str, ...] = (), deterministic: bool = False) -> None:
        check_grad(backward, DTYPE_NAMES.get(q.dtype, str(q.dtype)), int(q.shape[-1]), bool(is_causal), "attention",
                   needed, deterministic)

    return grad_check


def make_training(ops: Ops, settings: Settings) -> Callable[..., Any]:
    """``train(q, k, v, is_causal, scale, enable_gqa, deterministic, features=PLAIN, seqlens_k=None,
    leftpad_k=None, seqlens_q=None) -> out``: a call whose inputs require grad, through
    ``attention_lse`` (its backward runs the backward kernels, those built with the call's window,
    soft cap or per-batch key ranges where it has them); eager and under torch.compile alike.
    ``deterministic`` None: the module's setting, or torch's."""
    lse_op = ops.attention_lse
    torch_deterministic = torch.are_deterministic_algorithms_enabled

    def train(q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool,
              deterministic: bool | None, features: CallFeatures = PLAIN, seqlens_k: Any = None,
              leftpad_k: Any = None, seqlens_q: Any = None) -> Any:
        if deterministic is None:
            deterministic = settings.deterministic or torch_deterministic()
        if seqlens_k is None and leftpad_k is None and seqlens_q is None:
            return lse_op(q, k, v, is_causal, scale, enable_gqa, bool(deterministic), features.window_left,
                          features.window_right, features.softcap)[0]
        return lse_op(q, k, v, is_causal, scale, enable_gqa, bool(deterministic), features.window_left,
                      features.window_right, features.softcap, seqlens_k, leftpad_k, seqlens_q)[0]

    return train


# -- calls with features (window, soft cap, per-batch key ranges) or a fallback -------------------

FEATURES_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
                   "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? seqlens_k=None, "
                   "Tensor? leftpad_k=None, Tensor? seqlens_q=None, str? fallback=None) -> Tensor")

FeatureForward = Callable[..., Any]
"""``(q, k, v, is_causal, scale, enable_gqa, features.CallFeatures, seqlens_k, leftpad_k, seqlens_q, fallback)``."""


def register_features_op(namespace: str, forward: FeatureForward, coverage: Coverage) -> Any:
    """``torch.ops.<namespace>.attention_features.default``: ``attention`` with a window, a soft
    cap, per-batch key ranges or a fallback, through the dispatcher."""
    from .features import Uncovered, call_features, check_fallback, check_ranges

    def impl(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             window_left: int = -1, window_right: int = -1, softcap: float = 0.0, seqlens_k: Any = None,
             leftpad_k: Any = None, seqlens_q: Any = None, fallback: str | None = None) -> Any:
        features = call_features((window_left, window_right), softcap, seqlens_k, leftpad_k, seqlens_q)
        return forward(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, seqlens_q, fallback)

    def fake(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             window_left: int = -1, window_right: int = -1, softcap: float = 0.0, seqlens_k: Any = None,
             leftpad_k: Any = None, seqlens_q: Any = None, fallback: str | None = None) -> Any:
        call_features((window_left, window_right), softcap, seqlens_k, leftpad_k, seqlens_q)
        check_fallback(fallback)
        check_ranges(q, seqlens_k, leftpad_k, seqlens_q)
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


def make_feature_attention(plain: Callable[..., Any], forward: FeatureForward, op: Any,
                           with_grad: Callable[..., Any], train: Callable[..., Any]) -> Callable[..., Any]:
    """``attention`` with the keywords of features and fallback; a call without them is ``plain``'s,
    a call with them whose inputs require grad is ``with_grad(plain, train, ...)``'s
    (``Launcher.features_with_grad``; ``train``: ``make_training``'s)."""
    from .features import call_features, check_fallback

    compiling = torch.compiler.is_compiling
    grad_enabled = torch.is_grad_enabled
    tensor = torch.Tensor
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

    def attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                  deterministic: bool | None = None, *, window_size: Any = None, softcap: float | None = None,
                  seqlens_k: Any = None, leftpad_k: Any = None, seqlens_q: Any = None,
                  fallback: str | None = None) -> Any:
        """softmax(q k^T * scale) v as torch.nn.functional.scaled_dot_product_attention computes it
        (is_causal: top-left aligned; scale: default 1/sqrt(head_dim); enable_gqa: k, v may have
        fewer heads). q: (batch, heads, seq_q, head_dim), k and v: (batch, heads_kv, seq_k,
        head_dim), CUDA tensors of one dtype with a contiguous last dimension. Returns a new
        tensor shaped like q. Differentiable: where q, k or v requires grad, the forward keeps
        the row log-sum-exp and ``backward()`` runs the exported backward kernels;
        ``deterministic=True`` (default: the module's ``set_deterministic``, or
        ``torch.use_deterministic_algorithms``) picks a backward whose gradients are
        bit-identical run to run.

        window_size=(left, right): query position i sees keys i - left .. i + right (-1:
        unlimited; with is_causal right is 0; aligned top-left as is_causal). softcap: scores
        become softcap * tanh(score * scale / softcap) before the softmax. seqlens_k, leftpad_k:
        int32 (batch,) tensors, batch b sees keys leftpad_k[b] .. seqlens_k[b] - 1 (padding);
        seqlens_q: int32 (batch,), batch b's query positions from seqlens_q[b] on see no key (a
        padded batch's padding rows: their work is skipped); a query that sees no key gives 0. fallback='sdpa': a call no exported kernel covers runs
        SDPA (with the features as an explicit mask), counted per reason in fallback_counts();
        None (default): such a call raises ValueError. Gradients: where q, k or v requires grad, a
        call with window_size, softcap, seqlens_k, leftpad_k or seqlens_q (a padded batch trains)
        runs the forward and backward kernels built with them (eager and under torch.compile; a
        query that sees no key gets zero gradients, a masked key zero dK and dV); a call whose
        export has no such backward kernels raises NotImplementedError in one line, or with
        fallback='sdpa' runs SDPA (differentiable, counted)."""
        if (window_size is None and softcap is None and seqlens_k is None and leftpad_k is None and seqlens_q is None
                and fallback is None):
            return plain(q, k, v, is_causal, scale, enable_gqa, deterministic)
        features = call_features(window_size, softcap, seqlens_k, leftpad_k, seqlens_q)
        check_fallback(fallback)
        if grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
            return with_grad(plain, train, q, k, v, is_causal, scale, enable_gqa, deterministic, features, seqlens_k,
                             leftpad_k, seqlens_q, fallback)
        if compiling() or type(q) is not tensor or type(k) is not tensor or type(v) is not tensor or dispatch_modes():
            return op(q, k, v, is_causal, scale, enable_gqa, features.window_left, features.window_right,
                      features.softcap, seqlens_k, leftpad_k, seqlens_q, fallback)
        return forward(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, seqlens_q, fallback)

    return attention
