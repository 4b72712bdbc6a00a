"""Time an exported module as a user calls it, against torch's SDPA.

Exports nothing: give it an export directory (evoengineer export RUN --out DIR).

    python benchmarks/exported_vs_sdpa.py --module best/ --out bench/
    python benchmarks/exported_vs_sdpa.py --module best/ --quick --dtype fp16 \\
        --shape "B1 H8 S512 D64"

A row is a shape, dtype and causal flag (skipped, with a note, where the export
has no kernel for its dtype / head dim, or no grouped-query attention). In it:

- evo: module.attention (the fast path); evo op: torch.ops.<ns>.attention (the
  custom op, through the dispatcher); sdpa: F.scaled_dot_product_attention with
  torch's own backend choice (nothing forced); sdpa flash|cudnn|efficient: each
  backend forced (reference; the sdpa_kernel context costs host time of its
  own).

Every measurement rotates over the same input sets, at least twice the L2 in
all (call i takes set i mod n), so that no call finds its inputs in L2. evo,
evo op and sdpa are measured in --rounds interleaved rounds (default 3; the
order reversed every other round), after a heat-up (~300 ms of their calls in
turn, so that round 1 starts as warm as the others). A round goes column by
column: the device time of each, then the eager loops of each, then the graphs
of each, so that the figures a ratio pairs are measured one right after the
other and a drift of the GPU's clock reaches both sides alike. A figure is the median over the
rounds, and the speedups the targets use are the medians of each round's
paired speedups. The forced backends (a reference) are measured once each,
after the rounds:

- device µs: evoengineer's time_graph, the search's own timer: the median of
  CUDA-graph replays of many launches, events around each replay; its spread
  is (p80 - p20) / 2 of those samples;
- eager µs: wall time per call of back-to-back calls with one synchronize at
  the end; 3 loops a round of max(--calls, ~30 ms of device time) calls (whole
  rotations over the sets), the median loop; spread: (max - min) / 2 of the
  loops of all rounds;
- overhead = eager - device (> 0 where the host cannot keep the GPU busy);
- host µs: the CPU time a call takes to return (up to 64 calls on an idle GPU,
  before the synchronize, best of 5); sync µs: a call plus a synchronize
  (latency; the median of max(10, --calls / 4));
- graph µs: a model step, one call per input set (whole rotations, at least 8
  calls) captured in ONE CUDA graph; the graph replayed back to back, events
  around the replays; µs per call, the median of 8 samples a round, each of
  >= 3 ms and >= --calls / 8 calls. Each sample is taken right before or
  after a sample as long of the device time's own graph: graph_per_device is
  the median of these pairs' ratios;
- graph1 µs (JSON, CSV and the ×sdpa line): one call per graph, one graph per
  input set, the graphs replayed in rotation; µs per call, the median of 2
  samples a round of >= --calls calls and ~10 ms each. Bounded by the graph launch for small kernels (the same few µs a
  replay, whoever's call it holds).

Speedups are SDPA's time / ours (> 1: ours faster). The summary at the end
checks evo against sdpa on each row, on the unrounded figures:

  (a) eager speedup >= 1 where the device speedup is >= 1 (other rows: n/a);
  (b) overhead ours <= SDPA's, where a difference within the noise counts as
      equal; noise = ours' and SDPA's eager spreads + their device spreads;
  (c) graph speedup within 5% of the device speedup: |graph/device - 1| <= 0.05.
      graph/device = (SDPA's graph / ours) / (SDPA's device / ours) = SDPA's
      graph_per_device / ours: taken so, each implementation's graph and device
      samples lie milliseconds apart, and a drift of the clock between the
      device and the graph columns of a round does not enter (c).

It counts the rows that meet each target and lists those that do not
(results.json: "targets"). --launch-paths also times the raw launch calls the
module could use (cupy.cuda.driver.launchKernel, which it uses; cuda-bindings'
cuLaunchKernel; a cupy RawKernel call). Tables fit 80 columns; --out gets
results.json and results.csv.
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
COLUMNS = ("device_us", "device_spread_us", "eager_us", "eager_spread_us", "overhead_us", "host_us", "sync_us",
           "graph_us", "graph1_us")
ROUNDS = 3               # interleaved rounds of evo, evo op and sdpa (forced backends: once, after them)
PAIRED = ("evo", "evo op", "sdpa")
HEAT_MS = 300.0          # before round 1: the paired implementations called in turn for about this wall time
HEAT_IN_FLIGHT = 4       # heat-up: passes queued ahead of the GPU at most (the work left at its end stays short)
EAGER_LOOPS = 3          # eager: loops measured per round, the median one reported
EAGER_LOOP_MS = 30.0     # each loop at least this much device time (and at least --calls calls)
GRAPH_SAMPLES = 2        # graph1: samples per round, the median one reported
GRAPH_SAMPLE_MS = 10.0   # each sample at least this much device time (and at least --calls calls)
GRAPH_PAIRS = 8          # graph: samples per round, each next to a device sample (the median one reported)
GRAPH_PAIR_MS = 3.0      # each graph and device sample at least this much device time (and --calls calls over the pairs)
GRAPH_MIN_CALLS = 8      # calls captured in the graph of a model step, at least
GRAPH_TOLERANCE = 0.05   # target (c): |graph speedup / device speedup - 1| at most this


def load_module(directory: Path) -> Any:
    info = json.loads((directory / "kernel.json").read_text())
    name = info.get("module", "evo_attention")
    package = directory / name  # the runtime package beside kernel.json (a single file in older exports)
    spec = (importlib.util.spec_from_file_location(name, package / "__init__.py", submodule_search_locations=[str(package)])
            if package.is_dir() else importlib.util.spec_from_file_location(name, directory / f"{name}.py"))
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


def loop_calls(calls: int, device_us: float, loop_ms: float, sets: int) -> int:
    """Calls in one timed loop: at least ``calls`` and enough for ~``loop_ms`` of device time at
    ``device_us`` per call, rounded up to whole rotations over ``sets`` input sets."""
    wanted = max(calls, math.ceil(loop_ms * 1e3 / max(device_us, 1e-3)), 1)
    return sets * math.ceil(wanted / sets)


def half_range(values: list[float]) -> float:
    """(max - min) / 2: the spread the benchmark reports for repeated loops or samples."""
    return (max(values) - min(values)) / 2 if values else 0.0


def eager_times(fn: Callable[..., Any], sets: list[tuple], calls: int, device_us: float) -> dict[str, Any]:
    """eager (back-to-back, one sync; median loop and its spread), host (time to return, idle GPU)
    and sync (call + sync) in µs; call i takes ``sets[i % len(sets)]``, as the device time does."""
    import torch

    for args in sets:  # warm-up, one call per set
        fn(*args)
    torch.cuda.synchronize()
    n = loop_calls(calls, device_us, EAGER_LOOP_MS, len(sets))
    order = [sets[i % len(sets)] for i in range(n)]
    loops = []
    for _ in range(EAGER_LOOPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for args in order:
            fn(*args)
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / n * 1e6)
    hosts = []
    n_host = min(calls, 64)
    for trial in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(n_host):
            fn(*sets[(trial * n_host + i) % len(sets)])
        hosts.append((time.perf_counter() - start) / n_host * 1e6)
        torch.cuda.synchronize()
    syncs = []
    for i in range(max(10, calls // 4)):
        args = sets[i % len(sets)]
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        syncs.append((time.perf_counter() - start) * 1e6)
    return {"eager_us": statistics.median(loops), "eager_spread_us": half_range(loops), "eager_loops_us": loops,
            "eager_calls": n, "host_us": min(hosts), "sync_us": statistics.median(syncs)}


def _replay_samples(runs: list[tuple[list[Any], int]], samples: int) -> list[list[float]]:
    """Per run (graphs replayed back to back in order, and the calls they hold), µs per call,
    events around it; the runs one right after the other, in reverse order every other sample,
    ``samples`` times."""
    import torch

    out: list[list[float]] = [[] for _ in runs]
    for k in range(samples):
        timed = []
        for i in (range(len(runs)) if k % 2 == 0 else reversed(range(len(runs)))):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for graph in runs[i][0]:
                graph.replay()
            b.record()
            timed.append((i, a, b))
        torch.cuda.synchronize()
        for i, a, b in timed:
            out[i].append(a.elapsed_time(b) * 1e3 / runs[i][1])
    return out


def graph_times(fn: Callable[..., Any], sets: list[tuple], calls: int, device_us: float) -> dict[str, Any]:
    """graph: one call per input set (whole rotations, at least GRAPH_MIN_CALLS) captured in one
    CUDA graph, a model step's graph, replayed back to back; each sample next to one of the device
    time's graph (time_graph's launches over the sets), whose ratio graph / device is
    ``graph_per_device`` (the median of the pairs). graph1: one call per graph, one graph per set,
    replayed in rotation (bounded by the graph launch for small kernels). µs per call."""
    import torch

    from evoengineer.gpu.timing import capture_graph, launches_per_sample

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in sets:  # warm-up off the capture
            fn(*args)
    stream.synchronize()
    ops = [lambda args=args: fn(*args) for args in sets]

    per_graph = len(sets) * math.ceil(GRAPH_MIN_CALLS / len(sets))
    step = capture_graph(ops, per_graph, stream)
    # a pair's two samples last alike: GRAPH_PAIR_MS at least, and --calls calls over the pairs
    sample_us = max(GRAPH_PAIR_MS * 1e3, calls / GRAPH_PAIRS * device_us)
    replays = max(1, math.ceil(sample_us / (per_graph * max(device_us, 1e-3))))
    launches = launches_per_sample(device_us, len(sets))
    device = capture_graph(ops, launches, stream)
    device_replays = max(1, math.ceil(sample_us / (launches * max(device_us, 1e-3))))
    with torch.cuda.stream(stream):
        step.replay()
        device.replay()
        torch.cuda.synchronize()
        samples, beside = _replay_samples([([step] * replays, replays * per_graph),
                                           ([device] * device_replays, device_replays * launches)], GRAPH_PAIRS)
    del step, device
    # graph1: the graphs share one memory pool, safe as they replay in the order of their capture
    pool = torch.cuda.graph_pool_handle()
    singles = [capture_graph([op], 1, stream, pool) for op in ops]
    n1 = loop_calls(calls, device_us, GRAPH_SAMPLE_MS, len(sets))
    order = [singles[i % len(singles)] for i in range(n1)]
    with torch.cuda.stream(stream):
        for graph in singles:
            graph.replay()
        torch.cuda.synchronize()
        samples1 = _replay_samples([(order, n1)], GRAPH_SAMPLES)[0]
    del order, singles
    return {"graph_us": statistics.median(samples), "graph_spread_us": half_range(samples), "graph_calls": per_graph,
            "graph_per_device": statistics.median(g / d for g, d in zip(samples, beside)),
            "graph_device_us": statistics.median(beside),
            "graph1_us": statistics.median(samples1), "graph1_spread_us": half_range(samples1)}


def synchronize() -> None:
    """Wait for the GPU (a seam: the CPU tests replace it)."""
    import torch

    torch.cuda.synchronize()


def _recorded_event() -> Any:
    """A CUDA event recorded on the current stream (a seam, as ``synchronize``)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def heat_up(fns: list[Callable[..., Any]], sets: list[tuple], ms: float = HEAT_MS) -> int:
    """Call ``fns`` in turn, back to back (pass i: each on ``sets[i % len(sets)]``), for about ``ms``
    of wall time, then synchronize; at most HEAT_IN_FLIGHT passes queued ahead of the GPU. One that
    raises leaves the heat-up (its measurement reports it). Returns the passes made."""
    live, pending, passes = list(fns), [], 0
    start = time.perf_counter()
    while live and time.perf_counter() - start < ms / 1e3:
        args = sets[passes % len(sets)]
        for fn in list(live):
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - measured (and reported) in the rounds
                live.remove(fn)
        passes += 1
        pending.append(_recorded_event())
        if len(pending) > HEAT_IN_FLIGHT:
            pending.pop(0).synchronize()
    synchronize()
    return passes


