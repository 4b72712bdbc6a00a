"""The mma backward on one GPU: its correctness grid, then its device time against SDPA's backward.

    python benchmarks/backward_gpu_check.py                       # everything, JSON to backward_gpu_check.json
    python benchmarks/backward_gpu_check.py --skip-timing         # the correctness grid only
    python benchmarks/backward_gpu_check.py --skip-correctness --reps 20 --json out.json
    python benchmarks/backward_gpu_check.py --configs t64n128,D128:m32n64 --dtypes fp16   # a subset

1. Correctness: every kept backward configuration (``evoengineer/kernels/backward_rules.py``) on
   S = 1, 5, 77, 257, 1024, seq_q != seq_k both ways and grouped-query heads, causal and full, fp16
   and bf16: dq, dk, dv against autograd of fp32 SDPA (math backend) under flash-attn's rule
   ``max|g - g32| <= 2 max|g_lowp - g32| + eps`` (g_lowp: the same autograd in the input dtype,
   eps = 1e-3 max|g32| + 1e-5), outputs and workspaces NaN-poisoned; the forward's row
   log-sum-exp against torch.logsumexp (|err| <= 1e-3). Atomic-dQ configurations run three times
   (each must pass), separate-dQ ones must repeat bit for bit.
2. Timing (CUDA events, L2 flushed before every call, a GPU spin before it so the host's launches
   are queued in time, median of --reps): every configuration that passed, per shape, against SDPA's
   flash and cuDNN backends' backward (``torch.autograd.grad`` of their forward, GQA through
   ``enable_gqa``) on B4 H16 S2048 D64/D128, B8 H16 S4096 D128, B2 H32/8 S4096 D128, full and
   causal, fp16 and bf16. TF/s counts backward FLOPs = 2.5 x 4 B H S_q S_k D (half for causal).
   Also the forward's cost of writing the log-sum-exp (WRITE_LSE=1 against 0, same configuration).
A configuration or backend that fails is printed and skipped; the rest go on.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from evoengineer.gpu.backward import (
    attention_forward_lse,
    device_arch,
    load_backward,
    load_forward_lse,
    reference_lse,
    rule_check,
    sdpa_gradients,
)
from evoengineer.kernels import compile_many, render
from evoengineer.kernels.backward_rules import (
    BACKWARD_CONFIGS,
    BACKWARD_TEMPLATE,
    FORWARD_TEMPLATE,
    deterministic,
    forward_lse_config,
)
from evoengineer.space import Config, Variant

CHECK_SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (1, 2, 2, 1, 1), (2, 3, 3, 5, 5), (2, 2, 2, 77, 77), (1, 2, 2, 257, 257), (1, 2, 2, 1024, 1024),
    (1, 2, 2, 77, 257), (1, 2, 2, 257, 77), (1, 8, 2, 257, 257), (2, 8, 2, 77, 130),
]
TIME_SHAPES = [  # (B, H, H_kv, S, D)
    (4, 16, 16, 2048, 64), (4, 16, 16, 2048, 128), (8, 16, 16, 4096, 128), (2, 32, 8, 4096, 128),
]
DTYPES = ("fp16", "bf16")
LSE_ATOL = 1e-3


def torch_dtype(name: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def selected(names: list[str] | None) -> dict[int, dict[str, Config]]:
    """BACKWARD_CONFIGS, only the given names (all when None); a name may be 'D128:t64n128' or 't64n128'."""
    if not names:
        return BACKWARD_CONFIGS
    out: dict[int, dict[str, Config]] = {}
    for head_dim, named in BACKWARD_CONFIGS.items():
        keep = {n: c for n, c in named.items() if n in names or f"D{head_dim}:{n}" in names}
        if keep:
            out[head_dim] = keep
    return out


def precompile(arch: str, configs: dict[int, dict[str, Config]]) -> None:
    """Warm the NVRTC disk cache for every configuration and variant, in parallel."""
    sources = []
    for head_dim, named in configs.items():
        for dtype, causal in itertools.product(DTYPES, (False, True)):
            variant = Variant(head_dim, causal, dtype)
            sources += [render(BACKWARD_TEMPLATE, config, variant).source for config in named.values()]
            lse_config = forward_lse_config(head_dim)
            sources += [render(FORWARD_TEMPLATE, lse_config.replace(WRITE_LSE=w), variant).source for w in (0, 1)]
    start = time.perf_counter()
    failed = [r.error for r in compile_many(sources, arch, workers=8) if not r.ok]
    print(f"compiled {len(sources)} sources for {arch} in {time.perf_counter() - start:.0f} s"
          + (f"; {len(failed)} failed: {failed[:3]}" if failed else ""))


def inputs(shape: tuple[int, int, int, int, int], head_dim: int, dtype: str, seed: int) -> tuple[Any, Any, Any, Any]:
    import torch

    B, H, H_kv, S_q, S_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch_dtype(dtype)
    return (torch.randn(B, H, S_q, head_dim, device="cuda", dtype=dt, generator=gen),
            torch.randn(B, H_kv, S_k, head_dim, device="cuda", dtype=dt, generator=gen),
            torch.randn(B, H_kv, S_k, head_dim, device="cuda", dtype=dt, generator=gen),
            torch.randn(B, H, S_q, head_dim, device="cuda", dtype=dt, generator=gen))


def check_one(config: Config, shape: tuple, head_dim: int, causal: bool, dtype: str) -> dict:
    """One configuration on one case: {"ok", "worst" (err / bound), "why"}."""
    import torch

    q, k, v, do = inputs(shape, head_dim, dtype, seed=sum(shape) + head_dim + int(causal))
    B, H, S_q, D = q.shape
    nan = float("nan")
    o, lse = attention_forward_lse(q, k, v, causal=causal, out=torch.full_like(q, nan),
                                   lse=torch.full((B, H, S_q), nan, device="cuda"))
    kernel = load_backward(config, Variant(head_dim, causal, dtype), q.device)
    runs = []
    for _ in range(3):
        dq, dk, dv = (torch.full_like(t, nan) for t in (q, k, v))
        ws = (torch.full((B * H * S_q,), nan, device="cuda"), torch.full((B * H * S_q * D,), nan, device="cuda"))
        runs.append(kernel(q, k, v, o, lse, do, dq=dq, dk=dk, dv=dv, dsum=ws[0], dq_accum=ws[1]))
    torch.cuda.synchronize()
    o32, *g32 = sdpa_gradients(q, k, v, do, causal, None, torch.float32)
    olp, *glp = sdpa_gradients(q, k, v, do, causal, None)
    why = []
    lse_err = (lse - reference_lse(q, k, causal, None)).abs().max().item()
    if not lse_err <= LSE_ATOL:
        why.append(f"lse err {lse_err:.3g}")
    checks = [rule_check("o", o, o32, olp)]
    for r, grads in enumerate(runs):
        checks += [rule_check(f"{n}[run {r}]", ours, ref, lowp) for n, ours, ref, lowp in zip(("dq", "dk", "dv"), grads, g32, glp)]
    why += [str(c) for c in checks if not c.ok]
    if deterministic(config) and not all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0])):
        why.append("separate dQ mode: runs differ")
    worst = max((c.err / c.bound if c.bound > 0 else math.inf) for c in checks)
    return {"ok": not why, "worst": worst, "why": "; ".join(why)}


def correctness(report: dict, configs: dict[int, dict[str, Config]], dtypes: tuple[str, ...] = DTYPES) -> dict[tuple[int, str], bool]:
    """The grid; returns (head_dim, config name) -> passed everywhere."""
    passed: dict[tuple[int, str], bool] = {}
    report["correctness"] = []
    for head_dim, named in configs.items():
        for name, config in named.items():
            n_ok = n_all = 0
            worst = 0.0
            for dtype, causal, shape in itertools.product(dtypes, (False, True), CHECK_SHAPES):
                n_all += 1
                case = f"D{head_dim} {name} {dtype} causal={int(causal)} {'x'.join(map(str, shape))}"
                try:
                    res = check_one(config, shape, head_dim, causal, dtype)
                except Exception as exc:  # noqa: BLE001 - one failing case must not stop the grid
                    res = {"ok": False, "worst": math.inf, "why": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc(limit=2)
                n_ok += res["ok"]
                worst = max(worst, res["worst"])
                report["correctness"].append({"case": case, "config": config.label(), **res})
                if not res["ok"]:
                    print(f"FAIL {case}: {res['why']}", flush=True)
            passed[(head_dim, name)] = n_ok == n_all
            print(f"D{head_dim} {name:14s} {n_ok}/{n_all} passed, worst err/bound {worst:.2f}", flush=True)
    return passed


def time_op(op: Callable[[], Any], reps: int, flush: Any) -> float:
    """Median device time of ``op`` in µs: L2 flushed, the GPU kept busy while the host queues the call."""
    import torch

    for _ in range(3):
        op()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(1_000_000)   # ~0.6 ms of GPU spin: the call's launches are queued before it starts
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)


def sdpa_backward_op(backend: str, q: Any, k: Any, v: Any, do: Any, causal: bool) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(which):
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    def op() -> Any:
        return torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)

    return op


def timing(report: dict, passed: dict[tuple[int, str], bool], reps: int, configs: dict[int, dict[str, Config]],
           dtypes: tuple[str, ...] = DTYPES) -> None:
    import torch

    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, dtype=torch.float32, device="cuda")
    rows = []
    report["timing"] = rows
    header = (f"{'shape':>22s} {'causal':>6s} {'dtype':>5s} {'best config':>14s} {'ours µs':>9s} {'TF/s':>6s} "
              f"{'flash µs':>9s} {'cudnn µs':>9s} {'flash/ours':>10s} {'cudnn/ours':>10s} {'fwd lse/no':>10s}")
    print("\n" + header)
    for (B, H, H_kv, S, D), causal, dtype in itertools.product(TIME_SHAPES, (False, True), dtypes):
        if D not in configs:
            continue
        shape_label = f"B{B} H{H}/{H_kv} S{S} D{D}"
        flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        row: dict[str, Any] = {"shape": shape_label, "causal": causal, "dtype": dtype, "ours": {}, "errors": []}
        try:
            q, k, v, do = inputs((B, H, H_kv, S, S), D, dtype, seed=1)
            o, lse = attention_forward_lse(q, k, v, causal=causal)
        except Exception as exc:  # noqa: BLE001
            print(f"{shape_label} causal={causal} {dtype}: inputs/forward failed: {exc}")
            row["errors"].append(f"forward: {exc}")
            rows.append(row)
            continue
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsum = torch.empty(B * H * S, device="cuda")
        acc = torch.empty(B * H * S * D, device="cuda")
        for name, config in configs[D].items():
            if not passed.get((D, name), False):
                continue
            try:
                kernel = load_backward(config, Variant(D, causal, dtype), q.device)
                row["ours"][name] = time_op(lambda: kernel(q, k, v, o, lse, do, dq=dq, dk=dk, dv=dv, dsum=dsum,
                                                           dq_accum=acc, checked=False), reps, flush)
            except Exception as exc:  # noqa: BLE001
                row["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"{shape_label} causal={causal} {dtype} {name}: {exc}")
        for backend in ("flash", "cudnn"):
            try:
                row[backend] = time_op(sdpa_backward_op(backend, q, k, v, do, causal), reps, flush)
            except Exception as exc:  # noqa: BLE001
                row[backend] = None
                row["errors"].append(f"sdpa {backend}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        try:  # the forward's cost of writing the log-sum-exp
            variant = Variant(D, causal, dtype)
            fwd = {w: load_forward_lse(forward_lse_config(D), variant, q.device, write_lse=w) for w in (True, False)}
            out = torch.empty_like(q)
            row["fwd_lse_us"] = time_op(lambda: fwd[True](q, k, v, out, workspace=lse, checked=False), reps, flush)
            row["fwd_plain_us"] = time_op(lambda: fwd[False](q, k, v, out, checked=False), reps, flush)
        except Exception as exc:  # noqa: BLE001
            row["errors"].append(f"forward timing: {type(exc).__name__}: {exc}")
        del q, k, v, do, o, lse, dq, dk, dv, dsum, acc
        torch.cuda.empty_cache()
        if row["ours"]:
            best = min(row["ours"], key=row["ours"].get)
            us = row["ours"][best]
            row.update(best=best, best_us=us, tflops=flops / us / 1e6)
        rows.append(row)

        def fmt(x: float | None, spec: str = "9.1f") -> str:
            return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))

        best_us = row.get("best_us")
        ratio = lambda other: (other / best_us) if other and best_us else None  # noqa: E731
        lse_cost = (row["fwd_lse_us"] / row["fwd_plain_us"]) if row.get("fwd_plain_us") else None
        print(f"{shape_label:>22s} {str(causal):>6s} {dtype:>5s} {row.get('best', '-'):>14s} {fmt(best_us)} "
              f"{fmt(row.get('tflops'), '6.0f')} {fmt(row.get('flash'))} {fmt(row.get('cudnn'))} "
              f"{fmt(ratio(row.get('flash')), '10.2f')} {fmt(ratio(row.get('cudnn')), '10.2f')} {fmt(lse_cost, '10.3f')}",
              flush=True)
        for err in row["errors"]:
            print(f"    {err}")
    print("ratios: SDPA backend's time / ours (above 1: ours is faster); fwd lse/no: WRITE_LSE=1 / WRITE_LSE=0 forward time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("backward_gpu_check.json"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--skip-correctness", action="store_true", help="time every configuration without the grid")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--configs", help="comma-separated configuration names (e.g. t64n128,D128:m32n64); default all")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: fp16,bf16")
    args = parser.parse_args(argv)
    configs = selected(args.configs.split(",") if args.configs else None)
    dtypes = tuple(args.dtypes.split(","))
    if not configs or not set(dtypes) <= set(DTYPES):
        print("backward_gpu_check: --configs names no configuration or --dtypes is not fp16/bf16", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print("backward_gpu_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    arch = device_arch(0)
    report: dict[str, Any] = {"device": props.name, "arch": arch, "torch": torch.__version__}
    print(f"{props.name} ({arch}), torch {torch.__version__}")
    precompile(arch, configs)
    if args.skip_correctness:
        passed = {(d, n): True for d, named in configs.items() for n in named}
    else:
        passed = correctness(report, configs, dtypes)
    report["passed"] = {f"D{d} {n}": ok for (d, n), ok in passed.items()}
    if not args.skip_timing:
        timing(report, passed, args.reps, configs, dtypes)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
