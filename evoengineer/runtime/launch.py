"""Launch: a call's plan (dispatch, kernels, grids, packed arguments, tensor maps), built once
per shape, strides, dtype and device, and the per-call work (pointers, output, launches with
``cupy.cuda.driver.launchKernel`` on torch's current stream)."""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import tensormap
from .arguments import PackedArguments, element_strides, pack_arguments, scalar_values
from .checks import DTYPE_NAMES, Coverage, check_inputs
from .dispatch import DispatchTable
from .features import POINTER_ARGS as RANGE_POINTERS
from .features import PLAIN, CallFeatures, FallbackCounts, Uncovered, check_ranges, reference_attention, select_kernel
from .grid import call_splits, counter_words, grid, runs, workspace_floats
from .kernel_file import ExportData, KernelSpec
from .loading import KernelCache, import_cupy, resident_ctas

LOG2E = 1.4426950408889634
MAX_GRID_ROWS = 65535
MAX_PLANS = 512
"""Plans kept per thread; past this many shapes the cache starts over."""
ALIGNMENT_ERROR = ("attention: q, k and v need 16-byte aligned data pointers (a view that starts mid-row "
                   "is not); pass .contiguous() copies")

@functools.lru_cache(maxsize=None)
def multiprocessors(device: int) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# torch's current stream as a raw handle and the current device, without Stream objects (the
# calls torch's compiled code makes); the public API where a torch build lacks them
raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


# -- tensor maps ----------------------------------------------------------------------------------

MapSlot = tuple[int, int, list]
"""(index of the tensor in the launch's pointers ((q, k, v, out) for a forward), address of its
encoded map, [the pointer it holds])."""
FORWARD_SLOTS = ("q", "k", "v", "out")
"""The tensors a forward's maps may name, in the order of its call's pointers."""


def encode_maps(tensor_maps: Sequence[Any], slots: Sequence[str], layouts: Sequence[tuple[Sequence[int], Sequence[int]]],
                pointers: Sequence[int], dtype: str) -> tuple[tuple[MapSlot, ...], dict[str, int], tuple[Any, ...]]:
    """Encode ``tensor_maps`` (each naming one of ``slots``) over tensors of these (shape, strides),
    one per slot, at these pointers: the slots re-pointed per call (``repoint``), each map's
    address by argument name (``pack_arguments``) and the storage to keep alive.
    ``tensormap.TensorMapError`` for a tensor the map cannot describe."""
    if not tensor_maps:
        return (), {}, ()
    storage = tensormap.MapStorage(len(tensor_maps))
    driver = tensormap.driver()
    maps: tuple[MapSlot, ...] = ()
    map_at: dict[str, int] = {}
    for m, at in zip(tensor_maps, storage.addresses):
        slot = list(slots).index(m.tensor)
        shape, strides = layouts[slot]
        driver.encode(at, tensormap.map_geometry(m, shape, strides, dtype), pointers[slot])
        maps += ((slot, at, [pointers[slot]]),)
        map_at[m.arg] = at
    return maps, map_at, (storage,)


def repoint(maps: Sequence[MapSlot], pointers: Sequence[int]) -> None:
    """Point each map at this call's tensor where it moved."""
    driver = tensormap.driver()
    for slot, at, last in maps:
        pointer = pointers[slot]
        if pointer != last[0]:
            driver.replace_address(at, pointer)
            last[0] = pointer


# -- the per-call work ----------------------------------------------------------------------------

Launch = tuple[int, int, int, int, int, int, int, int]
"""(CUfunction handle, grid x, y, z, block x, y, z, dynamic shared memory)."""


