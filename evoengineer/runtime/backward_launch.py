"""The training path of an export: the LSE forward (output and row log-sum-exp) and the backward
(preprocess, dK/dV, dQ) launched on torch's current stream, each prepared once per shape, strides,
dtype, device, mode and features (per thread), as the inference forward is (``launch.py``). A call
with a window, a soft cap or per-batch key ranges and query lengths (``seqlens_k``, ``leftpad_k``,
``seqlens_q``: a padded batch) runs an LSE forward and a backward built with those switches
(``features.select_kernel``); the range tensors' pointers are set per call."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import tensormap
from .arguments import PackedArguments, element_strides, pack_arguments
from .backward_file import RANGE_ARGS, TENSOR_MAP_TENSORS, BackwardKernelSpec
from .checks import DTYPE_NAMES, Coverage, check_grad, check_inputs
from .dispatch import DispatchTable
from .features import PLAIN, CallFeatures, call_features, select_kernel
from .kernel_file import ExportData
from .launch import (ALIGNMENT_ERROR, LOG2E, MAX_GRID_ROWS, MAX_PLANS, Launcher, MapSlot, current_device, encode_maps,
                     raw_stream, repoint)
from .loading import KernelCache, import_cupy

Launch = tuple[int, int, int, int, int, int, int, int]
"""(CUfunction handle, grid x, y, z, block x, y, z, dynamic shared memory)."""
WORKSPACE_ALIGN_FLOATS = 64
"""Each workspace of a backward starts at a multiple of 256 bytes of the call's one buffer."""


@dataclass
class BackwardPlan:
    """What a backward call with one shape, strides, dtype, device and mode runs (``run``)."""

    run: Callable[..., tuple[Any, Any, Any]]
    config: str | None = None
    kernel: BackwardKernelSpec | None = None
    launches: tuple[Launch, ...] = ()
    packed: PackedArguments | None = None
    workspace_floats: int = 0
    keep: tuple[Any, ...] = ()
    """Buffers the launches point into (tensor maps), alive as long as the plan."""
    ranges: bool = False
    """The kernels take per-batch key ranges and query lengths (``RANGE_ARGS``), set per call."""


def set_ranges(packed: PackedArguments | None, seqlens_k: Any, leftpad_k: Any, seqlens_q: Any) -> None:
    """Point a ``seqlens`` kernel's range arguments at this call's tensors (null where not given)."""
    struct = packed.values  # type: ignore[union-attr]
    struct.seqlens_k = 0 if seqlens_k is None else seqlens_k.data_ptr()
    struct.leftpad_k = 0 if leftpad_k is None else leftpad_k.data_ptr()
    struct.seqlens_q = 0 if seqlens_q is None else seqlens_q.data_ptr()


def well_formed(t: Any) -> bool:
    """A tensor the kernels read in place: a contiguous last dimension, 16-byte aligned, strides
    that are multiples of 8 elements."""
    return t.stride(-1) == 1 and not t.data_ptr() & 15 and not any(s % 8 for s in element_strides(t))


def _empty_gradients(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any) -> tuple[Any, Any, Any]:
    """No query rows or no heads: dQ is empty and nothing flows into K and V."""
    return torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _backward_key(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, is_causal: bool, scale: float | None,
                  enable_gqa: bool, deterministic: bool, features: CallFeatures) -> tuple:
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), o.stride(), do.stride(), q.dtype, k.dtype,
            v.dtype, o.dtype, do.dtype, do.shape, o.shape, lse.shape, q.device, k.device, v.device, o.device,
            lse.device, do.device, is_causal, scale, enable_gqa, bool(deterministic), features)


def map_layouts(q: Any, k: Any, v: Any, do: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(shape, strides) of each tensor a backward's maps may name (``TENSOR_MAP_TENSORS``)."""
    return [(tuple(t.shape), tuple(t.stride())) for t in (q, k, v, do)]


def map_pointers(q: Any, k: Any, v: Any, do: Any) -> tuple[int, ...]:
    """The addresses a backward's maps point to in one call, in ``TENSOR_MAP_TENSORS`` order."""
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr())


