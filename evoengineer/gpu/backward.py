"""Attention backward on torch tensors: a forward that keeps the row log-sum-exp, and the
FlashAttention-2 backward (``templates/flash_attention_bwd.cu.j2``) that takes it.

``attention_forward_lse(q, k, v)`` returns ``(o, lse)``; ``attention_backward(q, k, v, o, lse, do)``
returns ``(dq, dk, dv)``; both take a call's ``features`` (``runtime.features.CallFeatures``: a
window, a soft cap) and per-batch ranges (``seqlens_k``, ``leftpad_k``, ``seqlens_q``: int32 (batch,)
tensors), run by kernels built with those switches. Tensors are (batch, heads, seq, head_dim), fp16 or bf16, K/V with a
number of heads that divides q's (grouped-query attention); ``lse`` is (batch, heads, seq_q)
fp32. Kernels are rendered, compiled with NVRTC for the tensors' device and loaded once per
(configuration, variant, device). Launches go on torch's current stream; a backward whose dK/dV
kernel loads by TMA (``// TENSOR_MAP`` lines) gets its tensor maps encoded per call and every
kernel is launched through the driver with one packed argument block (the maps after the
backward's arguments: the kernels without maps read only theirs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..kernels import Rendered, compile_source, render
from ..kernels.compile import arch_for_device
from ..kernels.backward_rules import (
    BACKWARD_TEMPLATE,
    FORWARD_TEMPLATE,
    BackwardLaunch,
    backward_arguments,
    backward_launch_arguments,
    backward_launches,
    default_config,
    forward_lse_config,
    problems,
)
from ..runtime.backward_file import TENSOR_MAP_TENSORS
from ..runtime.backward_launch import map_layouts, map_pointers
from ..runtime.features import PLAIN, CallFeatures
from ..runtime.loading import required_arch
from ..space import Config, Variant
from .launch import LOG2E, AttentionKernel, LaunchError, cupy_stream, feature_values, torch_dtype
from .tensormap import MapStorage, TensorMapError, check_address, driver, map_geometry, pack_arguments

_SMEM_DEFAULT_LIMIT = 48 * 1024


class BackwardBuildError(RuntimeError):
    """A backward (or LSE forward) configuration did not render or compile."""


def _check_tensor(name: str, t: Any, dtype: Any, head_dim: int) -> None:
    if t.dtype != dtype:
        raise LaunchError(f"{name}: expected {str(dtype).replace('torch.', '')}, got {t.dtype}")
    if not t.is_cuda:
        raise LaunchError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if t.dim() != 4 or t.shape[-1] != head_dim:
        raise LaunchError(f"{name}: expected (batch, heads, seq, {head_dim}), got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
        raise LaunchError(f"{name}: needs a contiguous last dimension, a 16-byte aligned base and strides that are multiples of 8")


@dataclass
class BackwardKernel:
    """A rendered + compiled backward, loaded into the current CUDA context."""

    rendered: Rendered
    cubin_path: str

    def __post_init__(self) -> None:
        import cupy

        self._module = cupy.RawModule(path=self.cubin_path)
        self.launches: list[BackwardLaunch] = backward_launches(self.rendered)
        self.arguments = backward_arguments(self.rendered)
        self._maps = MapStorage(len(self.rendered.tensor_maps)) if self.rendered.tensor_maps else None
        self._functions = []
        for launch in self.launches:
            fn = self._module.get_function(launch.kernel)
            if launch.smem > _SMEM_DEFAULT_LIMIT:
                fn.max_dynamic_shared_size_bytes = launch.smem
            self._functions.append(fn)

    @property
    def atomic_dq(self) -> bool:
        return any(launch.kernel == "attn_bwd_dq_convert" for launch in self.launches)

    def check(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, dq: Any, dk: Any, dv: Any) -> None:
        """Raise LaunchError unless the tensors fit this kernel."""
        import torch

        variant = self.rendered.variant
        want = torch_dtype(variant.dtype)
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk), ("dv", dv)):
            _check_tensor(name, t, want, variant.head_dim)
        if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]
                or o.shape != q.shape or do.shape != q.shape or dq.shape != q.shape or dk.shape != k.shape or dv.shape != k.shape):
            raise LaunchError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                              f"o {tuple(o.shape)}, do {tuple(do.shape)} (k and v: q's batch, heads dividing q's)")
        if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:3]) or not lse.is_contiguous():
            raise LaunchError(f"lse: expected a contiguous float32 tensor of shape {tuple(q.shape[:3])}, "
                              f"got {lse.dtype} {tuple(lse.shape)}")
        if len({t.device for t in (q, k, v, o, lse, do, dq, dk, dv)}) != 1:
            raise LaunchError("all tensors must be on one device")
        layouts = map_layouts(q, k, v, do)
        for spec in self.rendered.tensor_maps:
            shape, strides = layouts[TENSOR_MAP_TENSORS.index(spec.tensor)]
            try:
                map_geometry(spec, shape, strides, variant.dtype)
            except TensorMapError as exc:
                raise LaunchError(str(exc)) from None

    def __call__(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, scale: float | None = None, *,
                 dq: Any = None, dk: Any = None, dv: Any = None, dsum: Any = None, dq_accum: Any = None,
                 checked: bool = True, features: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
        """Gradients of attention(q, k, v) for the output gradient ``do``, given the forward's ``o`` and
        ``lse``; returns ``(dq, dk, dv)`` (into the given tensors where given). ``dsum`` (B*H*S_q floats)
        and ``dq_accum`` (B*H*S_q*D floats, atomic dQ only) are workspaces, allocated when not given;
        the kernels never read what they held before. ``features``: values of a feature kernel's
        arguments (``softcap``, ``window_left``, ``window_right``; left out: off)."""
        import cupy
        import torch

        batch, heads, seq_q, head_dim = q.shape
        heads_kv, seq_k = k.shape[1], k.shape[2]
        dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
        dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
        dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
        if checked:
            self.check(q, k, v, o, lse, do, dq, dk, dv)
        rows = batch * heads * seq_q
        dsum = _workspace(dsum, rows, q.device, "dsum")
        dq_accum = _workspace(dq_accum, rows * head_dim, q.device, "dq_accum") if self.atomic_dq else None
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        values: dict[str, int | float] = {
            "Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(), "O": o.data_ptr(), "dO": do.data_ptr(),
            "LSE": lse.data_ptr(), "Dsum": dsum.data_ptr(), "dQacc": dq_accum.data_ptr() if dq_accum is not None else 0,
            "dQ": dq.data_ptr(), "dK": dk.data_ptr(), "dV": dv.data_ptr(),
            "B": batch, "H": heads, "H_kv": heads_kv, "S_q": seq_q, "S_k": seq_k,
            "scale": scale, "scale_log2": scale * LOG2E, **feature_values(features),
        }
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk), ("dv", dv)):
            values.update({f"{name}_sb": t.stride(0), f"{name}_sh": t.stride(1), f"{name}_ss": t.stride(2)})
        if self._maps is not None:
            self._launch_with_maps(q, k, v, do, lse, dsum, values)
            return dq, dk, dv
        packers = {"ptr": cupy.uint64, "i32": cupy.int32, "i64": cupy.int64, "f32": cupy.float32}
        args = tuple(packers[kind](values[name]) for name, kind in self.arguments)
        with cupy_stream(torch.cuda.current_stream(q.device)):
            for launch, fn in zip(self.launches, self._functions):
                grid = launch.grid(batch, heads, heads_kv, seq_q, seq_k)
                fn(grid, launch.block, args, shared_mem=launch.smem)
        return dq, dk, dv


    def _launch_with_maps(self, q: Any, k: Any, v: Any, do: Any, lse: Any, dsum: Any, values: dict) -> None:
        """Encode this call's tensor maps and launch every kernel through the driver with one
        argument block (``backward_launch_arguments``)."""
        import cupy
        import torch

        assert self._maps is not None
        dtype = self.rendered.variant.dtype
        layouts = map_layouts(q, k, v, do)
        pointers = map_pointers(q, k, v, do)
        addresses = {}
        try:
            for spec, at in zip(self.rendered.tensor_maps, self._maps.addresses):
                slot = TENSOR_MAP_TENSORS.index(spec.tensor)
                check_address(spec, pointers[slot])
                shape, strides = layouts[slot]
                driver().encode(at, map_geometry(spec, shape, strides, dtype), pointers[slot])
                addresses[spec.arg] = at
        except TensorMapError as exc:
            raise LaunchError(str(exc)) from None
        packed = pack_arguments(backward_launch_arguments(self.rendered), values, addresses)
        batch, heads, seq_q = q.shape[0], q.shape[1], q.shape[2]
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with cupy.cuda.Device(q.get_device()):
            for launch, fn in zip(self.launches, self._functions):
                grid = launch.grid(batch, heads, k.shape[1], seq_q, k.shape[2])
                cupy.cuda.driver.launchKernel(fn.kernel.ptr, *grid, *launch.block, launch.smem, stream, packed.address, 0)


def _workspace(given: Any, floats: int, device: Any, name: str) -> Any:
    import torch

    if given is None:
        return torch.empty(max(floats, 1), dtype=torch.float32, device=device)
    if given.dtype != torch.float32 or given.device != device or not given.is_contiguous() or given.numel() < floats:
        raise LaunchError(f"{name}: expected a contiguous float32 tensor on {device} of at least {floats} elements")
    return given


def device_arch(device: Any) -> str:
    """``sm_90`` for an H100: the arch NVRTC compiles for on ``device``."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


