"""An exported module as a user calls it, against torch.nn.functional.scaled_dot_product_attention.

Exports nothing: give it an export directory (``evoengineer export RUN ... --out DIR``).

    python benchmarks/exported_vs_sdpa.py --module best/ --out bench/
    python benchmarks/exported_vs_sdpa.py --module best/ --dtype fp16 --shape "B1 H8 S512 D64" --quick

For each shape, dtype and causal flag (a row is skipped, with a note, where the export has
no kernel for its dtype / head dim, or no grouped-query attention), one run times:

- ``evo``: ``module.attention`` (the fast path), ``evo op``: ``torch.ops.<ns>.attention``
  (the custom op, through the dispatcher), ``sdpa``: F.scaled_dot_product_attention with
  torch's own backend choice (nothing forced), and ``sdpa flash|cudnn|efficient``: each
  backend forced (reference rows; the sdpa_kernel context costs host time of its own);
- **device µs**: the median of CUDA-graph replays of many launches, events around each
  replay, inputs rotated over sets larger than twice the L2 (evoengineer's ``time_graph``,
  the search's own timer);
- **eager µs**: wall time per call of N back-to-back calls with one synchronize at the end;
  **overhead** = eager − device (> 0 where the host cannot keep the GPU busy);
- **host µs**: the CPU time a call takes to return (N calls on an idle GPU, before the
  synchronize); **sync µs**: a call plus torch.cuda.synchronize(), per call (latency);
- **graph µs**: one call captured in a CUDA graph, the graph replayed N times back to
  back, events around them: what a captured model gets per call.

Speedups are SDPA's time / ours (> 1: ours faster). The targets: eager speedup >= 1 where
the device speedup is, ours' overhead and host time <= SDPA's, graph speedup within 5% of
the device speedup. ``--launch-paths`` also times the raw launch calls the module could use
(cupy.cuda.driver.launchKernel, which it uses; cuda-bindings' cuLaunchKernel; a cupy
RawKernel call). Tables fit 80 columns; ``--out`` gets results.json and results.csv.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

SHAPES = [  # name, (B, H, H_kv, S_q, S_k, D), causal flags
    ("B1 H8 S512 D64", (1, 8, 8, 512, 512, 64), (False, True)),
    ("B4 H16 S2048 D64", (4, 16, 16, 2048, 2048, 64), (False, True)),
    ("B4 H16 S2048 D128", (4, 16, 16, 2048, 2048, 128), (False, True)),
    ("B8 H32 S1/4096 D128", (8, 32, 32, 1, 4096, 128), (False,)),         # decode: q_len 1 over the cache
    ("B8 H32/8 S1/4096 D128", (8, 32, 8, 1, 4096, 128), (False,)),
    ("B2 H32/8 S2048 D128 GQA", (2, 32, 8, 2048, 2048, 128), (False, True)),
    ("B1 H32 S8192 D128", (1, 32, 32, 8192, 8192, 128), (False, True)),
]
DTYPES = ("fp16", "bf16")
BACKENDS = ("flash", "cudnn", "efficient")
COLUMNS = ("device_us", "eager_us", "overhead_us", "host_us", "sync_us", "graph_us")


def load_module(directory: Path) -> Any:
    info = json.loads((directory / "kernel.json").read_text())
    name = info.get("module", "evo_attention")
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def skip_reason(module: Any, dtype: str, dims: tuple, causal: bool) -> str:
    _, heads, heads_kv, _, _, head_dim = dims
    if dtype not in module.DTYPES:
        return f"the export has no {dtype} kernels"
    if (dtype, head_dim, causal) not in module.DISPATCH:
        return f"the export has no {dtype} D{head_dim}{' causal' if causal else ''} kernel"
    if heads != heads_kv and not module.GQA:
        return "the export's kernels take no K/V head count (no GQA)"
    return ""


def make_inputs(dims: tuple, dtype: Any, sets: int, seed: int = 0) -> list[tuple[Any, Any, Any]]:
    import torch

    batch, heads, heads_kv, seq_q, seq_k, head_dim = dims
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(sets):
        q = torch.randn(batch, heads, seq_q, head_dim, generator=gen, device="cuda", dtype=dtype)
        k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen, device="cuda", dtype=dtype)
        v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen, device="cuda", dtype=dtype)
        out.append((q, k, v))
    return out


def implementations(module: Any, causal: bool, gqa: bool) -> dict[str, Callable[..., Any]]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    op = module.attention_op

    def forced(backend: str) -> Callable[..., Any]:
        def call(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel([chosen[backend]]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return call

    impls: dict[str, Callable[..., Any]] = {
        "evo": lambda q, k, v: module.attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "evo op": lambda q, k, v: op(q, k, v, causal, None, gqa),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
    }
    for backend in BACKENDS:
        impls[f"sdpa {backend}"] = forced(backend)
    return impls


def eager_times(fn: Callable[..., Any], args: tuple, calls: int) -> dict[str, float]:
    """eager (back-to-back, one sync), host (time to return, idle GPU), sync (call + sync) in µs."""
    import torch

    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / calls * 1e6
    hosts = []
    for _ in range(5):
        torch.cuda.synchronize()
        n = min(calls, 64)
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        hosts.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    syncs = []
    for _ in range(max(10, calls // 4)):
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        syncs.append((time.perf_counter() - start) * 1e6)
    return {"eager_us": eager, "host_us": min(hosts), "sync_us": statistics.median(syncs)}


def graph_time(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """One call captured in a CUDA graph, replayed ``calls`` times back to back: µs per replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn(*args)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return statistics.median(samples)


