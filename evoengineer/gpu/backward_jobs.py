"""A backward space's jobs in the worker: the gradient gate, the backward's device time, and
SDPA's backward by the same harness.

A candidate is a backward configuration (``paths.mma_backward``); its forward is the LSE forward
of ``kernels.backward_rules.forward_lse_config``, run once per input before anything is checked
or timed. The gate draws fresh q, k, v, dO per case, poisons dQ, dK, dV and both workspaces with
NaN, and holds each gradient to flash-attn's rule against fp32 autograd of SDPA
(``max|grad - grad_fp32| <= 2 max|grad_lowp - grad_fp32| + eps``). Every candidate runs twice per
draw: an atomic dQ must pass both times, a separate one must also agree bit for bit.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from ..space import Case
from .harness import CaseResult, _KernelFault, _sync, _time_ops, case_seed, check_output

GATE_BATCH = 1
GATE_KV_HEADS = 2
"""A space's own case is gated on one batch and at most two K/V head groups: the fp32 reference
of B8 H16 S4096 would hold tens of GB, and batch and head only move base pointers."""


def gate_case(case: Case) -> Case:
    """The case as the gate runs it (``GATE_BATCH``, at most ``GATE_KV_HEADS`` K/V heads, the
    query heads per K/V head kept)."""
    kv = min(case.heads_kv, GATE_KV_HEADS)
    group = case.heads // case.heads_kv
    return Case(min(case.batch, GATE_BATCH), kv * group, case.seq, case.head_dim, case.causal, heads_kv=kv,
                dtype=case.dtype, seq_kv=case.seq_kv)


def _inputs(case: Case, seed: int) -> tuple[Any, Any, Any, Any]:
    """q, k, v and dO of ``case``, standard normal in its dtype."""
    import torch

    from .launch import torch_dtype

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch_dtype(case.dtype)
    shapes = [(case.batch, case.heads, case.seq, case.head_dim), (case.batch, case.heads_kv, case.seq_kv, case.head_dim),
              (case.batch, case.heads_kv, case.seq_kv, case.head_dim), (case.batch, case.heads, case.seq, case.head_dim)]
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes)  # type: ignore[return-value]


def _forward(case: Case, q: Any, k: Any, v: Any, scale: float | None) -> tuple[Any, Any]:
    from .backward import attention_forward_lse

    return attention_forward_lse(q, k, v, scale, case.causal)


def _buffers(q: Any, k: Any, v: Any, atomic: bool) -> dict[str, Any]:
    """Outputs and workspaces of one backward, NaN-filled: a kernel that leaves any unwritten
    or reads what they held before gives NaN."""
    import torch

    rows = q.shape[0] * q.shape[1] * q.shape[2]
    out = {"dq": torch.full_like(q, float("nan")), "dk": torch.full_like(k, float("nan")),
           "dv": torch.full_like(v, float("nan")),
           "dsum": torch.full((max(rows, 1),), float("nan"), dtype=torch.float32, device=q.device)}
    if atomic:
        out["dq_accum"] = torch.full((max(rows * q.shape[3], 1),), float("nan"), dtype=torch.float32, device=q.device)
    return out


def gate_backward(kernel: Callable[..., Any], atomic: bool, case: Case, scale: float | None, seed: int,
                  trials: int) -> CaseResult:
    """Gate the backward ``kernel`` (``BackwardKernel``) on ``trials`` fresh draws of ``case``."""
    import torch

    from .backward import rule_check, sdpa_gradients

    worst = 0.0
    for trial in range(trials):
        q, k, v, do = _inputs(case, seed + trial)
        o, lse = _forward(case, q, k, v, scale)
        _, *ref32 = sdpa_gradients(q, k, v, do, case.causal, scale, torch.float32)
        _, *lowp = sdpa_gradients(q, k, v, do, case.causal, scale)
        runs = []
        for _ in range(2):
            buffers = _buffers(q, k, v, atomic)
            torch.cuda.synchronize()
            try:
                kernel(q, k, v, o, lse, do, scale, **buffers)
            except _KernelFault:
                raise
            except Exception as exc:  # noqa: BLE001 - a launch that raises is a launch failure
                raise _KernelFault(f"launch failed: {str(exc).splitlines()[0]}") from exc
            _sync()
            runs.append((buffers["dq"], buffers["dk"], buffers["dv"]))
        reasons = []
        for run, grads in enumerate(runs):
            for check in (rule_check(n, g, r, lp) for n, g, r, lp in zip(("dq", "dk", "dv"), grads, ref32, lowp)):
                worst = max(worst, check.err) if check.err == check.err else float("inf")
                if not check.ok:
                    reasons.append(f"run {run + 1}: {check}")
        if not atomic and not reasons and not all(torch.equal(a, b) for a, b in zip(*runs)):
            reasons.append("a deterministic dQ differs between two runs on the same inputs")
        if reasons:
            return CaseResult(case.label(), "incorrect", f"{case.label()}: {reasons[0]} (trial {trial}, seed {seed + trial})",
                              worst, None, trial + 1, seed)
    return CaseResult(case.label(), "ok", "", worst, None, trials, seed)


def _load(job: dict) -> Any:
    from .backward import BackwardKernel

    try:
        return BackwardKernel(job["rendered"], job["cubin_path"])
    except Exception as exc:  # noqa: BLE001 - a module that fails to load is a launch failure
        raise _KernelFault(f"module load failed: {exc}") from exc


_LOADED: dict[str, Any] = {}


def _kernel(job: dict) -> Any:
    kernel = _LOADED.get(job["cubin_path"])
    if kernel is None:
        kernel = _LOADED[job["cubin_path"]] = _load(job)
    return kernel


def gate_job(job: dict) -> dict:
    kernel = _kernel(job)
    results = []
    for case, trials in job["cases"]:
        result = gate_backward(kernel, kernel.atomic_dq, gate_case(case), job["scale"],
                               case_seed(job["seed"], job["key"], case), trials)
        results.append({**asdict(result), "label": case.label()})
        if result.status != "ok":
            break
    return {"status": results[-1]["status"] if results else "ok", "cases": results}


def set_bytes(case: Case) -> int:
    """Bytes one backward reads and writes: q, o, dO, dQ (B, H, S, D) and k, v, dK, dV
    (B, H_kv, S_kv, D) in 16 bits, and the fp32 dQ accumulator."""
    q_rows = case.batch * case.heads * case.seq * case.head_dim
    kv_rows = case.batch * case.heads_kv * case.seq_kv * case.head_dim
    return 2 * (4 * q_rows + 4 * kv_rows) + 4 * q_rows


def _timed_sets(case: Case, flush_l2: bool, seed: int, scale: float | None, atomic: bool) -> list[dict[str, Any]]:
    from .timing import input_sets_for_cold_l2

    sets = []
    for i in range(input_sets_for_cold_l2(set_bytes(case), flush_l2)):
        q, k, v, do = _inputs(case, seed + 1000 + i)
        o, lse = _forward(case, q, k, v, scale)
        sets.append({"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do, **_buffers(q, k, v, atomic)})
    return sets


def time_job(job: dict) -> dict:
    """The backward's device time on ``job["case"]``; the timed graph must write every gradient
    (poisoned after capture) and agree with an eager run on the first input set."""
    import torch

    kernel = _kernel(job)
    case: Case = job["case"]
    scale = job["scale"]
    sets = _timed_sets(case, job["timing"]["flush_l2"], case_seed(job["seed"], job["key"], case), scale, kernel.atomic_dq)
    names = ("dq", "dk", "dv", "dsum", "dq_accum")

    def call(s: dict[str, Any]) -> Any:
        return kernel(s["q"], s["k"], s["v"], s["o"], s["lse"], s["do"], scale, checked=False,
                      **{n: s[n] for n in names if n in s})

    first = sets[0]
    call(first)
    torch.cuda.synchronize()
    expected = [first[n].float() for n in ("dq", "dk", "dv")]

    def poison() -> None:
        torch.cuda.synchronize()
        for s in sets:
            for n in ("dq", "dk", "dv"):
                s[n].fill_(float("nan"))

    try:
        timed = _time_ops([lambda s=s: call(s) for s in sets], job["timing"], after_capture=poison)
    except _KernelFault:
        raise
    except Exception as exc:  # noqa: BLE001 - a capture refused: the context may be unusable
        raise _KernelFault(f"timed launch failed (captured in a CUDA graph): {str(exc).splitlines()[0]}") from exc
    _sync()
    for name, want in zip(("dq", "dk", "dv"), expected):
        reason, _, _ = check_output(first[name], want, job["atol"], job["rtol"])
        if reason:
            return {"status": "incorrect", "reason": f"{case.label()}: timed {name} differs from an eager run: {reason}"}
    for i, s in enumerate(sets):
        if not all(bool(torch.isfinite(s[n]).all()) for n in ("dq", "dk", "dv")):
            return {"status": "incorrect", "reason": f"{case.label()}: timed gradients of input set {i} not all written"}
    result = timed.to_json()
    return {"status": "ok", "time": result, "tflops": case.backward_flops() / (result["median_us"] * 1e-6) / 1e12}


def sdpa_backward_op(backend: str, q: Any, k: Any, v: Any, do: Any, causal: bool, scale: float | None) -> Callable[[], Any]:
    """SDPA's backward (``flash``, ``cudnn``, ``efficient``, ``math`` forced, or ``default``: torch's
    own choice) or flash-attn-4's (``fa4``) on these inputs: the forward runs once here, on a side
    stream so its backward can join a graph being captured; the call is ``autograd.grad``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
              "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}.get(backend)
    if backend == "fa4":  # flash-attn-4 takes (B, S, H, D)
        from flash_attn.cute import flash_attn_func

        leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        grad = do.transpose(1, 2).contiguous()
    else:
        leaves, grad = [t.detach().requires_grad_() for t in (q, k, v)], do
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    # autograd runs each backward op on its forward's stream, which may join a graph being
    # captured; the legacy default stream may not
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if backend == "fa4":
            result = flash_attn_func(*leaves, softmax_scale=scale, causal=causal)
            out = result[0] if isinstance(result, tuple) else result
        elif chosen is None:
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, **gqa)
        else:
            with sdpa_kernel(chosen):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, **gqa)
    torch.cuda.current_stream().wait_stream(stream)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def sdpa_job(job: dict) -> dict:
    """SDPA's backends' backward on ``job["case"]``, by the harness that times the candidates."""
    import torch

    from .timing import input_sets_for_cold_l2

    case: Case = job["case"]
    out: dict[str, Any] = {}
    count = input_sets_for_cold_l2(set_bytes(case), job["timing"]["flush_l2"])
    sets = [_inputs(case, job["seed"] + 1000 + i) for i in range(count)]
    for backend in job["backends"]:
        try:
            ops = [sdpa_backward_op(backend, q, k, v, do, case.causal, job["scale"]) for q, k, v, do in sets]
            timed = _time_ops(ops, job["timing"]).to_json()
            out[backend] = {"status": "ok", "time": timed, "tflops": case.backward_flops() / (timed["median_us"] * 1e-6) / 1e12}
        except Exception as exc:  # noqa: BLE001 - a backend that does not support the shape is a row, not a crash
            torch.cuda.synchronize()
            out[backend] = {"status": "unsupported", "reason": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}
        finally:
            ops = []
            torch.cuda.empty_cache()
    return {"status": "ok", "backends": out}


JOBS: dict[str, Callable[[dict], dict]] = {"bwd_gate": gate_job, "bwd_time": time_job, "bwd_sdpa": sdpa_job}
"""The backward's job kinds, as the worker's handler (``evaluate.handle``) dispatches them."""
