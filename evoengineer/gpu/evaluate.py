"""Correctness gate and device timing of one candidate: the one place where known
failures become a status.

The parent side (``Evaluator``) never touches the GPU: it sends jobs to a worker
process (``worker.py``) that runs ``handle``. A kernel that crashes, hangs or
poisons its CUDA context costs that worker, which is replaced; the result is a
record with a status from ``STATUSES``, never an exception.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..kernels import Rendered, StaticReport, build_config
from ..space import Case, Config, Space, Variant
from .harness import CaseResult, _KernelFault, _sync, _time_ops, case_seed, check_output

STATUSES = ("ok", "invalid", "compile_failed", "launch_failed", "incorrect", "crashed", "timeout")
SUB_PHASES = {"samples": "timing"}
"""Phases measured inside another (part: whole): ``samples``, the device time of the timing's samples."""
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
BACKWARD_SDPA_BACKENDS = ("flash", "cudnn", "efficient")
"""SDPA's backends whose backward a backward space is compared with (math's fp32-sized score
matrices are left out: tens of GB at the sizes training runs)."""
REFERENCE_CALLS = ("default", "fa4")
"""Timed beside the backends where asked: SDPA with torch's own backend choice (the call a user
makes), and flash-attn-4 (a peer library), when it is installed."""
EDGE_SEQS = ((1, 2, 1), (2, 3, 77), (1, 2, 5), (1, 1, 257))
"""(batch, heads, seq) of the edge shapes every candidate is gated on besides the space's
shapes: one token, S not a multiple of any tile, S smaller than one tile."""
EDGE_GQA = ((1, 4, 1, 1), (2, 8, 2, 77), (1, 4, 1, 257))
"""(batch, heads, K/V heads, seq) of the grouped-query edge shapes, gated on besides
``EDGE_SEQS`` when a variant's shapes include grouped-query attention."""
EDGE_KV = ((2, 3, 1, 77), (1, 2, 1, 257), (1, 2, 5, 300))
"""(batch, heads, seq, K/V length) of the edge shapes gated besides ``EDGE_SEQS`` (whose S = 1
is one query over one key) when a variant's shapes have a K/V length other than their query
length (decode): one query over K/V lengths that are not multiples of any tile, and a few
queries over a longer cache."""
EDGE_GQA_KV = ((2, 8, 2, 1, 77),)
"""(batch, heads, K/V heads, seq, K/V length): grouped-query decode, gated where a variant has both."""
EDGE_LENGTHS = ((2, (1,)), (3, (77, 1, 5, 257)), (2, (130, 64)))
"""(heads, lengths) of the packed edge shapes a variant of packed sequences is gated on instead of
``EDGE_SEQS``: one token, lengths that are not multiples of any tile, a one-token sequence between
longer ones, a whole tile after a partial one."""
EDGE_GQA_LENGTHS = ((8, 2, (77, 1, 130)),)
"""(heads, K/V heads, lengths): packed grouped-query edge shapes, where a variant's shapes have grouped heads."""
HANDLER = "evoengineer.gpu.evaluate:handle"