def device_times(fn: Callable[..., Any], sets: list[tuple], repetitions: int) -> dict[str, Any]:
    """device µs: evoengineer's time_graph over the sets (median, p20, p80, the spread (p80 - p20) / 2)."""
    from evoengineer.gpu.timing import time_graph

    device = time_graph([lambda s=s: fn(*s) for s in sets], repetitions=repetitions, warmup=5)
    return {"device_us": device.median_us, "device_p20_us": device.p20_us, "device_p80_us": device.p80_us,
            "device_spread_us": (device.p80_us - device.p20_us) / 2, "device_repetitions": device.repetitions}


def failed_row(name: str, exc: Exception) -> dict:
    """The row of an implementation whose measurement raised: unsupported, with the reason."""
    text = str(exc).strip()
    return {"impl": name, "status": "unsupported", "reason": text.splitlines()[0][:160] if text else type(exc).__name__}


def measure_columns(impls: dict[str, Callable[..., Any]], sets: list[tuple], calls: int,
                    repetitions: int) -> dict[str, dict]:
    """One round of ``impls``, column by column in their order: the device time of each, then the
    eager loops of each, then the graphs of each (eager and graph sized by the implementation's own
    device time). One that raises is ``unsupported`` for the round and skips the later columns."""
    rows: dict[str, dict] = {name: {"impl": name} for name in impls}

    def column(step: Callable[[dict, Callable[..., Any]], None]) -> None:
        for name, fn in impls.items():
            if rows[name].get("status") == "unsupported":
                continue
            try:
                step(rows[name], fn)
            except Exception as exc:  # noqa: BLE001 - a backend that does not take the shape is a row, not a crash
                synchronize()
                rows[name] = failed_row(name, exc)

    def eager(row: dict, fn: Callable[..., Any]) -> None:
        row.update(eager_times(fn, sets, calls, row["device_us"]))
        row["overhead_us"] = row["eager_us"] - row["device_us"]

    def graph(row: dict, fn: Callable[..., Any]) -> None:
        row.update(graph_times(fn, sets, calls, row["device_us"]))
        row["input_sets"] = len(sets)
        row["status"] = "ok"

    column(lambda row, fn: row.update(device_times(fn, sets, repetitions)))
    column(eager)
    column(graph)
    return rows