def make_run(packed: PackedArguments, launches: Sequence[Launch], ws_floats: int, device: int,
             launch_kernel: Callable[..., Any], maps: Sequence[MapSlot] = (), counter: tuple[int, int] | None = None,
             lse_shape: tuple[int, ...] | None = None) -> Callable[[Any, Any, Any], Any]:
    """The per-call work: pointers, the output, tensor maps moved to this call's tensors, the
    launches on torch's current stream. A kernel whose CTAs take work tiles from a counter gets a
    zeroed one per call (one memset on the same stream); ``counter`` is (words, zeroed words) of
    its workspace. ``lse_shape``: an LSE forward, whose workspace is the row log-sum-exp it
    returns beside the output as ``(out, lse)``, lse of that shape."""
    struct = packed.values
    params_addr = packed.address
    stream_of, device_now, move_maps = raw_stream, current_device, repoint
    empty_like, empty, zeros, f32, i32 = torch.empty_like, torch.empty, torch.zeros, torch.float32, torch.int32
    launches = tuple(launches)

    def run(q: Any, k: Any, v: Any) -> Any:
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) & 15:
            raise ValueError(ALIGNMENT_ERROR)
        out = empty_like(q)
        op = out.data_ptr()
        struct.Q, struct.K, struct.V, struct.O = qp, kp, vp, op
        if maps:
            move_maps(maps, (qp, kp, vp, op))
        if ws_floats:
            ws = empty(ws_floats, dtype=f32, device=q.device)  # noqa: F841 - alive until the launches are queued
            struct.WS = ws.data_ptr()
        elif counter:
            words, zeroed = counter
            if words == zeroed:
                ws = zeros(words, dtype=i32, device=q.device)
            else:  # the cut tiles' partials need no zeroing
                ws = empty(words, dtype=i32, device=q.device)
                ws[:zeroed].zero_()
            struct.WS = ws.data_ptr()
        if device_now() == device:
            stream = stream_of(device)
            for f, gx, gy, gz, bx, by, bz, smem in launches:
                launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params_addr, 0)
        else:
            with torch.cuda.device(device):
                stream = stream_of(device)
                for f, gx, gy, gz, bx, by, bz, smem in launches:
                    launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params_addr, 0)
        if lse_shape is not None:
            return out, ws.view(lse_shape)
        return out

    return run


@dataclass
class Plan:
    """What a call with one shape, strides, dtype and device runs (``run``) and how."""

    run: Callable[[Any, Any, Any], Any]
    config: str | None = None
    kernel: KernelSpec | None = None
    launches: tuple[Launch, ...] = ()
    packed: PackedArguments | None = None
    ws_floats: int = 0
    counter: tuple[int, int] | None = None
    raw_kernels: tuple[Any, ...] = ()
    keep: tuple[Any, ...] = ()
    """Buffers the launches point into (tensor maps), alive as long as the plan."""
    fallback: str | None = None
    """Why no kernel serves such a call, where it runs the fallback instead (``run`` unused)."""
    ranges: bool = False
    """The kernel takes per-batch key ranges and query lengths (``seqlens_k``, ``leftpad_k``,
    ``seqlens_q``), set per call."""
    varlen: bool = False
    """The kernel takes packed sequences' offsets (``cu_seqlens_q``, ``cu_seqlens_k``), set per call."""
    splits: int = 1
    """The K/V split count of a kernel that chooses it per call (``grid.call_splits``), else 1."""


FEATURE_OP_GRAD_ERROR = ("attention: a gradient is needed (q, k or v requires grad) and the attention_features op computes "
                         "none; call the module's attention(...) (a window, a soft cap and per-batch key ranges train "
                         "through the backward kernels), or with fallback='sdpa'")


def _empty_output(q: Any, k: Any, v: Any) -> Any:
    return torch.empty_like(q)