@dataclass
class EvalResult:
    """One record per candidate."""

    config: dict
    key: str
    status: str
    reason: str = ""
    resources: dict = field(default_factory=dict)
    cases: list[dict] = field(default_factory=list)
    objective_us: float | None = None
    eval_s: float = 0.0
    phases: dict = field(default_factory=dict)
    """Seconds per phase of this evaluation: load, gate, timing, ipc (worker side), and
    strategy, compile, storage (the search loop's)."""
    device: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def gate_cases(space: Space, variant: Variant) -> list[Case]:
    """The space's shapes of this variant plus the edge shapes, grouped-query edge shapes when
    the variant's shapes have fewer K/V heads than query heads, and K/V-length edge shapes when
    they have a K/V length other than the query length (decode); packed and padded edge shapes
    for variants of packed sequences and padded batches."""
    cases = [c for c in space.cases if c.variant == variant]
    gqa = any(c.heads_kv != c.heads for c in cases)
    kv_len = any(c.seq_kv != c.seq for c in cases)
    d, causal, dtype = variant.head_dim, variant.causal, variant.dtype
    # a variant with features: the edge shapes with the first case's soft cap and window
    extra = {"softcap": cases[0].softcap, "window": cases[0].window} if cases and variant.features else {}
    if "varlen" in variant.features:  # packed sequences: packed edge shapes
        cases += [Case(len(n), h, max(n), d, causal, dtype=dtype, lengths=n, **extra) for h, n in EDGE_LENGTHS]
        if gqa:
            cases += [Case(len(n), h, max(n), d, causal, heads_kv=kv, dtype=dtype, lengths=n, **extra)
                      for h, kv, n in EDGE_GQA_LENGTHS]
        return list(dict.fromkeys(cases))
    if "seqlens" in variant.features:  # padded batches: the packed edge lengths, padded past the longest
        cases += [Case(len(n), h, max(n) + 3, d, causal, dtype=dtype, lengths=n, padded=True, **extra)
                  for h, n in EDGE_LENGTHS]
        if gqa:
            cases += [Case(len(n), h, max(n) + 3, d, causal, heads_kv=kv, dtype=dtype, lengths=n, padded=True, **extra)
                      for h, kv, n in EDGE_GQA_LENGTHS]
    cases += [Case(b, h, s, d, causal, dtype=dtype, **extra) for b, h, s in EDGE_SEQS]
    if gqa:
        cases += [Case(b, h, s, d, causal, heads_kv=kv, dtype=dtype, **extra) for b, h, kv, s in EDGE_GQA]
    if kv_len:
        cases += [Case(b, h, s, d, causal, dtype=dtype, seq_kv=skv, **extra) for b, h, s, skv in EDGE_KV]
    if kv_len and gqa:
        cases += [Case(b, h, s, d, causal, heads_kv=kv, dtype=dtype, seq_kv=skv, **extra) for b, h, kv, s, skv in EDGE_GQA_KV]
    return list(dict.fromkeys(cases))


BACKWARD_EDGE_SEQS = ((1, 2, 1, 1), (2, 3, 77, 77), (1, 2, 5, 5), (1, 1, 257, 257), (2, 3, 77, 257), (1, 2, 257, 77))
"""(batch, heads, seq, K/V length) of the edge shapes a backward candidate is gated on: one token,
lengths that are not multiples of any tile, shorter than one tile, seq_q != seq_k both ways."""


def backward_gate_cases(space: Space, variant: Variant) -> list[Case]:
    """The space's shapes of this variant, ``BACKWARD_EDGE_SEQS`` and ``EDGE_GQA`` (grouped heads)."""
    cases = [c for c in space.cases if c.variant == variant]
    d, causal, dtype = variant.head_dim, variant.causal, variant.dtype
    cases += [Case(b, h, s, d, causal, dtype=dtype, seq_kv=skv) for b, h, s, skv in BACKWARD_EDGE_SEQS]
    cases += [Case(b, h, s, d, causal, heads_kv=kv, dtype=dtype) for b, h, kv, s in EDGE_GQA]
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------------------
# Child side: runs in the worker process, touches the GPU.
# ---------------------------------------------------------------------------------

_KERNELS: dict[str, Any] = {}


def handle(job: dict) -> dict:
    """Worker entry point: ``job["kind"]`` is info, gate, time or sdpa.

    Gate and time answers carry ``phases``: seconds spent loading the module (``load``,
    zero once loaded) and in the job itself (``gate`` or ``timing``).
    """
    kind = job["kind"]
    phase = {"gate": "gate", "time": "timing", "bwd_gate": "gate", "bwd_time": "timing"}.get(kind, kind)
    started = time.perf_counter()
    loaded = started
    try:
        if kind == "info":
            return gpu_info()
        if kind == "sdpa":
            return _sdpa_job(job)
        if kind.startswith("bwd_"):
            from .backward_jobs import JOBS

            if kind not in JOBS:
                raise ValueError(f"unknown job kind {kind!r}")
            loaded = time.perf_counter()  # a backward's kernels load inside its job (its gate or timing phase)
            answer = JOBS[kind](job)
        else:
            launcher = _load_kernel(job["rendered"], job["cubin_path"])
            loaded = time.perf_counter()
            if kind == "gate":
                answer = _gate_job(launcher, job)
            elif kind == "time":
                answer = _time_job(launcher, job)
            else:
                raise ValueError(f"unknown job kind {kind!r}")
    except _KernelFault as exc:
        answer = {"status": "launch_failed", "reason": str(exc), "worker_must_restart": True}
    if loaded == started:  # the load itself failed
        loaded = time.perf_counter()
    answer["phases"] = {"load": loaded - started, phase: time.perf_counter() - loaded}
    if "sampled_s" in answer:  # a part of the timing phase: its samples' device time
        answer["phases"]["samples"] = answer.pop("sampled_s")
    return answer


