"""Load a compiled attention kernel through CuPy and launch it on torch tensors.

No copies: the kernel reads the tensors' memory through their data pointers and
strides, on torch's current stream. Only this module and ``evaluate.py`` touch
the GPU. A kernel that loads by TMA (``// TENSOR_MAP`` lines) also takes tensor maps of
its tensors, encoded per call (``tensormap.py``), and is launched through the driver
(``cuLaunchKernel`` with a packed argument block); the others through CuPy.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from ..kernels import Rendered
from ..kernels.render import FEATURE_ARGS
from ..runtime.grid import call_splits, runs
from ..runtime.loading import resident_ctas
from .tensormap import MapStorage, TensorMapError, check_address, driver, map_geometry, pack_arguments

LOG2E = 1.4426950408889634
_SMEM_DEFAULT_LIMIT = 48 * 1024


class LaunchError(RuntimeError):
    """The tensors do not fit the kernel (dtype, device, layout, alignment)."""


@dataclass(frozen=True)
class Packed:
    """Packed variable-length sequences of a launch (``runtime.varlen``'s layout): int32 offsets
    (batch + 1) on the tensors' device and the longest query and key counts."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1


@dataclass
class AttentionKernel:
    """A rendered + compiled kernel, loaded into the current CUDA context."""

    rendered: Rendered
    cubin_path: str

    def __post_init__(self) -> None:
        import cupy

        self._module = cupy.RawModule(path=self.cubin_path)
        self._functions = []
        for launch in self.rendered.launches:
            fn = self._module.get_function(launch.kernel)
            if launch.smem > _SMEM_DEFAULT_LIMIT:
                fn.max_dynamic_shared_size_bytes = launch.smem
            self._functions.append(fn)
        self._workspace: Any = None
        self._maps = MapStorage(len(self.rendered.tensor_maps)) if self.rendered.tensor_maps else None
        self._slots: dict[Any, int] = {}

    def splits(self, q: Any, k: Any, packed: Packed | None = None) -> int:
        """The K/V split count of a call on these tensors: ``runtime.grid.call_splits`` on whole
        waves of this kernel's resident CTAs on q's device (what an export runs for the same shape);
        1 for a kernel without a per-call split."""
        auto = next(((fn, launch) for fn, launch in zip(self._functions, self.rendered.launches)
                     if launch.auto_split is not None), None)
        if auto is None:
            return 1
        slots = self._slots.get(q.device)
        if slots is None:
            import cupy

            fn, launch = auto
            with cupy.cuda.Device(q.get_device()):
                slots = self._slots[q.device] = multiprocessors(q.device) * resident_ctas(
                    int(fn.kernel.ptr), launch.threads, launch.smem)
        batch, heads, heads_kv, seq_q, seq_k = dimensions(q, k, packed)
        return call_splits(self.rendered.launches, batch, heads, heads_kv, seq_q, seq_k, slots)

    def check(self, q: Any, k: Any, v: Any, out: Any) -> None:
        """Raise LaunchError unless the tensors fit this kernel: q and out (B, H, S_q, D), k and v
        (B, H_kv, S_k, D) with H_kv dividing H, all of the variant's dtype."""
        variant = self.rendered.variant
        want = torch_dtype(variant.dtype)
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.dtype != want:
                raise LaunchError(f"{name}: expected {str(want).replace('torch.', '')}, got {t.dtype}")
            if not t.is_cuda:
                raise LaunchError(f"{name}: expected a CUDA tensor, got device {t.device}")
            if t.dim() != 4:
                raise LaunchError(f"{name}: expected (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
            if t.shape[-1] != variant.head_dim:
                raise LaunchError(f"{name}: kernel was built for head_dim {variant.head_dim}, got {t.shape[-1]}")
            if t.stride(-1) != 1:
                raise LaunchError(f"{name}: the last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")
            if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
                raise LaunchError(f"{name}: needs a 16-byte aligned base and strides that are multiples of 8 elements")
        if (q.shape[0] != k.shape[0] or k.shape[1] < 1 or q.shape[1] % k.shape[1] or k.shape != v.shape
                or out.shape != q.shape):
            raise LaunchError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)} "
                              "(k and v: the batch of q and a number of heads that divides q's)")
        if len({t.device for t in (q, k, v, out)}) != 1:
            raise LaunchError("q, k, v and out must be on one device")
        tensors = {"q": q, "k": k, "v": v, "out": out}
        for spec in self.rendered.tensor_maps:
            t = tensors[spec.tensor]
            try:
                map_geometry(spec, t.shape, t.stride(), variant.dtype)
            except TensorMapError as exc:
                raise LaunchError(str(exc)) from None

    def check_packed(self, q: Any, k: Any, v: Any, out: Any, packed: Packed) -> None:
        """Raise LaunchError unless the kernel takes packed sequences and the tensors fit it: q and
        out (total_q, H, D), k and v (total_k, H_kv, D), offsets int32 (batch + 1) on their device."""
        from ..runtime.varlen import packed_strides, packed_view

        variant = self.rendered.variant
        if "varlen" not in self.rendered.features:
            raise LaunchError("the kernel takes no packed sequences (rendered without VARLEN)")
        want = torch_dtype(variant.dtype)
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.dtype != want or not t.is_cuda or t.dim() != 3 or t.shape[-1] != variant.head_dim or t.stride(-1) != 1:
                raise LaunchError(f"{name}: expected a contiguous-row CUDA {str(want).replace('torch.', '')} tensor "
                                  f"(tokens, heads, {variant.head_dim}), got {t.dtype} {tuple(t.shape)}")
            if t.data_ptr() % 16 or any(x % 8 for x in packed_strides(t)):
                raise LaunchError(f"{name}: needs a 16-byte aligned base and strides that are multiples of 8 elements")
        if k.shape != v.shape or out.shape != q.shape or q.shape[1] % k.shape[1]:
            raise LaunchError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                              f"out {tuple(out.shape)}")
        for name, t in (("cu_seqlens_q", packed.cu_seqlens_q), ("cu_seqlens_k", packed.cu_seqlens_k)):
            if str(t.dtype) != "torch.int32" or t.dim() != 1 or t.shape[0] != packed.batch + 1 or t.device != q.device:
                raise LaunchError(f"{name}: expected int32 ({packed.batch + 1},) on {q.device}, got {t.dtype} "
                                  f"{tuple(t.shape)} on {t.device}")
        views = dict(zip(("q", "k", "v", "out"), map(packed_view, (q, k, v, out))))
        for spec in self.rendered.tensor_maps:   # TMA: maps over every token as one batch
            t = views[spec.tensor]
            try:
                map_geometry(spec, t.shape, t.stride(), variant.dtype)
            except TensorMapError as exc:
                raise LaunchError(str(exc)) from None

    def __call__(self, q: Any, k: Any, v: Any, out: Any, scale: float | None = None, *, checked: bool = True,
                 workspace: Any = None, features: dict[str, Any] | None = None, packed: Packed | None = None) -> Any:
        """Run attention(q, k, v) into ``out`` on torch's current stream; returns ``out``.
        k and v may have fewer heads than q (grouped-query attention, as SDPA's ``enable_gqa``).
        ``workspace``: a caller's float32 CUDA tensor of at least the declared workspace, passed as
        ``WS`` instead of the kernel's own (a ``WRITE_LSE`` forward leaves the row log-sum-exp there).
        ``features``: values of the arguments of a kernel with compile-time features (``softcap``,
        ``window_left``, ``window_right``, tensors ``seqlens_k``, ``leftpad_k``, ``seqlens_q``; a ``varlen``
        kernel's ``cu_seqlens_q``, ``cu_seqlens_k`` are null, the dense layout, unless ``packed``);
        left out: off. ``packed``: q, k, v and out are packed sequences (tokens, heads, head_dim),
        launched as ``runtime.varlen`` launches them (batch strides 0, S_q and S_k the longest)."""
        import cupy
        import torch

        if checked:
            self.check(q, k, v, out) if packed is None else self.check_packed(q, k, v, out, packed)
        batch, heads, heads_kv, seq_q, seq_k = dimensions(q, k, packed)
        head_dim = q.shape[-1]
        if packed is None:
            strides = [t.stride()[:3] for t in (q, k, v, out)]
        else:
            from ..runtime.varlen import packed_strides

            strides = [packed_strides(t) for t in (q, k, v, out)]
            features = {**(features or {}), "cu_seqlens_q": packed.cu_seqlens_q, "cu_seqlens_k": packed.cu_seqlens_k}
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        splits = self.splits(q, k, packed)
        ws_floats = self.rendered.workspace_floats(batch, heads, seq_q, splits)
        ws_ptr = 0
        if workspace is not None:
            if (workspace.dtype != torch.float32 or workspace.device != q.device or not workspace.is_contiguous()
                    or workspace.numel() < ws_floats):
                raise LaunchError(f"workspace: expected a contiguous float32 tensor on {q.device} of at least {ws_floats} elements")
            ws_ptr = workspace.data_ptr()
        elif ws_floats:
            if self._workspace is None or self._workspace.numel() < ws_floats or self._workspace.device != q.device:
                self._workspace = torch.empty(ws_floats, dtype=torch.float32, device=q.device)
            ws_ptr = self._workspace.data_ptr()
        counter = None
        if self.rendered.tile_counter:  # zeroed on this stream before the launch, freed after it in stream order
            launch = next(launch for launch in self.rendered.launches if launch.tile_counter)
            words, zeroed = launch.counter_words(batch, heads, seq_q, multiprocessors(q.device))
            if words == zeroed:
                counter = torch.zeros(words, dtype=torch.int32, device=q.device)
            else:  # the cut tiles' partials need no zeroing
                counter = torch.empty(words, dtype=torch.int32, device=q.device)
                counter[:zeroed].zero_()
            ws_ptr = counter.data_ptr()
        extra = feature_values(features)
        if self._maps is not None:
            values = {**argument_values(q, k, v, out, ws_ptr, scale * LOG2E, (batch, heads, heads_kv, seq_q, seq_k),
                                        strides), **extra, "kv_splits": splits}
            map_tensors = (q, k, v, out)
            if packed is not None:   # the maps over every token as one batch
                from ..runtime.varlen import packed_view

                map_tensors = tuple(packed_view(t) for t in (q, k, v, out))
            self._launch_with_maps(*map_tensors, values, splits, (batch, heads, heads_kv, seq_q))
            del counter  # the launch is queued: the counter's memory may go back to torch's allocator
            return out
        args = (
            cupy.uint64(q.data_ptr()), cupy.uint64(k.data_ptr()), cupy.uint64(v.data_ptr()), cupy.uint64(out.data_ptr()),
            cupy.uint64(ws_ptr),
            cupy.int32(batch), cupy.int32(heads), cupy.int32(heads_kv), cupy.int32(seq_q), cupy.int32(seq_k),
            *(cupy.int64(s) for group in strides for s in group),
            cupy.float32(scale * LOG2E),
            *({"ptr": cupy.uint64, "i32": cupy.int32, "f32": cupy.float32}[kind](extra[name])
              for feature in self.rendered.features for name, kind in FEATURE_ARGS[feature]),
            *((cupy.int32(splits),) if self.rendered.auto_split else ()),
        )
        with cupy_stream(torch.cuda.current_stream(q.device)):
            for launch, fn in zip(self.rendered.launches, self._functions):
                if not runs(launch, splits):
                    continue
                grid = launch.grid(batch, heads, seq_q, multiprocessors(q.device), heads_kv=heads_kv, splits=splits)
                fn(grid, launch.block, args, shared_mem=launch.smem)
        return out

    def _launch_with_maps(self, q: Any, k: Any, v: Any, out: Any, values: dict, splits: int = 1,
                          grid_dims: tuple[int, int, int, int] | None = None) -> Any:
        """Encode the tensor maps of this call's tensors (for packed sequences: their one-batch
        views) and launch through the driver; ``grid_dims``: (B, H, H_kv, S_q) of the grid, where
        the tensors' own shapes do not give them."""
        import cupy
        import torch

        assert self._maps is not None
        tensors = {"q": q, "k": k, "v": v, "out": out}
        dtype = self.rendered.variant.dtype
        addresses = {}
        try:
            for spec, at in zip(self.rendered.tensor_maps, self._maps.addresses):
                t = tensors[spec.tensor]
                check_address(spec, t.data_ptr())
                driver().encode(at, map_geometry(spec, t.shape, t.stride(), dtype), t.data_ptr())
                addresses[spec.arg] = at
        except TensorMapError as exc:
            raise LaunchError(str(exc)) from None
        packed = pack_arguments(self.rendered.arguments, values, addresses)
        batch, heads, heads_kv, seq_q = grid_dims or (q.shape[0], q.shape[1], k.shape[1], q.shape[2])
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with cupy.cuda.Device(q.get_device()):
            for launch, fn in zip(self.rendered.launches, self._functions):
                if not runs(launch, splits):
                    continue
                grid = launch.grid(batch, heads, seq_q, multiprocessors(q.device), heads_kv=heads_kv, splits=splits)
                cupy.cuda.driver.launchKernel(fn.kernel.ptr, *grid, *launch.block, launch.smem,
                                              stream, packed.address, 0)
        return out