class Launcher:
    """Plans per thread and the forward computation of one export."""

    def __init__(self, data: ExportData, table: DispatchTable, coverage: Coverage, kernels: KernelCache) -> None:
        self.data, self.table, self.coverage, self.kernels = data, table, coverage, kernels
        self._local = threading.local()
        self.forward = self._make_forward()
        self.fallbacks = FallbackCounts()
        self.forward_features = self._make_forward_features()

    def plans(self) -> dict[tuple, Plan]:
        """This thread's plans, by call key."""
        return self._local.__dict__.setdefault("plans", {})

    def _make_forward(self) -> Callable[..., Any]:
        local, build = self._local, self.plan

        def forward(q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool) -> Any:
            key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                   q.get_device(), k.get_device(), v.get_device(), is_causal, scale, enable_gqa)
            try:
                plan = local.plans[key]
            except (AttributeError, KeyError):
                plans = local.__dict__.setdefault("plans", {})
                plan = build(q, k, v, is_causal, scale, enable_gqa)
                if len(plans) >= MAX_PLANS:
                    plans.clear()
                plans[key] = plan
            return plan.run(q, k, v)

        return forward

    def cached_plan(self, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool) -> Plan:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), is_causal, scale, enable_gqa)
        plans = self.plans()
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self.plan(q, k, v, is_causal, scale, enable_gqa)
        return plan

    def plan(self, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool,
             features: CallFeatures = PLAIN) -> Plan:
        """Everything a call with this shape, strides, dtype and device needs, prepared once."""
        check_inputs(self.coverage, q, k, v, is_causal, scale, enable_gqa)
        batch, heads, seq_q, head_dim = (int(x) for x in q.shape)
        heads_kv, seq_k = int(k.shape[1]), int(k.shape[2])
        if seq_q == 0 or batch * heads == 0 or q.is_meta:
            return Plan(_empty_output)   # meta tensors: the output's metadata, nothing to run
        if seq_k == 0:
            raise ValueError("attention: k and v hold no keys (seq_k = 0)")
        if batch * heads > MAX_GRID_ROWS:
            raise ValueError(f"attention: batch * heads = {batch * heads} exceeds the grid's {MAX_GRID_ROWS} (the kernels "
                             "put one (batch, head) per grid row); split the batch")
        dtype, causal = DTYPE_NAMES[q.dtype], bool(is_causal)
        cid = self.table.choose(dtype, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv, padded=features.padded)
        needed = features.needed(causal)
        if needed:  # a kernel built with the call's features (``features.select_kernel``)
            spec = select_kernel(self.data.kernels, (dtype, head_dim, causal), cid,
                                 self.table.variants[(dtype, head_dim, causal)].fallback, needed)
        else:
            spec = self.data.kernels[(dtype, head_dim, causal, cid)]
        return self.plan_kernel(spec, q, k, v, scale, features=features)

    def plan_kernel(self, spec: KernelSpec, q: Any, k: Any, v: Any, scale: float | None, lse: bool = False,
                    features: CallFeatures = PLAIN) -> Plan:
        """The plan of one forward kernel over these (checked, non-empty) tensors; ``lse``: an LSE
        forward, whose run returns ``(out, lse)``; ``features``: the call's window and soft cap
        (a kernel with those switches)."""
        batch, heads, seq_q, head_dim = (int(x) for x in q.shape)
        heads_kv, seq_k = int(k.shape[1]), int(k.shape[2])
        out_meta = torch.empty_like(q, device="meta")
        strides = (element_strides(q), element_strides(k), element_strides(v), element_strides(out_meta))
        if any(s % 8 for group in strides for s in group):
            raise ValueError(f"attention: strides must be multiples of 8 elements (16 bytes), got q {tuple(q.stride())}, "
                             f"k {tuple(k.stride())}, v {tuple(v.stride())}; pass .contiguous() copies")
        maps, map_at, keep = self._encode_maps(spec, q, k, v, out_meta)
        return self.plan_launches(spec, q.get_device(), (batch, heads, heads_kv, seq_q, seq_k, head_dim), strides, scale,
                                  lse, features, maps, map_at, keep)

    def plan_launches(self, spec: KernelSpec, device: int, dims: tuple[int, int, int, int, int, int],
                      strides: tuple[Sequence[int], ...], scale: float | None, lse: bool = False,
                      features: CallFeatures = PLAIN, maps: tuple[MapSlot, ...] = (), map_at: dict[str, int] | None = None,
                      keep: tuple[Any, ...] = ()) -> Plan:
        """The plan of one forward kernel on ``device`` over (batch, heads, heads_kv, seq_q, seq_k,
        head_dim) with (batch, head, row) element strides of q, k, v and out (``plan_kernel``'s
        tensors, or packed sequences' with batch strides 0 and the longest lengths); ``maps``,
        ``map_at``, ``keep``: a TMA kernel's tensor maps (``_encode_maps``)."""
        batch, heads, heads_kv, seq_q, seq_k, head_dim = dims
        cid = spec.config
        functions = self.kernels.functions(spec.key, device, spec)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        values: dict[str, int | float] = {**scalar_values(batch, heads, heads_kv, seq_q, seq_k, *strides, scale * LOG2E),
                                          "Q": 0, "K": 0, "V": 0, "O": 0, "WS": 0,
                                          **features.values(), **{name: 0 for name in RANGE_POINTERS}}
        cupy = import_cupy()
        if current_device() == device:
            cupy.cuda.runtime.setDevice(device)  # binds the device's context to this thread for the driver-API launch
        splits = 1
        auto = next(((handle, launch) for (_, handle), launch in zip(functions, spec.launches)
                     if launch.auto_split is not None), None)
        if auto is not None:  # the K/V split count of this shape: whole waves of resident CTAs
            with cupy.cuda.Device(device):
                slots = multiprocessors(device) * resident_ctas(auto[0], auto[1].threads, auto[1].smem)
            splits = call_splits(spec.launches, batch, heads, heads_kv, seq_q, seq_k, slots)
        values["kv_splits"] = splits
        packed = pack_arguments(spec.args, values, map_at or {})
        sms = multiprocessors(device) if any(l.persistent or l.split_tail for l in spec.launches) else 0
        launches = tuple((handle, *grid(launch, batch, heads, heads_kv, seq_q, sms, splits), *launch.block, launch.smem)
                         for (_, handle), launch in zip(functions, spec.launches) if runs(launch, splits))
        ws_floats = workspace_floats(spec.workspace_floats_per_row, spec.workspace_floats_per_split, batch, heads, seq_q,
                                     splits)
        counter = next((counter_words(launch, batch, heads, seq_q, sms) for launch in spec.launches
                        if launch.tile_counter), None)
        run = make_run(packed, launches, ws_floats, device, cupy.cuda.driver.launchKernel, maps, counter,
                       (batch, heads, seq_q) if lse else None)
        return Plan(run, cid, spec, launches, packed, ws_floats, counter, tuple(fn for fn, _ in functions), keep,
                    ranges=any(name == "seqlens_k" for name, _ in spec.args),
                    varlen=any(name == "cu_seqlens_q" for name, _ in spec.args), splits=splits)

    def _encode_maps(self, spec: KernelSpec, q: Any, k: Any, v: Any, out_meta: Any
                     ) -> tuple[tuple[MapSlot, ...], dict[str, int], tuple[Any, ...]]:
        """Encode the tensor maps of a TMA kernel over these (batch, heads, seq, head_dim) tensors
        (the output's at q's address until the first call re-points it; packed sequences pass
        ``varlen.packed_view``s, which share their tensors' addresses)."""
        if not spec.tensor_maps:
            return (), {}, ()
        pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr())
        if any(p & 15 for p in pointers):
            raise ValueError(ALIGNMENT_ERROR)
        layouts = [(t.shape, t.stride()) for t in (q, k, v, out_meta)]
        try:
            return encode_maps(spec.tensor_maps, FORWARD_SLOTS, layouts, pointers, spec.dtype)
        except tensormap.TensorMapError as exc:
            raise ValueError(f"attention: {exc}") from None

    def explain(self, q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False, *, window_size: Any = None, softcap: float | None = None,
                seqlens_k: Any = None, leftpad_k: Any = None, seqlens_q: Any = None,
                fallback: str | None = None) -> dict[str, Any]:
        """What such a call runs (the plan is built and the kernels compiled if needed); a call
        that would run the fallback says why (``fallback``, ``reason``). ``fallback_counts``: the
        calls that ran SDPA so far, per reason."""
        from .features import call_features, check_fallback

        features = call_features(window_size, softcap, seqlens_k, leftpad_k, seqlens_q)
        if features == PLAIN and check_fallback(fallback) is None:
            plan = self.cached_plan(q, k, v, is_causal, scale, enable_gqa)
        else:
            plan = self.feature_plan(q, k, v, is_causal, scale, enable_gqa, features, fallback)
        counts = self.fallbacks.snapshot()
        if plan.fallback is not None:
            return {"config": None, "launches": [], "workspace_bytes": 0, "fallback": fallback, "reason": plan.fallback,
                    "fallback_counts": counts}
        if plan.config is None or plan.kernel is None or plan.packed is None:
            return {"config": None, "launches": [], "workspace_bytes": 0, "fallback_counts": counts}
        info = self.data.configs[plan.config]
        return {
            "fallback_counts": counts, "features": list(plan.kernel.switches),
            "config": plan.config, "short": info.short, "params": info.params, "kernel": plan.kernel.key,
            "launches": [{"grid": l[1:4], "block": l[4:7], "smem": l[7]} for l in plan.launches],
            "kv_splits": plan.splits,   # the K/V split count (above 1: a combine launch follows)
            # a tile counter: 4 zeroed bytes per call (more where the last tiles are cut over every CTA)
            "workspace_bytes": 4 * (plan.ws_floats or (plan.counter[0] if plan.counter else 0)),
            "handles": [l[0] for l in plan.launches], "params_address": plan.packed.address,
            "raw_kernels": list(plan.raw_kernels),
            "arguments": plan.packed.values,  # the packed ctypes structure (pointers Q, K, V, O, WS set per call)
        }

    # -- calls with features or a fallback ---------------------------------------------------------

    def feature_plan(self, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool,
                     features: CallFeatures, fallback: str | None) -> Plan:
        """This thread's plan of a call with features (a fallback plan where no kernel serves it
        and ``fallback`` is set), built once per key."""
        key = ("features", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, is_causal, scale, enable_gqa, features, fallback)
        plans = self.plans()
        plan = plans.get(key)
        if plan is None:
            try:
                plan = self.plan(q, k, v, is_causal, scale, enable_gqa, features)
            except Uncovered as exc:
                if fallback is None:
                    raise
                plan = Plan(_empty_output, fallback=str(exc).removeprefix("attention: "))
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plans[key] = plan
        return plan

    def _make_forward_features(self) -> Callable[..., Any]:
        grad_enabled, counts = torch.is_grad_enabled, self.fallbacks

        def forward_features(q: Any, k: Any, v: Any, is_causal: bool, scale: float | None, enable_gqa: bool,
                             features: CallFeatures, seqlens_k: Any, leftpad_k: Any, seqlens_q: Any,
                             fallback: str | None) -> Any:
            if features.seqlens:
                check_ranges(q, seqlens_k, leftpad_k, seqlens_q)
            plan = self.feature_plan(q, k, v, is_causal, scale, enable_gqa, features, fallback)
            if plan.fallback is not None:
                counts.add(plan.fallback)
                return reference_attention(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k,
                                           seqlens_q)
            if (q.requires_grad or k.requires_grad or v.requires_grad) and grad_enabled():
                raise NotImplementedError(FEATURE_OP_GRAD_ERROR)
            if plan.ranges:
                struct = plan.packed.values  # type: ignore[union-attr]
                struct.seqlens_k = 0 if seqlens_k is None else seqlens_k.data_ptr()
                struct.leftpad_k = 0 if leftpad_k is None else leftpad_k.data_ptr()
                struct.seqlens_q = 0 if seqlens_q is None else seqlens_q.data_ptr()
            return plan.run(q, k, v)

        return forward_features

    def features_with_grad(self, plain: Callable[..., Any], train: Callable[..., Any], q: Any, k: Any, v: Any,
                           is_causal: bool, scale: float | None, enable_gqa: bool, deterministic: bool | None,
                           features: CallFeatures, seqlens_k: Any, leftpad_k: Any, seqlens_q: Any,
                           fallback: str | None) -> Any:
        """A call with features or a fallback whose inputs require grad: ``plain`` (the training
        path) where it asks no feature, ``train`` (``op.make_training``: the LSE forward and
        the backward built with them) where it asks a window, a soft cap or per-batch key ranges
        and query lengths; SDPA (differentiable, counted) with ``fallback`` where neither has
        kernels for it; otherwise NotImplementedError (or the kernels' error) in one line."""
        if features.seqlens:
            check_ranges(q, seqlens_k, leftpad_k, seqlens_q)
        run = (plain if not features.needed(bool(is_causal))
               else lambda *args: train(*args, features, seqlens_k, leftpad_k, seqlens_q))
        if fallback is None:
            return run(q, k, v, is_causal, scale, enable_gqa, deterministic)
        try:
            return run(q, k, v, is_causal, scale, enable_gqa, deterministic)
        except Uncovered as exc:
            reason = str(exc).removeprefix("attention: ")
        except NotImplementedError as exc:  # no backward for this variant or these features
            reason = str(exc).removeprefix("attention: ").split(";")[0]
        self.fallbacks.add(reason)
        return reference_attention(q, k, v, is_causal, scale, enable_gqa, features, seqlens_k, leftpad_k, seqlens_q)