def _load_kernel(rendered: Rendered, cubin_path: str) -> Any:
    from .launch import AttentionKernel

    kernel = _KERNELS.get(cubin_path)
    if kernel is None:
        try:
            kernel = AttentionKernel(rendered, cubin_path)
        except Exception as exc:  # noqa: BLE001 - a module that fails to load is a launch failure
            raise _KernelFault(f"module load failed: {exc}") from exc
        _KERNELS[cubin_path] = kernel
    return kernel


def _random_inputs(case: Case, seed: int) -> tuple[Any, Any, Any]:
    """q (B, H, S, D), k and v (B, H_kv, S_kv, D), standard normal in the case's dtype; packed
    sequences: q (tokens, H, D), k and v (tokens, H_kv, D)."""
    import torch

    from .launch import torch_dtype

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch_dtype(case.dtype)
    if case.packed:
        shapes = [(case.tokens, heads, case.head_dim) for heads in (case.heads, case.heads_kv, case.heads_kv)]
    else:
        shapes = [(case.batch, heads, seq, case.head_dim)
                  for heads, seq in ((case.heads, case.seq), (case.heads_kv, case.seq_kv), (case.heads_kv, case.seq_kv))]
    return tuple(torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for shape in shapes)  # type: ignore[return-value]


def case_offsets(case: Case) -> list[int]:
    """The packed sequences' offsets of a case (``runtime.varlen.offsets_of``; queries and keys alike)."""
    from ..runtime.varlen import offsets_of

    return offsets_of(case.lengths)


def case_features(case: Case) -> dict[str, Any]:
    """The feature arguments of a case's launches (empty for a plain case; a padded batch's
    lengths are tensors, ``launch_arguments``')."""
    if not case.features:
        return {}
    return {"softcap": case.softcap, "window_left": case.window[0], "window_right": case.window[1]}


def case_lengths(case: Case, device: Any = "cuda") -> Any:
    """A padded batch's lengths, int32 on ``device``: its seqlens_k and seqlens_q."""
    import torch

    return torch.tensor(case.lengths, dtype=torch.int32, device=device)


def launch_arguments(case: Case, device: Any = "cuda") -> dict[str, Any]:
    """The keywords of a case's launches: its feature arguments (a padded batch's lengths as
    int32 on ``device``), and for packed sequences their offsets, int32 on ``device``
    (``launch.Packed``)."""
    extra: dict[str, Any] = {"features": case_features(case)} if case.features else {}
    if case.padded:
        lengths = case_lengths(case, device)
        extra["features"].update(seqlens_k=lengths, seqlens_q=lengths)
    if case.packed:
        import torch

        from .launch import Packed

        offsets = torch.tensor(case_offsets(case), dtype=torch.int32, device=device)
        extra["packed"] = Packed(offsets, offsets, case.seq, case.seq_kv)
    return extra


def case_reference(q: Any, k: Any, v: Any, case: Case, scale: float | None) -> Any:
    """The fp32 reference of a case: ``reference``, for a case with a soft cap or a window the
    runtime's explicit-mask computation (``runtime.features.reference_attention``), for packed
    sequences the runtime's per-sequence one (``runtime.varlen.reference_varlen``)."""
    if not case.features:
        return reference(q, k, v, case.causal, scale)
    from ..runtime.features import CallFeatures, reference_attention

    features = CallFeatures(case.window[0], case.window[1], case.softcap, seqlens=case.padded, varlen=case.packed)
    if case.padded:
        lengths = case_lengths(case, q.device)
        return reference_attention(q.float(), k.float(), v.float(), case.causal, scale, True, features, lengths, None,
                                   lengths)
    if case.packed:
        from ..runtime.varlen import reference_varlen

        offsets = case_offsets(case)
        return reference_varlen(q.float(), k.float(), v.float(), offsets, offsets, case.causal, scale, features)
    return reference_attention(q.float(), k.float(), v.float(), case.causal, scale, True, features)


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float | None) -> Any:
    """SDPA in fp32 on the same inputs; k and v with fewer heads than q are repeated per
    group of query heads (what ``enable_gqa=True`` means)."""
    import torch.nn.functional as F

    kf, vf = k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.float(), kf, vf, is_causal=causal, scale=scale)


