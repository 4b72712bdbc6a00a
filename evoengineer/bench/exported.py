"""An exported module timed as a user calls it, against torch's SDPA: the rows (shape, dtype,
causal) and what is timed on each (``calls``), the targets on them (``targets``).

On a row: evo (``module.attention``, the fast path), evo op (``torch.ops.<ns>.attention``,
through the dispatcher), sdpa (``F.scaled_dot_product_attention``, torch's own backend
choice), each interleaved in rounds, and fa4 (flash-attn-4's ``flash_attn.cute``, on (B, S, H, D)
copies of the same inputs) where it is installed; then sdpa flash|cudnn|efficient, each backend
forced, once (a reference; the sdpa_kernel context costs host time of its own). A decode row
(q_len 1) also reads as bandwidth: the bytes of K and V over each device time (``kv_gbs``),
against the GPU's memory bandwidth (``hbm_peak_gbs``).
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .calls import block_lines, combine_rounds, measure_rounds, speedups
from .rotation import attention_set_bytes, cold_set_count

SHAPES = [  # name, (B, H, H_kv, S_q, S_k, D), causal flags
    ("B1 H8 S512 D64", (1, 8, 8, 512, 512, 64), (False, True)),
    ("B4 H16 S2048 D64", (4, 16, 16, 2048, 2048, 64), (False, True)),
    ("B4 H16 S2048 D128", (4, 16, 16, 2048, 2048, 128), (False, True)),
    ("B8 H32 S1/4096 D128", (8, 32, 32, 1, 4096, 128), (False,)),         # decode: q_len 1 over the cache
    ("B8 H32/8 S1/4096 D128", (8, 32, 8, 1, 4096, 128), (False,)),
    ("B2 H28/4 S1/6000 D128", (2, 28, 4, 1, 6000, 128), (False,)),      # a few sequences over a long cache
    ("B4 H16 S1/4096 D64", (4, 16, 16, 1, 4096, 64), (False,)),
    ("B64 H32/8 S1/2048 D128", (64, 32, 8, 1, 2048, 128), (False,)),
    ("B1 H32 S1/32768 D128", (1, 32, 32, 1, 32768, 128), (False,)),
    ("B2 H32/8 S2048 D128 GQA", (2, 32, 8, 2048, 2048, 128), (False, True)),
    ("B1 H32 S8192 D128", (1, 32, 32, 8192, 8192, 128), (False, True)),
]
DTYPES = ("fp16", "bf16")
BACKENDS = ("flash", "cudnn", "efficient")
COLUMNS = ("device_us", "device_spread_us", "eager_us", "eager_spread_us", "overhead_us", "host_us", "sync_us",
           "graph_us", "graph1_us")
ROUNDS = 3               # interleaved rounds of evo, evo op and sdpa (forced backends: once, after them)
PAIRED = ("evo", "evo op", "sdpa", "fa4")
"""Implementations interleaved in rounds (fa4 where installed); the forced SDPA backends are timed once after."""


def decode_shapes() -> list[tuple]:
    """The rows of ``SHAPES`` with one query (decode over a K/V cache)."""
    return [shape for shape in SHAPES if shape[1][3] == 1]


def kv_bytes(dims: tuple, element_bytes: int = 2) -> int:
    """Bytes of K and V a call over ``dims`` (B, H, H_kv, S_q, S_k, D) reads at least."""
    batch, _, heads_kv, _, seq_k, head_dim = dims
    return 2 * batch * heads_kv * seq_k * head_dim * element_bytes


def hbm_peak_gbs(device: int = 0) -> float | None:
    """The GPU's memory bandwidth in GB/s (double data rate x bus width), None where the driver
    does not tell."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        clock_khz = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, device)
        bus_bits = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, device)
    except Exception:  # noqa: BLE001 - the figure is a reference only
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def fa4_available() -> bool:
    """Whether flash-attn-4 (``flash_attn.cute``) can be imported."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: no fa4 column
        return False
    return True


BANDWIDTH_IMPLS = ("evo", "sdpa", "fa4")


def bandwidth_line(rows: list[dict], kv: int, peak: float | None) -> str:
    """A decode row's K/V bandwidth by device time (evo, sdpa, fa4), within 80 columns:
    ``  K+V 24.6 MB, GB/s (% of 3352): evo 2410 (72%), sdpa 1080 (32%), fa4 2000 (60%)``."""
    parts = []
    for r in rows:
        if r["status"] == "ok" and r["impl"] in BANDWIDTH_IMPLS:
            gbs = kv / (r["device_us"] * 1e-6) / 1e9
            parts.append(f"{r['impl']} {gbs:.0f}" + (f" ({gbs / peak:.0%})" if peak else ""))
    return f"  K+V {kv / 1e6:.1f} MB, GB/s" + (f" (% of {peak:.0f})" if peak else "") + ": " + ", ".join(parts)


def load_module(directory: Path) -> Any:
    """The module of an export directory: the runtime package beside kernel.json (named as it says),
    or the single file of an older export."""
    info = json.loads((directory / "kernel.json").read_text())
    name = info.get("module", "evo_attention")
    package = directory / name
    spec = (importlib.util.spec_from_file_location(name, package / "__init__.py", submodule_search_locations=[str(package)])
            if package.is_dir() else importlib.util.spec_from_file_location(name, directory / f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def skip_reason(module: Any, dtype: str, dims: tuple, causal: bool) -> str:
    """Why the export has no kernel for a row ('' where it has one)."""
    _, heads, heads_kv, _, _, head_dim = dims
    if dtype not in module.DTYPES:
        return f"the export has no {dtype} kernels"
    if (dtype, head_dim, causal) not in module.DISPATCH:
        return f"the export has no {dtype} D{head_dim}{' causal' if causal else ''} kernel"
    if heads != heads_kv and not module.GQA:
        return "the export's kernels take no K/V head count (no GQA)"
    return ""


def make_inputs(dims: tuple, dtype: Any, sets: int, seed: int = 0) -> list[tuple[Any, Any, Any]]:
    """``sets`` input sets (q, k, v) of ``dims`` (B, H, H_kv, S_q, S_k, D), standard normal."""
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


def implementations(module: Any, causal: bool, gqa: bool, sets: list[tuple] | None = None) -> dict[str, Callable[..., Any]]:
    """name -> call (q, k, v): the export (``evo``), its custom op, SDPA, flash-attn-4 (``fa4``, on
    (B, S, H, D) copies of ``sets`` made here, where it is installed and ``sets`` given), each
    SDPA backend forced."""
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
    if sets is not None and fa4_available():
        from flash_attn.cute import flash_attn_func

        copies = {id(q): tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) for q, k, v in sets}
        impls["fa4"] = lambda q, k, v: flash_attn_func(*copies[id(q)], causal=causal)
    for backend in BACKENDS:
        impls[f"sdpa {backend}"] = forced(backend)
    return impls


def max_error(module: Any, sets: list[tuple], causal: bool, gqa: bool) -> float:
    """Largest |error| of the export against fp32 SDPA on the first input set."""
    import torch.nn.functional as F

    q, k, v = sets[0]
    out = module.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=gqa)
    return float((out.float() - ref).abs().max())


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
    workspace = torch.zeros(max(1, plan["workspace_bytes"] // 4), dtype=torch.float32, device="cuda")
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
    strides = module.arguments.element_strides
    values = module.arguments.scalar_values(batch, heads, k.shape[1], seq_q, k.shape[2], strides(q), strides(k),
                                            strides(v), strides(q), module.LOG2E / math.sqrt(head_dim))
    arguments = plan["arguments"]
    values.update(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), O=arguments.O, WS=arguments.WS,
                  kv_splits=plan.get("kv_splits", 1))
    return tuple(kinds[kind](values[name]) for name, kind in module.KERNELS[plan["kernel"]]["args"])


def measure_export(module: Any, shapes: list[tuple], dtypes: list[str], calls: int, repetitions: int, rounds: int,
                   backends: bool = True, say: Callable[[str], None] = print, peers: bool = True
                   ) -> tuple[list[dict], list[str]]:
    """Every row of ``shapes`` x ``dtypes`` x causal flags measured (``say`` gets each row's block
    of lines, and each skipped row's note): (result rows, one per implementation, and notes).
    ``peers``: fa4 beside SDPA where it is installed."""
    import torch

    peak = hbm_peak_gbs()

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
                    say(notes[-1])
                    continue
                batch, heads, heads_kv, seq_q, seq_k, head_dim = dims
                gqa = heads != heads_kv
                sets = make_inputs(dims, dtype, cold_set_count(attention_set_bytes(*dims)))
                plan = module.explain(*sets[0], is_causal=causal, enable_gqa=gqa)
                err = max_error(module, sets, causal, gqa)
                impls = {k: fn for k, fn in implementations(module, causal, gqa, sets if peers else None).items()
                         if backends or not k.startswith("sdpa ")}
                per_round = measure_rounds(impls, sets, calls, max(5, repetitions // rounds), rounds, PAIRED)
                rows = [combine_rounds(impl, per_round[impl]) for impl in impls]
                ratio = speedups(rows)
                versus_fa4 = speedups(rows, theirs="fa4")
                splits = f" ({plan.get('kv_splits', 1)} K/V splits)" if plan.get("kv_splits", 1) > 1 else ""
                for line in block_lines(f"{title}: {plan['config'][:6]} {plan['short']}{splits}", rows, ratio, err):
                    say(line)
                if versus_fa4:
                    say(f"  ×fa4 device {versus_fa4['device_us']:.2f} eager {versus_fa4['eager_us']:.2f}")
                kv = kv_bytes(dims) if seq_q == 1 else 0
                if kv:
                    say(bandwidth_line(rows, kv, peak))
                for r in rows:
                    results.append({"shape": name, "dtype": dtype_name, "causal": causal, "batch": batch, "heads": heads,
                                    "heads_kv": heads_kv, "seq_q": seq_q, "seq_k": seq_k, "head_dim": head_dim,
                                    "config": plan["config"], "kv_splits": plan.get("kv_splits", 1), "max_abs_err": err, **r,
                                    **({"kv_bytes": kv, "kv_gbs": kv / (r["device_us"] * 1e-6) / 1e9,
                                        **({"kv_hbm_fraction": kv / (r["device_us"] * 1e-6) / 1e9 / peak} if peak else {})}
                                       if kv and r["status"] == "ok" else {}),
                                    **({f"speedup_{k}": v for k, v in ratio.items() if not k.startswith(("overhead", "graph_per"))}
                                       if r["impl"] == "evo" else {}),
                                    **({f"speedup_fa4_{k}": versus_fa4[k] for k in ("device_us", "eager_us")}
                                       if r["impl"] == "evo" and versus_fa4 else {})})
                del sets
                torch.cuda.empty_cache()
    return results, notes


def write_results(out: Path, doc: dict, results: list[dict]) -> None:
    """``results.json`` (``doc``) and ``results.csv`` (a line per result row) under ``out``."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    fields = ["shape", "dtype", "causal", "impl", "status", *COLUMNS, "kv_gbs", "kv_splits", "max_abs_err", "config",
              "reason"]
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow({f: (f"{r[f]:.3f}" if isinstance(r.get(f), float) else r.get(f, "")) for f in fields})