def measure(name: str, fn: Callable[..., Any], sets: list[tuple], calls: int, repetitions: int) -> dict:
    """One implementation's device, eager and graph figures, one after the other."""
    return measure_columns({name: fn}, sets, calls, repetitions)[name]


def measure_rounds(impls: dict[str, Callable[..., Any]], sets: list[tuple], calls: int, repetitions: int,
                   rounds: int) -> dict[str, list[dict]]:
    """Each implementation's measurements, in the order of ``impls``: a heat-up of the PAIRED ones,
    then ``rounds`` rounds of them (``measure_columns``, the order reversed every other round), then
    each other one (a forced backend) once with ``measure``."""
    paired = [name for name in impls if name in PAIRED]
    per_round: dict[str, list[dict]] = {name: [] for name in impls}
    if paired:
        heat_up([impls[name] for name in paired], sets, HEAT_MS)
    for r in range(rounds):
        order = paired[::-1] if r % 2 else paired
        for name, row in measure_columns({name: impls[name] for name in order}, sets, calls, repetitions).items():
            per_round[name].append(row)
    for name, fn in impls.items():
        if name not in PAIRED:
            per_round[name].append(measure(name, fn, sets, calls, repetitions))
    return per_round


ROUND_FIGURES = ("device_us", "device_spread_us", "eager_us", "overhead_us", "host_us", "sync_us", "graph_us",
                 "graph_per_device", "graph1_us")