def measure(name: str, fn: Callable[..., Any], sets: list[tuple], calls: int, repetitions: int) -> dict:
    import torch

    from evoengineer.gpu.timing import time_graph

    row: dict[str, Any] = {"impl": name}
    try:
        device = time_graph([lambda s=s: fn(*s) for s in sets], repetitions=repetitions, warmup=5)
        row["device_us"] = device.median_us
        row.update(eager_times(fn, sets[0], calls))
        row["overhead_us"] = row["eager_us"] - row["device_us"]
        row["graph_us"] = graph_time(fn, sets[0], calls)
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a backend that does not take the shape is a row, not a crash
        torch.cuda.synchronize()
        row = {"impl": name, "status": "unsupported", "reason": str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__}
    return row


def max_error(module: Any, sets: list[tuple], causal: bool, gqa: bool) -> float:
    import torch.nn.functional as F

    q, k, v = sets[0]
    out = module.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=gqa)
    return float((out.float() - ref).abs().max())


def speedups(rows: list[dict]) -> dict[str, float | None]:
    ours = next((r for r in rows if r["impl"] == "evo" and r["status"] == "ok"), None)
    sdpa = next((r for r in rows if r["impl"] == "sdpa" and r["status"] == "ok"), None)
    if not ours or not sdpa:
        return {}
    out = {c: sdpa[c] / ours[c] for c in ("device_us", "eager_us", "graph_us", "host_us") if ours[c] > 0}
    out["overhead_evo_us"], out["overhead_sdpa_us"] = ours["overhead_us"], sdpa["overhead_us"]
    return out


def print_block(console: Any, title: str, rows: list[dict], ratio: dict, err: float | None) -> None:
    console.print(f"[bold]{title}[/]")
    console.print(f"  {'impl':<15}{'dev µs':>9}{'eager µs':>10}{'ovh µs':>8}{'host µs':>9}{'sync µs':>9}{'graph µs':>10}")
    for r in rows:
        if r["status"] != "ok":
            console.print(f"  {r['impl']:<15}[dim]{r.get('reason', r['status'])[:60]}[/]")
            continue
        console.print(f"  {r['impl']:<15}{r['device_us']:>9.1f}{r['eager_us']:>10.1f}{r['overhead_us']:>8.1f}"
                      f"{r['host_us']:>9.1f}{r['sync_us']:>9.1f}{r['graph_us']:>10.1f}")
    if ratio:
        console.print(f"  ×sdpa device {ratio['device_us']:.2f} eager {ratio['eager_us']:.2f} graph {ratio['graph_us']:.2f} "
                      f"host {ratio['host_us']:.2f}; overhead {ratio['overhead_evo_us']:.1f} vs {ratio['overhead_sdpa_us']:.1f} µs")
    if err is not None:
        console.print(f"  max abs error against fp32 SDPA: {err:.1e}")