_LOADED: dict[tuple[str, int], Any] = {}
"""Loaded kernels by (source hash, device index)."""
_BY_CONFIG: dict[tuple[str, Config, Variant, int], Any] = {}
"""The same kernels by (template, configuration, variant, device index): no render per call."""


def _build(template: str, config: Config, variant: Variant, device: Any) -> tuple[Rendered, str]:
    """Render and compile for ``device``'s arch: (rendered, cubin path); BackwardBuildError otherwise."""
    try:
        rendered = render(template, config, variant)
    except ValueError as exc:
        raise BackwardBuildError(f"{template} {config.label()} {variant.label()}: {exc}") from None
    arch = device_arch(device)
    required = required_arch(rendered.source)   # wgmma: sm_90a, on an sm_90 device only
    if required is not None:
        arch = arch_for_device(arch, required)
        if arch != required:
            raise BackwardBuildError(f"{template} {config.label()} {variant.label()}: needs {required}, the device is {arch}")
    result = compile_source(rendered.source, arch)
    if not result.ok or result.cubin_path is None:
        raise BackwardBuildError(f"{template} {config.label()} {variant.label()} ({arch}): {result.error}")
    return rendered, result.cubin_path


def _device_index(device: Any) -> int:
    import torch

    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def load_backward(config: Config, variant: Variant, device: Any) -> BackwardKernel:
    """The backward of ``config`` for ``variant`` on ``device`` (built and loaded once)."""
    import torch

    fast = (BACKWARD_TEMPLATE, config, variant, _device_index(device))
    if fast in _BY_CONFIG:
        return _BY_CONFIG[fast]
    if errors := problems(config, variant.head_dim):
        raise BackwardBuildError(f"{config.label()}: {'; '.join(errors)}")
    rendered, cubin = _build(BACKWARD_TEMPLATE, config, variant, device)
    key = (rendered.source_hash, _device_index(device))
    if key not in _LOADED:
        with torch.cuda.device(device):
            _LOADED[key] = BackwardKernel(rendered, cubin)
    _BY_CONFIG[fast] = _LOADED[key]
    return _LOADED[key]