def make_backward_run(packed: PackedArguments, launches: Sequence[Launch], workspaces: Sequence[tuple[str, int]],
                      total_floats: int, device: int, launch_kernel: Callable[..., Any],
                      maps: Sequence[MapSlot] = ()) -> Callable[..., tuple[Any, Any, Any]]:
    """The per-call work: pointers, dQ, dK, dV and the workspace allocated, the tensor maps (a
    dK/dV kernel that loads by TMA) moved to this call's tensors, the launches queued."""
    struct = packed.values
    params_addr = packed.address
    stream_of, device_now, move_maps, pointers_of = raw_stream, current_device, repoint, map_pointers
    empty_like, empty, f32 = torch.empty_like, torch.empty, torch.float32
    launches = tuple(launches)
    workspaces = tuple(workspaces)

    def run(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any) -> tuple[Any, Any, Any]:
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        struct.Q, struct.K, struct.V, struct.O = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
        struct.dO, struct.LSE = do.data_ptr(), lse.data_ptr()
        struct.dQ, struct.dK, struct.dV = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        ws = empty(total_floats, dtype=f32, device=q.device) if total_floats else None  # noqa: F841 - alive until queued
        if ws is not None:
            base = ws.data_ptr()
            for name, offset in workspaces:
                setattr(struct, name, base + 4 * offset)
        if maps:
            move_maps(maps, pointers_of(q, k, v, do))
        if device_now() == device:
            stream = stream_of(device)
            for f, gx, gy, gz, bx, by, bz, smem in launches:
                launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params_addr, 0)
        else:
            with torch.cuda.device(device):
                stream = stream_of(device)
                for f, gx, gy, gz, bx, by, bz, smem in launches:
                    launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params_addr, 0)
        return dq, dk, dv

    return run