def launch_paths(module: Any, dtype: Any, calls: int) -> list[dict]:
    """Host µs per raw launch of one kernel, three ways (the launch queue stays short of full)."""
    import torch

    q, k, v = make_inputs((1, 8, 8, 512, 512, 64), dtype, 1)[0]
    try:
        plan = module.explain(q, k, v)
    except ValueError as exc:
        return [{"path": "-", "error": f"B1 H8 S512 D64: {exc}"}]
    handle, grid, block, smem = plan["handles"][0], *(plan["launches"][0][f] for f in ("grid", "block", "smem"))
    params = plan["params_address"]
    # the raw launches write into buffers of our own (the plan's pointers are those of its last call)
    result = torch.empty_like(q)
    workspace = torch.empty(max(1, plan["workspace_bytes"] // 4), dtype=torch.float32, device="cuda")
    arguments = plan["arguments"]
    arguments.Q, arguments.K, arguments.V, arguments.O, arguments.WS = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), result.data_ptr(), workspace.data_ptr())
    out = []

    def timed(name: str, launch: Callable[[], Any]) -> None:
        try:
            for _ in range(5):
                launch()
            torch.cuda.synchronize()
            best = math.inf
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    launch()
                best = min(best, (time.perf_counter() - start) / calls * 1e6)
                torch.cuda.synchronize()
            out.append({"path": name, "host_us": best})
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            out.append({"path": name, "error": str(exc).strip().splitlines()[0][:120]})

    import cupy

    stream = torch.cuda.current_stream().cuda_stream
    launch = cupy.cuda.driver.launchKernel
    timed("cupy.cuda.driver.launchKernel (the module's)", lambda: launch(handle, *grid, *block, smem, stream, params, 0))
    try:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # older cuda-python
        fn, st = cu.CUfunction(init_value=handle), cu.CUstream(init_value=stream)
        timed("cuda-bindings cuLaunchKernel", lambda: cu.cuLaunchKernel(fn, *grid, *block, smem, st, params, 0))
    except ImportError:
        out.append({"path": "cuda-bindings cuLaunchKernel", "error": "cuda-bindings not installed"})
    if any(kind == "tmap" for _, kind in module.KERNELS[plan["kernel"]]["args"]):
        out.append({"path": "cupy RawKernel call (args prebuilt)", "error": "the kernel takes tensor maps (TMA), "
                    "which are no CuPy argument kind"})
    else:
        values = _cupy_args(module, plan, q, k, v)
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; torch streams lack its replacement's protocol
            warnings.simplefilter("ignore", DeprecationWarning)
            ext = cupy.cuda.ExternalStream(stream)
        raw = plan["raw_kernels"][0]
        timed("cupy RawKernel call (args prebuilt)", lambda: raw(tuple(grid), tuple(block), values, shared_mem=smem, stream=ext))
    torch.cuda.synchronize()
    del result, workspace
    timed("the module's attention() (whole call)", lambda: module.attention(q, k, v))
    timed("torch.empty_like (its output allocation)", lambda: torch.empty_like(q))
    return out