def combine_rounds(impl: str, measured: list[dict]) -> dict:
    """One row from an implementation's rounds: each figure the median over the rounds (the
    rounds kept under "rounds"); the eager spread over the loops of all rounds, the device
    spread the larger of a round's and the rounds' own. A failed round makes the row failed."""
    failed = next((m for m in measured if m.get("status") != "ok"), None)
    if failed is not None or len(measured) == 1:
        return failed or measured[0]
    row: dict[str, Any] = {"impl": impl, "status": "ok", "rounds": [{c: m[c] for c in ROUND_FIGURES} for m in measured]}
    for column in ROUND_FIGURES:
        row[column] = statistics.median(m[column] for m in measured)
    row["overhead_us"] = row["eager_us"] - row["device_us"]
    row["eager_loops_us"] = [t for m in measured for t in m["eager_loops_us"]]
    row["eager_spread_us"] = half_range(row["eager_loops_us"])
    row["device_spread_us"] = max(row["device_spread_us"], half_range([m["device_us"] for m in measured]))
    for key in ("eager_calls", "graph_calls", "input_sets"):
        row[key] = measured[0][key]
    return row


def paired_speedup(ours: dict, sdpa: dict, column: str) -> float:
    """SDPA's time / ours in ``column``: the median of the rounds' paired ratios where both rows
    have the same rounds, else the ratio of the two figures."""
    a, b = ours.get("rounds"), sdpa.get("rounds")
    if a and b and len(a) == len(b):
        return statistics.median(s[column] / o[column] for o, s in zip(a, b))
    return sdpa[column] / ours[column]


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
    out = {c: paired_speedup(ours, sdpa, c) for c in ("device_us", "eager_us", "graph_us", "graph1_us", "host_us")
           if ours[c] > 0}
    out["overhead_evo_us"], out["overhead_sdpa_us"] = ours["overhead_us"], sdpa["overhead_us"]
    out["graph_per_device_evo"] = ours.get("graph_per_device", math.nan)
    out["graph_per_device_sdpa"] = sdpa.get("graph_per_device", math.nan)
    return out