class BackwardLauncher:
    """The LSE forward and the backward of one export (``data.backward`` None: calls that need a
    gradient are refused with one line)."""

    def __init__(self, data: ExportData, forward: Launcher, coverage: Coverage, kernels: KernelCache) -> None:
        self.data, self.forward_launcher, self.coverage, self.kernels = data, forward, coverage, kernels
        self.backward = data.backward
        variants = self.backward.variants if self.backward is not None else {}
        self.table = DispatchTable({variant: chosen.table for variant, chosen in variants.items()})
        self._local = threading.local()

    def plans(self) -> dict[tuple, Any]:
        """This thread's plans (LSE forward and backward), by call key."""
        return self._local.__dict__.setdefault("plans", {})

    def _cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        plans = self.plans()
        plan = plans.get(key)
        if plan is None:
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plan = plans[key] = build()
        return plan

    def choose(self, dtype: str, head_dim: int, causal: bool, batch: int, heads: int, seq_q: int, seq_k: int,
               heads_kv: int | None = None, deterministic: bool = False) -> str:
        """The backward configuration id that serves such a call (the dispatch rule over the
        measured backward cases; ``deterministic``: the variant's deterministic configuration)."""
        variant = (dtype, int(head_dim), bool(causal))
        if self.backward is None or variant not in self.backward.variants:
            check_grad(self.backward, dtype, head_dim, causal, "attention")
        if deterministic:
            return self.backward.variants[variant].deterministic   # type: ignore[union-attr]
        return self.table.choose(dtype, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv)

    # -- the LSE forward ----------------------------------------------------------------------

    def forward_lse(self, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None,
                    enable_gqa: bool, features: CallFeatures = PLAIN, seqlens_k: Any = None, leftpad_k: Any = None,
                    seqlens_q: Any = None) -> tuple[Any, Any]:
        """``(out, lse)``: the attention and each query row's log-sum-exp (fp32, (B, H, S_q); -inf
        for a row that sees no key: its window holds none, its keys' range is empty, it lies at or
        past ``seqlens_q``)."""
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), is_causal, scale, enable_gqa, "lse", features)
        plan = self._cached(key, lambda: self._plan_forward(q, k, v, is_causal, scale, enable_gqa, features))
        if plan is None:
            return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        if plan.ranges:
            set_ranges(plan.packed, seqlens_k, leftpad_k, seqlens_q)
        return plan.run(q, k, v)

    def _plan_forward(self, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool,
                      features: CallFeatures) -> Any:
        check_inputs(self.coverage, q, k, v, is_causal, scale, enable_gqa)
        dtype, head_dim, causal = DTYPE_NAMES[q.dtype], int(q.shape[-1]), bool(is_causal)
        needed = features.needed(causal)
        check_grad(self.backward, dtype, head_dim, causal, "attention", needed)
        batch, heads, seq_q = (int(x) for x in q.shape[:3])
        if seq_q == 0 or batch * heads == 0 or q.is_meta:
            return None   # nothing to run (meta tensors: the outputs' metadata)
        if k.shape[2] == 0:
            raise ValueError("attention: k and v hold no keys (seq_k = 0)")
        if batch * heads > MAX_GRID_ROWS:
            raise ValueError(f"attention: batch * heads = {batch * heads} exceeds the grid's {MAX_GRID_ROWS}; split the batch")
        chosen = self.backward.variants[(dtype, head_dim, causal)]   # type: ignore[union-attr]
        if needed:
            spec = select_kernel(self.backward.forward_kernels, (dtype, head_dim, causal), chosen.forward,   # type: ignore[union-attr]
                                 chosen.forward, needed)
        else:
            spec = self.backward.forward_kernels[(dtype, head_dim, causal, chosen.forward)]   # type: ignore[union-attr]
        return self.forward_launcher.plan_kernel(spec, q, k, v, scale, lse=True, features=features)

    # -- the backward -----------------------------------------------------------------------------

    def run_backward(self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, is_causal: bool, scale: float | None,
                     enable_gqa: bool, deterministic: bool, features: CallFeatures = PLAIN, seqlens_k: Any = None,
                     leftpad_k: Any = None, seqlens_q: Any = None) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` for the output gradient ``do`` of ``out, lse = forward_lse(q, k, v, ...)``
        (with the same ``features`` and range tensors); dK and dV summed over each group of query
        heads (grouped-query attention); keys outside a batch's range get zero dK and dV, rows that
        see no key zero dQ."""
        if not do.is_meta and not well_formed(do):
            do = do.contiguous()
        key = _backward_key(q, k, v, o, lse, do, is_causal, scale, enable_gqa, deterministic, features)
        plan = self._cached(key, lambda: self._plan_backward(do, q, k, v, o, lse, is_causal, scale, deterministic,
                                                             features))
        if plan.ranges:
            set_ranges(plan.packed, seqlens_k, leftpad_k, seqlens_q)
        return plan.run(q, k, v, o, lse, do)

    def _kernel(self, dtype: str, head_dim: int, causal: bool, cid: str, deterministic: bool,
                needed: tuple[str, ...]) -> BackwardKernelSpec:
        """The backward kernel that serves a call of configuration ``cid``: its own, or for a call with
        features (``needed``) one built with them: ``cid``'s, the variant's fallback's, else another
        (``deterministic``: a deterministic one; else one with atomic dQ where there is one)."""
        data = self.backward
        assert data is not None
        if not needed:
            return data.kernels[(dtype, head_dim, causal, cid)]
        check_grad(data, dtype, head_dim, causal, "attention", needed, deterministic)
        variant = (dtype, head_dim, causal)
        for exact in ((True,) if deterministic else (False, True)):
            kernels = {key: spec for key, spec in data.kernels.items() if spec.deterministic == exact}
            if any(key[:3] == variant and set(needed) <= set(spec.features) for key, spec in kernels.items()):
                break
        return select_kernel(kernels, variant, cid, data.variants[variant].table.fallback, needed)

    def _plan_backward(self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, is_causal: bool, scale: float | None,
                       deterministic: bool, features: CallFeatures = PLAIN) -> BackwardPlan:
        devices = {t.device for t in (q, k, v, o, lse, do)}
        if len(devices) != 1:
            raise ValueError(f"attention: backward inputs must be on one device, got {', '.join(sorted(map(str, devices)))}")
        if do.shape != q.shape or o.shape != q.shape or do.dtype != q.dtype or o.dtype != q.dtype:
            raise ValueError(f"attention: the output gradient must have the output's shape and dtype, got "
                             f"{tuple(do.shape)} {do.dtype} for {tuple(q.shape)} {q.dtype}")
        batch, heads, seq_q, head_dim = (int(x) for x in q.shape)
        heads_kv, seq_k = int(k.shape[1]), int(k.shape[2])
        if tuple(lse.shape) != (batch, heads, seq_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"attention: lse must be a contiguous float32 tensor of shape {(batch, heads, seq_q)}")
        dtype, causal, device = DTYPE_NAMES[q.dtype], bool(is_causal), q.get_device()
        cid = self.choose(dtype, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv, deterministic)
        spec = self._kernel(dtype, head_dim, causal, cid, deterministic, features.needed(causal))
        if seq_q == 0 or batch * heads == 0 or q.is_meta:
            return BackwardPlan(_empty_gradients, spec.config)
        grads = [torch.empty_like(t, device="meta") for t in (q, k, v)]
        tensors = dict(zip(("q", "k", "v", "o", "do", "dq", "dk", "dv"), (q, k, v, o, do, *grads)))
        strides = {name: element_strides(t) for name, t in tensors.items()}
        if any(s % 8 for group in strides.values() for s in group) or any(
                t.stride(-1) != 1 for t in tensors.values()) or any(t.data_ptr() & 15 for t in (q, k, v, o, do)):
            raise ValueError(ALIGNMENT_ERROR)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        values: dict[str, int | float] = {"B": batch, "H": heads, "H_kv": heads_kv, "S_q": seq_q, "S_k": seq_k,
                                          "scale": scale, "scale_log2": scale * LOG2E, **features.values()}
        for name, (sb, sh, ss) in strides.items():
            values.update({f"{name}_sb": sb, f"{name}_sh": sh, f"{name}_ss": ss})
        pointer_names = [name for name, kind in spec.args if kind == "ptr"]
        values.update({name: 0 for name in pointer_names})
        rows = batch * heads * seq_q
        offsets, total = [], 0
        for name, per_row in spec.workspaces:
            offsets.append((name, total))
            total += -(-rows * per_row // WORKSPACE_ALIGN_FLOATS) * WORKSPACE_ALIGN_FLOATS
        maps, map_at, keep = self._encode_maps(spec, q, k, v, do)
        functions = self.kernels.functions(spec.key, device, spec)
        packed = pack_arguments(spec.args, values, map_at)
        launches = tuple((handle, *launch.grid(batch, heads, heads_kv, seq_q, seq_k), *launch.block, launch.smem)
                         for (_, handle), launch in zip(functions, spec.launches))
        cupy = import_cupy()
        if current_device() == device:
            cupy.cuda.runtime.setDevice(device)  # binds the device's context to this thread for the driver-API launch
        run = make_backward_run(packed, launches, offsets, total, device, cupy.cuda.driver.launchKernel, maps)
        return BackwardPlan(run, spec.config, spec, launches, packed, total, keep,
                            ranges=all(name in pointer_names for name in RANGE_ARGS))

    @staticmethod
    def _encode_maps(spec: BackwardKernelSpec, q: Any, k: Any, v: Any, do: Any
                     ) -> tuple[tuple[MapSlot, ...], dict[str, int], tuple[Any, ...]]:
        """Encode the tensor maps of a backward whose dK/dV kernel loads by TMA over these tensors."""
        if not spec.tensor_maps:
            return (), {}, ()
        try:
            return encode_maps(spec.tensor_maps, TENSOR_MAP_TENSORS, map_layouts(q, k, v, do),
                               map_pointers(q, k, v, do), spec.dtype)
        except tensormap.TensorMapError as exc:
            raise ValueError(f"attention: {exc}") from None

    def explain(self, q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False, deterministic: bool = False, *, window_size: Any = None,
                softcap: float | None = None, seqlens_k: Any = None, leftpad_k: Any = None,
                seqlens_q: Any = None) -> dict[str, Any]:
        """What the backward of such a call runs: its configuration, features and launches (the
        plan is built and its kernels compiled if needed)."""
        features = call_features(window_size, softcap, seqlens_k, leftpad_k, seqlens_q)
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        do = o if well_formed(o) else o.contiguous()
        key = _backward_key(q, k, v, o, lse, do, is_causal, scale, enable_gqa, deterministic, features)
        plan = self._cached(key, lambda: self._plan_backward(do, q, k, v, o, lse, is_causal, scale, deterministic,
                                                             features))
        if plan.kernel is None or plan.config is None:
            return {"config": plan.config, "launches": [], "workspace_bytes": 0}
        info = self.backward.configs[plan.config]   # type: ignore[union-attr]
        return {"config": plan.config, "short": info.short, "params": info.params, "kernel": plan.kernel.key,
                "deterministic": plan.kernel.deterministic, "features": list(plan.kernel.features),
                "launches": [{"kernel": spec.kernel, "grid": l[1:4], "block": l[4:7], "smem": l[7]}
                             for spec, l in zip(plan.kernel.launches, plan.launches)],
                "workspace_bytes": 4 * plan.workspace_floats}