def _cupy_args(module: Any, plan: dict, q: Any, k: Any, v: Any) -> tuple:
    """The kernel's arguments as numpy scalars (how the old module passed them), in signature
    order, with the output and workspace pointers the benchmark set in ``plan['arguments']``."""
    import numpy as np

    kinds = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "f32": np.float32}
    batch, heads, seq_q, head_dim = q.shape
    values = module._scalar_args(batch, heads, k.shape[1], seq_q, k.shape[2], module._strides(q), module._strides(k),
                                 module._strides(v), module._strides(q), module.LOG2E / math.sqrt(head_dim))
    arguments = plan["arguments"]
    values.update(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), O=arguments.O, WS=arguments.WS)
    return tuple(kinds[kind](values[name]) for name, kind in module.KERNELS[plan["kernel"]]["args"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, required=True, help="an export directory (kernel.json and the module)")
    parser.add_argument("--out", type=Path, help="write results.json and results.csv here")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="fp16 and/or bf16 (default both)")
    parser.add_argument("--shape", action="append", help="only these shapes (names as listed in SHAPES, repeatable)")
    parser.add_argument("--calls", type=int, default=200, help="calls per eager and graph measurement")
    parser.add_argument("--repetitions", type=int, default=50, help="graph replays per device-time measurement")
    parser.add_argument("--quick", action="store_true", help="fewer calls and repetitions")
    parser.add_argument("--no-backends", action="store_true", help="skip the forced SDPA backend rows")
    parser.add_argument("--launch-paths", action="store_true", help="also time the raw launch calls")
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console

    console = Console(highlight=False, width=80)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU found on this machine", file=sys.stderr)
        return 2
    if not (args.module / "kernel.json").exists():
        print(f"error: {args.module}: no kernel.json; give an export directory (evoengineer export ... --out DIR)", file=sys.stderr)
        return 2
    if args.quick:
        args.calls, args.repetitions = min(args.calls, 50), min(args.repetitions, 15)
    module = load_module(args.module)
    from evoengineer.gpu.timing import input_sets_for_cold_l2

    dtypes = args.dtype or list(DTYPES)
    shapes = [s for s in SHAPES if not args.shape or s[0] in args.shape]
    unknown = set(args.shape or ()) - {s[0] for s in SHAPES}
    if unknown:
        print(f"error: --shape {sorted(unknown)[0]!r}: not one of {', '.join(s[0] for s in SHAPES)}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    console.print(f"{props.name}, torch {torch.__version__}; module {args.module} ({len(module.CONFIGS)} configs, "
                  f"op {module.OP_NAMESPACE}); speedups are SDPA / ours")
    results: list[dict] = []
    notes: list[str] = []
    for name, dims, flags in shapes:
        for dtype_name in dtypes:
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
            for causal in flags:
                title = f"{name}{' causal' if causal else ''} {dtype_name}"
                why = skip_reason(module, dtype_name, dims, causal)
                if why:
                    notes.append(f"{title}: skipped, {why}")
                    console.print(f"[dim]{title}: skipped, {why}[/]")
                    continue
                batch, heads, heads_kv, seq_q, seq_k, head_dim = dims
                gqa = heads != heads_kv
                set_bytes = 2 * head_dim * (2 * batch * heads * seq_q + 2 * batch * heads_kv * seq_k)
                sets = make_inputs(dims, dtype, input_sets_for_cold_l2(set_bytes, True))
                plan = module.explain(*sets[0], is_causal=causal, enable_gqa=gqa)
                err = max_error(module, sets, causal, gqa)
                rows = []
                for impl, fn in implementations(module, causal, gqa).items():
                    if args.no_backends and impl.startswith("sdpa "):
                        continue
                    rows.append(measure(impl, fn, sets, args.calls, args.repetitions))
                ratio = speedups(rows)
                print_block(console, f"{title}: {plan['config'][:6]} {plan['short']}", rows, ratio, err)
                for r in rows:
                    results.append({"shape": name, "dtype": dtype_name, "causal": causal, "batch": batch, "heads": heads,
                                    "heads_kv": heads_kv, "seq_q": seq_q, "seq_k": seq_k, "head_dim": head_dim,
                                    "config": plan["config"], "max_abs_err": err, **r,
                                    **({f"speedup_{k}": v for k, v in ratio.items() if not k.startswith("overhead")}
                                       if r["impl"] == "evo" else {})})
                del sets
                torch.cuda.empty_cache()
    paths = launch_paths(module, torch.float16 if "fp16" in module.DTYPES else torch.bfloat16, args.calls) if args.launch_paths else []
    if paths:
        console.print("[bold]launch paths[/] (host µs per call, B1 H8 S512 D64, GPU not saturated)")
        for p in paths:
            console.print(f"  {p['path']:<48}" + (f"{p['host_us']:>8.2f}" if "host_us" in p else f"  {p['error']}"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"gpu": props.name, "torch": torch.__version__, "module": str(args.module), "op": module.OP_NAMESPACE,
               "rows": results, "notes": notes, "launch_paths": paths}
        (args.out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
        fields = ["shape", "dtype", "causal", "impl", "status", *COLUMNS, "max_abs_err", "config", "reason"]
        with (args.out / "results.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for r in results:
                writer.writerow({f: (f"{r[f]:.3f}" if isinstance(r.get(f), float) else r.get(f, "")) for f in fields})
        console.print(f"wrote {args.out / 'results.json'} and {args.out / 'results.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