def gate_launcher(launcher: Callable[..., Any], case: Case, scale: float | None, atol: float, rtol: float, seed: int, trials: int) -> CaseResult:
    """Gate any launcher ``(q, k, v, out, scale)`` on ``trials`` fresh random draws."""
    import torch

    worst_abs, worst_l2 = 0.0, 0.0
    extra = launch_arguments(case)
    for trial in range(trials):
        q, k, v = _random_inputs(case, seed + trial)
        ref = case_reference(q, k, v, case, scale)
        originals = (q.clone(), k.clone(), v.clone())
        out = torch.full_like(q, float("nan"))
        torch.cuda.synchronize()
        try:
            launcher(q, k, v, out, scale, **extra)
        except _KernelFault:
            raise
        except Exception as exc:  # noqa: BLE001 - a launch that raises is a launch failure, not a dead search
            raise _KernelFault(f"launch failed: {str(exc).splitlines()[0]}") from exc
        _sync()  # only the launch stream: work done elsewhere is not finished work
        reason, max_abs, rel_l2 = check_output(out, ref, atol, rtol)
        torch.cuda.synchronize()
        for name, now, before in zip("qkv", (q, k, v), originals):
            if not torch.equal(now, before):
                reason = f"input {name} was modified by the kernel"
        worst_abs, worst_l2 = max(worst_abs, max_abs), max(worst_l2, rel_l2)
        if reason:
            return CaseResult(case.label(), "incorrect", f"{case.label()}: {reason} (trial {trial}, seed {seed + trial})",
                              worst_abs, worst_l2, trial + 1, seed)
    return CaseResult(case.label(), "ok", "", worst_abs, worst_l2, trials, seed)


def _gate_job(launcher: Any, job: dict) -> dict:
    results = []
    for case, trials in job["cases"]:
        result = gate_launcher(launcher, case, job["scale"], job["atol"], job["rtol"], case_seed(job["seed"], job["key"], case), trials)
        results.append(asdict(result))
        if result.status != "ok":
            break
    return {"status": results[-1]["status"] if results else "ok", "cases": results}


def input_set_bytes(case: Case) -> int:
    """Bytes of one input set: q and out (B, H, S, D), k and v (B, H_kv, S_kv, D), 16-bit elements
    (packed sequences: their tokens for B * S and B * S_kv)."""
    if case.packed:
        return 2 * 2 * case.tokens * case.head_dim * (case.heads + case.heads_kv)
    return 2 * 2 * case.batch * case.head_dim * (case.heads * case.seq + case.heads_kv * case.seq_kv)


def input_sets(case: Case, flush_l2: bool, seed: int) -> list[tuple[Any, Any, Any, Any]]:
    import torch

    from .timing import input_sets_for_cold_l2

    set_bytes = input_set_bytes(case)
    sets = []
    for i in range(input_sets_for_cold_l2(set_bytes, flush_l2)):
        q, k, v = _random_inputs(case, seed + 1000 + i)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