def load_forward_lse(config: Config, variant: Variant, device: Any, *, write_lse: bool = True) -> AttentionKernel:
    """The ``WRITE_LSE=1`` forward of ``config`` for ``variant`` on ``device`` (built and loaded once);
    ``write_lse=False``: the same configuration's inference kernel (``WRITE_LSE=0``), to compare."""
    import torch

    config = config.replace(WRITE_LSE=int(write_lse))
    fast = (FORWARD_TEMPLATE, config, variant, _device_index(device))
    if fast in _BY_CONFIG:
        return _BY_CONFIG[fast]
    rendered, cubin = _build(FORWARD_TEMPLATE, config, variant, device)
    key = (rendered.source_hash, _device_index(device))
    if key not in _LOADED:
        with torch.cuda.device(device):
            _LOADED[key] = AttentionKernel(rendered, cubin)
    _BY_CONFIG[fast] = _LOADED[key]
    return _LOADED[key]


def _variant(q: Any, causal: bool, features: CallFeatures = PLAIN) -> Variant:
    """The call's variant, with the switches its features need (``CallFeatures.needed``)."""
    import torch

    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(q.dtype)
    if dtype is None:
        raise LaunchError(f"q: expected float16 or bfloat16, got {q.dtype}")
    return Variant(head_dim=int(q.shape[-1]), causal=bool(causal), dtype=dtype, features=features.needed(bool(causal)))