def dimensions(q: Any, k: Any, packed: Packed | None = None) -> tuple[int, int, int, int, int]:
    """(B, H, H_kv, S_q, S_k) a launch passes: q's and k's (batch, heads, seq), or for packed
    sequences their count and the longest lengths."""
    if packed is None:
        return int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), int(k.shape[2])
    return packed.batch, int(q.shape[1]), int(k.shape[1]), int(packed.max_seqlen_q), int(packed.max_seqlen_k)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: Any) -> int:
    """The multiprocessor count of a torch device (a persistent kernel's grid)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def argument_values(q: Any, k: Any, v: Any, out: Any, ws_ptr: int, scale_log2: float,
                    dims: Sequence[int] | None = None, strides: Sequence[Sequence[int]] | None = None
                    ) -> dict[str, int | float]:
    """The common kernel arguments (``KERNEL_ARGS``) of one call, by name: (B, H, H_kv, S_q, S_k)
    ``dims`` and the (batch, head, row) ``strides`` of q, k, v and out, by default the tensors' own
    (packed sequences pass ``dimensions`` and ``runtime.varlen.packed_strides``)."""
    dims = dims or dimensions(q, k)
    strides = strides or [t.stride()[:3] for t in (q, k, v, out)]
    values: dict[str, int | float] = {
        "Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(), "O": out.data_ptr(), "WS": ws_ptr,
        **dict(zip(("B", "H", "H_kv", "S_q", "S_k"), dims)), "scale_log2": scale_log2,
    }
    for name, group in zip("qkvo", strides):
        values.update(zip((f"{name}_sb", f"{name}_sh", f"{name}_ss"), group))
    return values


def feature_values(features: dict[str, Any] | None) -> dict[str, int | float]:
    """The feature arguments of a call by name (tensors as their data pointers), off where left out."""
    given = dict(features or {})
    values: dict[str, int | float] = {"softcap": 0.0, "window_left": -1, "window_right": -1, "seqlens_k": 0, "leftpad_k": 0,
                                      "seqlens_q": 0, "cu_seqlens_q": 0, "cu_seqlens_k": 0}
    for name, value in given.items():
        if name not in values:
            raise LaunchError(f"unknown feature argument {name!r}")
        values[name] = 0 if value is None else value.data_ptr() if hasattr(value, "data_ptr") else value
    return values


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of a space dtype (``fp16``, ``bf16``)."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def cupy_stream(torch_stream: Any) -> Any:
    """CuPy's view of a torch stream (launches go where torch's work goes)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream in favour of from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream)