def time_launcher(launcher: Callable[..., Any], case: Case, scale: float | None, timing: dict, seed: int,
                  tolerance: tuple[float, float] | None = None) -> dict:
    """Device time of ``launcher`` on ``case`` (``time_graph`` with the space's protocol):
    ``{"status": "ok", "time": {...}}``.

    With ``tolerance`` (atol, rtol) the timed graph must also do the work: after capture
    every output is poisoned with NaN, and after the replays the first output must match
    an eager launch on the same inputs (which the gate has checked) and every output must
    be finite. Work done on another stream, or only at capture time, is not in the graph
    and leaves NaN behind: ``{"status": "incorrect", "reason": ...}``.
    """
    import torch

    sets = input_sets(case, timing["flush_l2"], seed)
    extra = launch_arguments(case)
    ops = [lambda s=s: launcher(s[0], s[1], s[2], s[3], scale, **extra) for s in sets]
    expected = None
    if tolerance is not None:
        q, k, v, out = sets[0]
        launcher(q, k, v, out, scale, **extra)
        torch.cuda.synchronize()
        expected = out.float()

    def poison() -> None:
        torch.cuda.synchronize()  # work the launcher queued elsewhere while capturing lands before the poison
        for s in sets:
            s[3].fill_(float("nan"))

    try:
        result = _time_ops(ops, timing, after_capture=poison if expected is not None else None)
    except _KernelFault:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. a capture refused: the context may be unusable, restart the worker
        raise _KernelFault(f"timed launch failed (captured in a CUDA graph): {str(exc).splitlines()[0]}") from exc
    _sync()
    torch.cuda.synchronize()
    if expected is not None:
        reason, _, _ = check_output(sets[0][3], expected, *tolerance)
        written = torch.stack([torch.isfinite(s[3]).all() for s in sets]).tolist()  # one synchronisation for every set
        unwritten = next((i for i, ok in enumerate(written) if not ok), None)
        if not reason and unwritten is not None:
            reason = f"output of input set {unwritten} not finite or never written"
        if reason:
            return {"status": "incorrect", "reason": f"timed launch did not produce the output on the launch stream: {reason}"}
    return {"status": "ok", "time": result.to_json(), "sampled_s": result.sampled_s}


def _time_job(launcher: Any, job: dict) -> dict:
    case: Case = job["case"]
    seed = case_seed(job["seed"], job["key"], case)
    raw = lambda q, k, v, out, scale, **kw: launcher(q, k, v, out, scale, checked=False, **kw)  # noqa: E731
    answer = time_launcher(raw, case, job["scale"], job["timing"], seed, tolerance=(job["atol"], job["rtol"]))
    if answer["status"] != "ok":
        return {"status": answer["status"], "reason": f"{case.label()}: {answer['reason']}"}
    timed = answer["time"]
    return {"status": "ok", "time": timed, "tflops": case.flops() / (timed["median_us"] * 1e-6) / 1e12,
            "sampled_s": answer["sampled_s"]}


def forced_backend(backend: str) -> Any:
    """The ``SDPBackend`` an ``SDPA_BACKENDS`` name forces."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]


def padding_mask(case: Case, device: Any) -> Any:
    """A padded batch's boolean mask as an SDPA user passes it: causal (where the case is) and the
    keys past each batch's length; its padded query rows are computed."""
    from ..runtime.features import PLAIN, allowed_keys

    return allowed_keys(case.batch, case.seq, case.seq_kv, case.causal, PLAIN, case_lengths(case, device), device=device)


def sdpa_op(backend: str, q: Any, k: Any, v: Any, causal: bool, scale: float | None,
            offsets: list[int] | None = None, mask: Any = None) -> Callable[[], Any]:
    """One call of attention on (B, H, S, D) inputs: an SDPA backend forced (``SDPA_BACKENDS``),
    SDPA as the user calls it with torch's own backend choice (``default``), or a peer
    library (``fa4``: flash-attn-4's ``flash_attn.cute``, timed on (B, S, H, D) copies).
    k and v with fewer heads than q: SDPA with ``enable_gqa=True``; flash-attn takes them as they are.
    ``offsets``: q, k and v are packed sequences (tokens, heads, D) of these offsets: SDPA per
    sequence (``runtime.varlen.sdpa_per_sequence``), or flash-attn-4's varlen call. ``mask``: a
    padded batch's boolean mask (``padding_mask``) in place of ``causal``, K and V repeated to the
    query heads; flash-attn-4 takes no such call here."""
    import torch.nn.functional as F

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if offsets is not None:
        return _packed_sdpa_op(backend, q, k, v, causal, scale, offsets)
    if mask is not None:
        if backend == "fa4":
            raise ValueError("flash-attn-4 is not timed on padded batches here")
        from ..runtime.features import repeat_kv

        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        return under_backend(backend, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))
    if backend == "fa4":
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return lambda: flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=causal)
    return under_backend(backend, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa))