def _feature_arguments(features: CallFeatures, variant: Variant, ranges: dict[str, Any] | None = None) -> dict[str, Any]:
    """The feature arguments of a kernel built for ``variant`` (its switches'), from the call's values
    and range tensors (``ranges``: seqlens_k, leftpad_k, seqlens_q; None: null)."""
    names = {"softcap": ("softcap",), "window": ("window_left", "window_right"),
             "seqlens": ("seqlens_k", "leftpad_k", "seqlens_q")}
    values = {**features.values(), "seqlens_k": None, "leftpad_k": None, "seqlens_q": None, **(ranges or {})}
    return {name: values[name] for switch in variant.features for name in names.get(switch, ())}


def _with_ranges(features: CallFeatures, ranges: dict[str, Any]) -> CallFeatures:
    """``features`` with ``seqlens`` on where a range tensor is given."""
    from dataclasses import replace

    given = any(t is not None for t in ranges.values())
    return replace(features, seqlens=True, padded=ranges.get("seqlens_q") is not None) if given else features


def attention_forward_lse(q: Any, k: Any, v: Any, scale: float | None = None, causal: bool = False,
                          config: Config | None = None, *, out: Any = None, lse: Any = None,
                          features: CallFeatures = PLAIN, seqlens_k: Any = None, leftpad_k: Any = None,
                          seqlens_q: Any = None) -> tuple[Any, Any]:
    """attention(q, k, v) and its row log-sum-exp: ``(o, lse)``, lse (B, H, S_q) fp32 natural log of
    sum_k exp(scale * q.k) (causal: top-left aligned, as SDPA's ``is_causal``); with ``features``
    (a window, a soft cap) and per-batch ranges of the capped scores the window and ranges keep,
    -inf for a row that sees no key."""
    import torch

    ranges = {"seqlens_k": seqlens_k, "leftpad_k": leftpad_k, "seqlens_q": seqlens_q}
    features = _with_ranges(features, ranges)
    variant = _variant(q, causal, features)
    kernel = load_forward_lse(config or forward_lse_config(variant.head_dim), variant, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if lse is None else lse
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:3]) or not lse.is_contiguous():
        raise LaunchError(f"lse: expected a contiguous float32 tensor of shape {tuple(q.shape[:3])}")
    kernel(q, k, v, out, scale, workspace=lse, features=_feature_arguments(features, variant, ranges))
    return out, lse


def attention_backward(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, scale: float | None = None,
                       causal: bool = False, config: Config | None = None, *, deterministic: bool = False,
                       features: CallFeatures = PLAIN, seqlens_k: Any = None, leftpad_k: Any = None,
                       seqlens_q: Any = None, **buffers: Any) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of attention(q, k, v) for output gradient ``do``; ``o`` and ``lse`` from
    ``attention_forward_lse`` with the same ``scale``, ``causal``, ``features`` and ranges. Without ``config``,
    the head dim's default (``deterministic``: one whose dQ pass uses no atomics). ``buffers``: optional
    ``dq``, ``dk``, ``dv`` outputs and ``dsum``, ``dq_accum`` workspaces (see ``BackwardKernel.__call__``)."""
    ranges = {"seqlens_k": seqlens_k, "leftpad_k": leftpad_k, "seqlens_q": seqlens_q}
    features = _with_ranges(features, ranges)
    variant = _variant(q, causal, features)
    if config is None:
        config = default_config(variant.head_dim, deterministic_dq=deterministic)
    kernel = load_backward(config, variant, q.device)
    return kernel(q, k, v, o, lse, do, scale, features=_feature_arguments(features, variant, ranges), **buffers)


# ---- references and the gradient rule (tests, the check script and, later, the gate) ----------

def sdpa_gradients(q: Any, k: Any, v: Any, do: Any, causal: bool, scale: float | None,
                   dtype: Any = None) -> tuple[Any, Any, Any, Any]:
    """``(o, dq, dk, dv)`` by autograd of SDPA's math backend on q, k, v, do cast to ``dtype`` (their
    own when None), reductions in that dtype too (``allow_fp16_bf16_reduction_math_sdp``): fp32 gives
    the reference, the inputs' dtype the low-precision baseline of flash-attn's error rule."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = dtype or q.dtype
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            dq, dk, dv = torch.autograd.grad(o, (qr, kr, vr), do.to(dtype))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    return o.detach(), dq, dk, dv