def print_block(console: Any, title: str, rows: list[dict], ratio: dict, err: float | None) -> None:
    console.print(f"[bold]{title}[/]")
    console.print(f"  {'impl':<15}{'dev µs':>9}{'eager µs':>10}{'±':>6}{'ovh µs':>8}{'host µs':>9}{'sync µs':>9}"
                  f"{'graph µs':>10}")
    for r in rows:
        if r["status"] != "ok":
            console.print(f"  {r['impl']:<15}[dim]{r.get('reason', r['status'])[:60]}[/]")
            continue
        console.print(f"  {r['impl']:<15}{r['device_us']:>9.1f}{r['eager_us']:>10.1f}{r['eager_spread_us']:>6.1f}"
                      f"{r['overhead_us']:>8.1f}{r['host_us']:>9.1f}{r['sync_us']:>9.1f}{r['graph_us']:>10.1f}")
    if ratio:
        console.print(f"  ×sdpa device {ratio['device_us']:.2f} eager {ratio['eager_us']:.2f} graph {ratio['graph_us']:.2f} "
                      f"graph1 {ratio['graph1_us']:.2f} host {ratio['host_us']:.2f}")
        console.print(f"  overhead {ratio['overhead_evo_us']:.1f} µs, sdpa's {ratio['overhead_sdpa_us']:.1f} µs; "
                      f"graph / device {ratio['graph_per_device_evo']:.3f}, sdpa's {ratio['graph_per_device_sdpa']:.3f}")
    if err is not None:
        console.print(f"  max abs error against fp32 SDPA: {err:.1e}")


# -- the targets, evo against sdpa on each row (pure: no torch) ---------------------------


def row_label(shape: str, dtype: str, causal: bool) -> str:
    return f"{shape}{' causal' if causal else ''} {dtype}"


def overhead_noise_us(ours: dict, sdpa: dict) -> float:
    """The noise of ``overhead ours - overhead SDPA's``: each overhead is eager - device, so the sum
    of both eager spreads ((max - min) / 2 of the loops) and both device spreads ((p80 - p20) / 2)."""
    return sum(r.get("eager_spread_us", 0.0) + r.get("device_spread_us", 0.0) for r in (ours, sdpa))


def target_verdicts(ours: dict, sdpa: dict, tolerance: float = GRAPH_TOLERANCE) -> dict[str, dict]:
    """The three targets on one row, from the evo and sdpa measurements (dicts with device_us,
    eager_us, graph_us, overhead_us and the spreads; with "rounds", the speedups are the medians of
    the rounds' paired speedups and (c)'s deviation the median of the rounds' own):

    a: eager speedup >= 1 where the device speedup is >= 1 (``applies`` False and ``met`` None
       elsewhere);
    b: overhead ours <= SDPA's; a difference within ``overhead_noise_us`` counts as equal
       (verdict ``lower``, ``equal`` or ``higher``; met unless higher);
    c: |graph speedup / device speedup - 1| <= ``tolerance``. That deviation is SDPA's
       ``graph_per_device`` over ours, minus 1, where the rows have it (each side's graph samples
       over the device samples taken next to them: the same quotient, without the clock's drift
       between an implementation's device and graph measurements); else graph / device - 1.
    """
    device, eager, graph = (paired_speedup(ours, sdpa, c) for c in ("device_us", "eager_us", "graph_us"))
    applies = device >= 1.0
    noise = overhead_noise_us(ours, sdpa)
    difference = ours["overhead_us"] - sdpa["overhead_us"]
    verdict = "lower" if difference < -noise else "equal" if difference <= noise else "higher"
    a_rounds, b_rounds = ours.get("rounds"), sdpa.get("rounds")
    if a_rounds and b_rounds and len(a_rounds) == len(b_rounds):
        deviation = statistics.median(s["graph_per_device"] / o["graph_per_device"] - 1
                                      for o, s in zip(a_rounds, b_rounds))
    elif "graph_per_device" in ours and "graph_per_device" in sdpa:
        deviation = sdpa["graph_per_device"] / ours["graph_per_device"] - 1
    else:
        deviation = graph / device - 1
    return {
        "a": {"device_speedup": device, "eager_speedup": eager, "applies": applies,
              "met": eager >= 1.0 if applies else None},
        "b": {"overhead_evo_us": ours["overhead_us"], "overhead_sdpa_us": sdpa["overhead_us"],
              "difference_us": difference, "noise_us": noise, "verdict": verdict, "met": verdict != "higher"},
        "c": {"graph_speedup": graph, "device_speedup": device, "deviation": deviation,
              "met": abs(deviation) <= tolerance + 1e-12},
    }