def under_backend(backend: str, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` as it is for ``default`` (torch's own choice), else run with ``backend`` forced."""
    if backend == "default":
        return call
    from torch.nn.attention import sdpa_kernel

    forced = forced_backend(backend)

    def op() -> Any:
        with sdpa_kernel([forced]):
            return call()

    return op


def _packed_sdpa_op(backend: str, q: Any, k: Any, v: Any, causal: bool, scale: float | None,
                    offsets: list[int]) -> Callable[[], Any]:
    """``sdpa_op`` of packed sequences."""
    import torch

    from ..runtime.varlen import sdpa_per_sequence

    if backend == "fa4":
        from flash_attn.cute import flash_attn_varlen_func

        cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(offsets, offsets[1:]))
        return lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                              max_seqlen_k=longest, softmax_scale=scale, causal=causal)
    return under_backend(backend, lambda: sdpa_per_sequence(q, k, v, offsets, offsets, causal, scale))


def _sdpa_job(job: dict) -> dict:
    import torch

    case: Case = job["case"]
    out: dict[str, Any] = {}
    sets = input_sets(case, job["timing"]["flush_l2"], job["seed"])
    for backend in job["backends"]:
        try:
            offsets = case_offsets(case) if case.packed else None
            mask = padding_mask(case, sets[0][0].device) if case.padded else None
            ops = [sdpa_op(backend, q, k, v, case.causal, job["scale"], offsets, mask) for q, k, v, _ in sets]
            timed = _time_ops(ops, job["timing"]).to_json()
            out[backend] = {"status": "ok", "time": timed, "tflops": case.flops() / (timed["median_us"] * 1e-6) / 1e12}
        except Exception as exc:  # noqa: BLE001 - a backend that does not support the shape is a row, not a crash
            torch.cuda.synchronize()
            out[backend] = {"status": "unsupported", "reason": str(exc).splitlines()[0][:200]}
    return {"status": "ok", "backends": out}


def gpu_info() -> dict:
    import platform
    import subprocess

    import cupy
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info: dict[str, Any] = {
        "status": "ok",
        "gpu": props.name,
        "arch": f"sm_{props.major}{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gb": round(props.total_memory / 2**30, 1),
        "l2_mb": round(props.L2_cache_size / 2**20, 1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
    }
    try:
        import optuna

        info["optuna"] = optuna.__version__
    except ImportError:
        info["optuna"] = None
    try:
        query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", f"--id={torch.cuda.current_device()}"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        info.update(dict(zip(("driver", "sm_clock", "max_sm_clock", "mem_clock", "power_limit"), (x.strip() for x in line.split(",")))))
    except Exception:  # noqa: BLE001 - nvidia-smi is optional
        pass
    torch.zeros(1, device="cuda")  # the context exists before any timed job
    return info


# ---------------------------------------------------------------------------------
# Parent side: no GPU here; jobs go to a worker process.
# ---------------------------------------------------------------------------------


class Evaluator:
    """Evaluate configurations of a space on one GPU through a crash-isolating worker."""

    def __init__(self, space: Space, *, arch: str | None = None, device: int | None = 0, seed: int = 0,
                 gate_trials: int = 2, worker: Any = None, best_case_us: dict[str, float] | None = None) -> None:
        from .worker import Worker

        self.space = space
        self.arch = arch or space.target.arch
        self.seed = seed
        self.gate_trials = gate_trials
        self.worker = worker or Worker(HANDLER, device=device)
        self._known_restarts = -1
        self._info: dict | None = None
        self.phases: dict[str, float] = {}
        self.timing = space.timing.protocol()
        # per case label, the best median timed so far (racing): shared by the evaluators of one
        # search over several GPUs, so each lane races against the best of all of them
        self.best_case_us: dict[str, float] = {} if best_case_us is None else best_case_us

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device(self) -> int | None:
        return self.worker.device

    # -- jobs ------------------------------------------------------------------------
    def _run(self, job: dict, timeout_s: float) -> dict:
        """Run one job; a dead or hung worker becomes a status (``_run_all`` of one job)."""
        return self._run_all([job], timeout_s)[0]

    def _run_all(self, jobs: list[dict], timeout_s: float) -> list[dict]:
        """``jobs`` in one round trip to the worker (``Worker.run_many``: each job given
        ``timeout_s``, the batch ending at the first answer that is not ok): one answer per job
        run, a dead or hung worker as a status. The worker's phase times add up in
        ``self.phases``; the rest of the round trip counts as ``ipc``."""
        self._ensure_warm()
        started = time.perf_counter()
        outcomes = self.worker.run_many(jobs, timeout_s)
        spent = time.perf_counter() - started
        answers, spent_inside = [], 0.0
        for outcome in outcomes:
            inside = outcome.value.get("phases", {}) if outcome.status == "ok" and isinstance(outcome.value, dict) else {}
            for name, seconds in inside.items():
                self.phases[name] = self.phases.get(name, 0.0) + seconds
            spent_inside += sum(seconds for name, seconds in inside.items() if name not in SUB_PHASES)
            answers.append(outcome.value if outcome.status == "ok" else {
                "status": outcome.status, "detail": outcome.message,
                "reason": outcome.message.strip().splitlines()[-1][:300] if outcome.message else outcome.status})
        self.phases["ipc"] = self.phases.get("ipc", 0.0) + max(0.0, spent - spent_inside)
        return answers

    def _ensure_warm(self) -> None:
        """A fresh worker imports torch and creates its context before any timed job."""
        if self.worker.restarts != self._known_restarts or self._info is None:
            outcome = self.worker.run({"kind": "info"}, 180.0)
            self._info = outcome.value if outcome.status == "ok" else {"status": outcome.status, "reason": outcome.message}
            self._known_restarts = self.worker.restarts

    def info(self) -> dict:
        self._ensure_warm()
        return dict(self._info or {})

    # -- evaluation -------------------------------------------------------------------
    def build(self, config: Config) -> StaticReport:
        return build_config(self.space.template, config, self.space.variants, self.arch, self.space.target.smem_per_block)

    def evaluate(self, config: Config, report: StaticReport | None = None) -> EvalResult:
        started = time.perf_counter()
        self.phases = {}
        if report is None and self.space.contains(config):
            report = self.build(config)
            self.phases["compile"] = time.perf_counter() - started
        result = self._evaluate(config, report)
        result.eval_s = round(time.perf_counter() - started, 3)
        result.phases = {k: round(v, 4) for k, v in self.phases.items()}
        result.device = self.device
        return result

    def _evaluate(self, config: Config, report: StaticReport | None) -> EvalResult:
        space = self.space
        base = dict(config=config.to_dict(), key=config.key())
        if not space.contains(config):
            broken = space.violations(config) if set(config) == set(space.param_names) else []
            why = f"violates {broken[0]!r}" if broken else f"not in the space (parameters {sorted(space.param_names)})"
            return EvalResult(**base, status="invalid", reason=why)
        report = report or self.build(config)
        resources = {"registers": report.registers, "smem": report.smem, "spill_bytes": report.spill_bytes, "arch": report.arch}
        if report.status != "compiled":
            return EvalResult(**base, status="compile_failed", reason=report.error, resources=resources)
        cases: list[dict] = []
        common = {"key": config.key(), "seed": self.seed, "scale": space.scale}
        gate_kind, time_kind = ("bwd_gate", "bwd_time") if space.backward else ("gate", "time")
        jobs = []
        for variant in space.variants:  # each variant's gate, then each case's timing: one round trip
            build = report.build(variant)
            jobs.append({"kind": gate_kind, "rendered": build.rendered, "cubin_path": build.compiled.cubin_path, **common,
                         **_tolerance(space, variant.dtype),
                         "cases": [(c, self.gate_trials if c in space.cases else 1)
                                   for c in (backward_gate_cases if space.backward else gate_cases)(space, variant)]})
        for case in space.cases:
            build = report.build(case.variant)
            best = self.best_case_us.get(case.label())
            race = {"give_up_above_us": best * self.timing["race"]} if best and self.timing.get("race") else {}
            jobs.append({"kind": time_kind, "rendered": build.rendered, "cubin_path": build.compiled.cubin_path, "case": case,
                         "timing": {**self.timing, **race}, **common, **_tolerance(space, case.dtype)})
        answers = iter(self._run_all(jobs, space.timing.timeout_s))
        stopped = {"status": "crashed", "reason": "the worker stopped answering before this job"}
        for variant in space.variants:
            answer = next(answers, stopped)
            cases += answer.get("cases", [])
            if answer["status"] != "ok":
                reason = answer.get("reason") or next((c["reason"] for c in answer.get("cases", []) if c["reason"]), "")
                return EvalResult(**base, status=answer["status"], reason=f"{variant.label()}: {reason}" if answer["status"] != "incorrect" else reason,
                                  resources=resources, cases=cases)
        timed: list[dict] = []
        for case in space.cases:
            answer = next(answers, stopped)
            if answer["status"] != "ok":
                return EvalResult(**base, status=answer["status"], reason=answer.get("reason", ""), resources=resources, cases=cases)
            gate = next((c for c in cases if c["label"] == case.label()), {})
            timed.append({**gate, "label": case.label(), "status": "ok", "time": answer["time"], "tflops": answer["tflops"]})
        for c in timed:
            self.best_case_us[c["label"]] = min(self.best_case_us.get(c["label"], math.inf), c["time"]["median_us"])
        objective = math.exp(sum(math.log(c["time"]["median_us"]) for c in timed) / len(timed))
        others = [c for c in cases if c["label"] not in {t["label"] for t in timed}]
        return EvalResult(**base, status="ok", resources=resources, cases=timed + others, objective_us=objective)

    def time_case(self, report: StaticReport, case: Case, timing: dict | None = None) -> dict:
        """One timing of a compiled configuration on one case, no gate: the worker's answer
        (status, and time and tflops when ok). ``timing`` replaces the space's protocol."""
        build = report.build(case.variant)
        job = {"kind": "bwd_time" if self.space.backward else "time", "rendered": build.rendered, "cubin_path": build.compiled.cubin_path, "case": case,
               "timing": timing or self.timing, "key": report.config.key(), "seed": self.seed, "scale": self.space.scale,
               **_tolerance(self.space, case.dtype)}
        return self._run(job, self.space.timing.timeout_s * 2)

    def default_backends(self) -> tuple[str, ...]:
        """SDPA's backends this space's candidates are compared with (their backward's, for a backward space)."""
        return BACKWARD_SDPA_BACKENDS if self.space.backward else SDPA_BACKENDS

    def time_references(self, case: Case, backends: Sequence[str] | None = None, timing: dict | None = None) -> dict[str, dict]:
        """SDPA's backends (and reference calls) on one case: backend -> {status, time, tflops} or
        reason; a backward space times their backward."""
        backends = self.default_backends() if backends is None else backends
        job = {"kind": "bwd_sdpa" if self.space.backward else "sdpa", "case": case, "backends": list(backends), "timing": timing or self.timing, "seed": self.seed,
               "scale": self.space.scale}
        answer = self._run(job, max(120.0, self.space.timing.timeout_s * len(backends) * 3))
        return answer.get("backends", {b: {"status": answer["status"], "reason": answer.get("reason", "")} for b in backends})

    def baseline(self, backends: Sequence[str] | None = None, cases: Sequence[Case] | None = None) -> dict[str, dict]:
        """SDPA backends on every case: label -> backend -> {status, time, tflops} or reason."""
        return {case.label(): self.time_references(case, backends) for case in cases or self.space.cases}


def _tolerance(space: Space, dtype: str) -> dict[str, float]:
    atol, rtol = space.tolerance(dtype)
    return {"atol": atol, "rtol": rtol}


def fastest_sdpa(baseline: dict[str, dict]) -> dict[str, tuple[str, float]]:
    """label -> (backend, median µs) of the fastest supported backend."""
    best = {}
    for label, rows in baseline.items():
        ok = [(b, r["time"]["median_us"]) for b, r in rows.items() if r.get("status") == "ok"]
        if ok:
            best[label] = min(ok, key=lambda x: x[1])
    return best