def reference_gradients(q: Any, k: Any, v: Any, do: Any, causal: bool, scale: float | None,
                        features: CallFeatures = PLAIN, dtype: Any = None, *, seqlens_k: Any = None,
                        leftpad_k: Any = None, seqlens_q: Any = None) -> tuple[Any, Any, Any, Any]:
    """``(o, dq, dk, dv)`` by autograd of attention with ``features`` written out in ``dtype`` (the
    inputs' own when None): s = q k^T * scale, s = softcap * tanh(s / softcap), the window, causal
    and per-batch range mask (``features.allowed_keys``), softmax, times v; a row that sees no key
    gives 0 and no gradient. fp32 gives the reference, the inputs' dtype the low-precision baseline
    of the rule."""
    import torch

    from ..runtime.features import allowed_keys, repeat_kv

    dtype = dtype or q.dtype
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask = allowed_keys(q.shape[0], q.shape[2], k.shape[2], bool(causal), features, seqlens_k, leftpad_k, q.device,
                        seqlens_q=seqlens_q)
    seen = mask.any(dim=-1, keepdim=True)
    scores = torch.matmul(qr, repeat_kv(kr, q.shape[1]).transpose(-1, -2)) * scale
    if features.softcap > 0:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0)   # a row that sees nothing: finite
    p = torch.softmax(scores, dim=-1) * seen
    o = torch.matmul(p, repeat_kv(vr, q.shape[1]))
    dq, dk, dv = torch.autograd.grad(o, (qr, kr, vr), do.to(dtype))
    return o.detach(), dq, dk, dv


def reference_lse(q: Any, k: Any, causal: bool, scale: float | None) -> Any:
    """Row log-sum-exp of the scaled scores in fp32, (B, H, S_q); causal is top-left aligned."""
    import torch

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kr = k.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kr.transpose(-1, -2)) * scale
    if causal:
        s_q, s_k = q.shape[2], k.shape[2]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


@dataclass(frozen=True)
class RuleCheck:
    """flash-attn's rule for one tensor: ``err <= 2 * lowp_err + eps``."""

    name: str
    err: float
    lowp_err: float
    eps: float

    @property
    def bound(self) -> float:
        return 2.0 * self.lowp_err + self.eps

    @property
    def ok(self) -> bool:
        return self.err <= self.bound   # NaN fails

    def __str__(self) -> str:
        return f"{self.name}: max err {self.err:.3g} vs bound {self.bound:.3g} (2 x lowp {self.lowp_err:.3g} + eps {self.eps:.3g})"


RULE_EPS_REL = 1e-3
RULE_EPS_ABS = 1e-5
"""eps of the rule: 1e-3 of the fp32 reference's largest magnitude, plus 1e-5."""


def rule_check(name: str, ours: Any, ref32: Any, lowp: Any) -> RuleCheck:
    """``max|ours - ref32| <= 2 max|lowp - ref32| + eps``, eps = 1e-3 max|ref32| + 1e-5; any NaN or
    infinity in ``ours`` fails."""
    import torch

    if ours.numel() == 0:
        return RuleCheck(name, 0.0, 0.0, RULE_EPS_ABS)
    ref = ref32.float()
    err = (ours.float() - ref).abs().max().item() if bool(torch.isfinite(ours).all()) else float("nan")
    lowp_err = (lowp.float() - ref).abs().max().item()
    eps = RULE_EPS_REL * ref.abs().max().item() + RULE_EPS_ABS
    return RuleCheck(name, err, lowp_err, eps)