def evaluate_targets(results: list[dict]) -> list[dict]:
    """One entry per row (shape, dtype, causal) in the order measured: its label and the three
    verdicts, or ``missing`` where evo or sdpa has no measurement on it."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["shape"], r["dtype"], r["causal"]), []).append(r)
    out = []
    for (shape, dtype, causal), rows in groups.items():
        entry: dict[str, Any] = {"row": row_label(shape, dtype, causal), "shape": shape, "dtype": dtype,
                                 "causal": causal}
        ours, sdpa = ({r["impl"]: r for r in rows if r.get("status") == "ok"}.get(k) for k in ("evo", "sdpa"))
        if ours is None or sdpa is None:
            entry["missing"] = "no evo measurement" if ours is None else "no sdpa measurement"
        else:
            entry.update(target_verdicts(ours, sdpa))
        out.append(entry)
    return out


def summarize_targets(entries: list[dict]) -> dict[str, dict]:
    """Per target: rows it applies to, rows that meet it, the labels of those that do not."""
    out = {}
    for key in "abc":
        rows = [e for e in entries if key in e and e[key]["met"] is not None]
        out[key] = {"rows": len(rows), "met": sum(1 for e in rows if e[key]["met"]),
                    "not_met": [e["row"] for e in rows if not e[key]["met"]]}
    out["b"]["equal"] = sum(1 for e in entries if "b" in e and e["b"]["verdict"] == "equal")
    out["missing"] = {"rows": len([e for e in entries if "missing" in e]),
                      "labels": [e["row"] for e in entries if "missing" in e]}
    return out


TARGET_NAMES = {
    "a": "eager ×sdpa >= 1 where device ×sdpa >= 1",
    "b": "overhead <= sdpa's, or equal within noise",
    "c": "graph ×sdpa within 5% of device ×sdpa",
}


def target_lines(entries: list[dict]) -> list[str]:
    """The summary as printed (plain text, at most 80 columns): a line per row with the figures
    and verdicts, then per target how many rows meet it and the rows that do not."""
    if not entries:
        return []
    mark = {True: "ok", False: "NO", None: "-"}
    width = max(len(e["row"]) for e in entries)  # the numbers right-aligned after it bring a space
    lines = ["targets, evo against sdpa (×: SDPA's time / ours)",
             "  a: eager ×sdpa >= 1 where device ×sdpa >= 1 (-: device < 1)",
             "  b: overhead µs, ours and sdpa's; noise: the sum of both eager and",
             "     device spreads; <, =, >: lower, equal within noise, higher",
             "  c: |graph ×sdpa / device ×sdpa - 1| <= 5%, from each side's graph over",
             "     the device samples taken beside it (×gr: the graph medians' ratio)",
             f"  {'row':<{width}}{'×dev':>5}{'×eag':>5}{'a':>3}{'ovh':>7}{'sdpa':>7}{'noise':>6}{'b':>2}"
             f"{'×gr':>5}{'c':>3}"]
    sign = {"lower": "<", "equal": "=", "higher": ">"}
    for e in entries:
        if "missing" in e:
            lines.append(f"  {e['row']:<{width}}{e['missing']}")
            continue
        a, b, c = e["a"], e["b"], e["c"]
        lines.append(f"  {e['row']:<{width}}{a['device_speedup']:>5.2f}{a['eager_speedup']:>5.2f}{mark[a['met']]:>3}"
                     f"{b['overhead_evo_us']:>7.1f}{b['overhead_sdpa_us']:>7.1f}{b['noise_us']:>6.1f}"
                     f"{sign[b['verdict']]:>2}{c['graph_speedup']:>5.2f}{mark[c['met']]:>3}")
    summary = summarize_targets(entries)
    for key in "abc":
        s = summary[key]
        extra = f" ({s['equal']} of them equal)" if key == "b" and s["equal"] else ""
        lines.append(f"({key}) {TARGET_NAMES[key]}: {s['met']} of {s['rows']} rows{extra}")
        for e in entries:
            if "missing" in e or e[key]["met"] is not False:
                continue
            t = e[key]
            if key == "a":
                detail = f"device {t['device_speedup']:.3f}, eager {t['eager_speedup']:.3f}"
            elif key == "b":
                detail = (f"{t['overhead_evo_us']:.1f} vs {t['overhead_sdpa_us']:.1f} µs, "
                          f"+{t['difference_us']:.1f} > noise {t['noise_us']:.1f}")
            else:
                detail = f"graph {t['graph_speedup']:.2f}, device {t['device_speedup']:.2f} ({t['deviation']:+.1%})"
            lines.append(f"    not met: {e['row']}: {detail}")
    if summary["missing"]["rows"]:
        n = summary["missing"]["rows"]
        lines.append(f"not evaluated: {n} row{'s' if n > 1 else ''} without an evo or sdpa measurement")
    return lines


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
    values.update(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), O=arguments.O, WS=arguments.WS)
    return tuple(kinds[kind](values[name]) for name, kind in module.KERNELS[plan["kernel"]]["args"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, required=True, help="an export directory (kernel.json and the module)")
    parser.add_argument("--out", type=Path, help="write results.json and results.csv here")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="fp16 and/or bf16 (default both)")
    parser.add_argument("--shape", action="append", help="only these shapes (names as listed in SHAPES, repeatable)")
    parser.add_argument("--calls", type=int, default=200, help="calls per eager loop, per graph1 sample and over a "
                        "round's graph samples, at least")
    parser.add_argument("--repetitions", type=int, default=50, help="graph replays per device-time measurement, "
                        "split over the rounds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of evo, evo op and sdpa, "
                        f"each column by column: device, eager, graph (default {ROUNDS}; forced backends after)")
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
    if args.rounds < 1:
        print("error: --rounds: at least 1", file=sys.stderr)
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
                impls = {k: fn for k, fn in implementations(module, causal, gqa).items()
                         if not (args.no_backends and k.startswith("sdpa "))}
                repetitions = max(5, args.repetitions // args.rounds)
                per_round = measure_rounds(impls, sets, args.calls, repetitions, args.rounds)
                rows = [combine_rounds(impl, per_round[impl]) for impl in impls]
                ratio = speedups(rows)
                print_block(console, f"{title}: {plan['config'][:6]} {plan['short']}", rows, ratio, err)
                for r in rows:
                    results.append({"shape": name, "dtype": dtype_name, "causal": causal, "batch": batch, "heads": heads,
                                    "heads_kv": heads_kv, "seq_q": seq_q, "seq_k": seq_k, "head_dim": head_dim,
                                    "config": plan["config"], "max_abs_err": err, **r,
                                    **({f"speedup_{k}": v for k, v in ratio.items() if not k.startswith(("overhead", "graph_per"))}
                                       if r["impl"] == "evo" else {})})
                del sets
                torch.cuda.empty_cache()
    targets = evaluate_targets(results)
    for i, line in enumerate(target_lines(targets)):
        console.print(line, style="bold" if i == 0 else None, markup=False)
    paths = launch_paths(module, torch.float16 if "fp16" in module.DTYPES else torch.bfloat16, args.calls) if args.launch_paths else []
    if paths:
        console.print("[bold]launch paths[/] (host µs per call, B1 H8 S512 D64, GPU not saturated)")
        for p in paths:
            console.print(f"  {p['path']:<48}" + (f"{p['host_us']:>8.2f}" if "host_us" in p else f"  {p['error']}"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"gpu": props.name, "torch": torch.__version__, "module": str(args.module), "op": module.OP_NAMESPACE,
               "rows": results, "notes": notes, "launch_paths": paths,
               "targets": {"rows": targets, "summary": summarize_targets(targets)}}
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
