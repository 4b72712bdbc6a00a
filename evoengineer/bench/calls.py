"""A callable timed as a user calls it: device time, eager loops, host and sync latency, CUDA
graphs, in interleaved rounds (``protocol.round_order``).

- device µs: ``gpu.timing.time_graph``, the search's own timer (median of CUDA-graph replays);
  its spread is (p80 - p20) / 2 of those samples;
- eager µs: wall time per call of back-to-back calls with one synchronize at the end; the
  median of EAGER_LOOPS loops of max(calls, ~EAGER_LOOP_MS of device time) calls; overhead =
  eager - device (> 0 where the host cannot keep the GPU busy);
- host µs: the CPU time a call takes to return on an idle GPU (best of 5); sync µs: a call
  plus a synchronize (latency);
- graph µs: a model step, one call per input set captured in one CUDA graph, replayed back to
  back, each sample next to one as long of the device time's own graph (``graph_per_device``:
  the median of these pairs' ratios); graph1 µs: one call per graph, replayed in rotation.

Every measurement rotates over the same input sets (call i takes set i mod n), which together
outgrow the L2. A round goes column by column (the device time of each, then the eager loops of
each, then the graphs of each), so that the figures a ratio pairs are taken one right after
the other; rounds combine into medians, and speedups are medians of the rounds' own ratios.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

from .protocol import half_range, paired_ratio, round_order

HEAT_MS = 300.0          # before round 1: the interleaved implementations called in turn for about this wall time
HEAT_IN_FLIGHT = 4       # heat-up: passes queued ahead of the GPU at most (the work left at its end stays short)
EAGER_LOOPS = 3          # eager: loops measured per round, the median one reported
EAGER_LOOP_MS = 30.0     # each loop at least this much device time (and at least --calls calls)
GRAPH_SAMPLES = 2        # graph1: samples per round, the median one reported
GRAPH_SAMPLE_MS = 10.0   # each sample at least this much device time (and at least --calls calls)
GRAPH_PAIRS = 8          # graph: samples per round, each next to a device sample (the median one reported)
GRAPH_PAIR_MS = 3.0      # each graph and device sample at least this much device time (and --calls calls over the pairs)
GRAPH_MIN_CALLS = 8      # calls captured in the graph of a model step, at least


def loop_calls(calls: int, device_us: float, loop_ms: float, sets: int) -> int:
    """Calls in one timed loop: at least ``calls`` and enough for ~``loop_ms`` of device time at
    ``device_us`` per call, rounded up to whole rotations over ``sets`` input sets."""
    wanted = max(calls, math.ceil(loop_ms * 1e3 / max(device_us, 1e-3)), 1)
    return sets * math.ceil(wanted / sets)




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
                   rounds: int, paired: Sequence[str]) -> dict[str, list[dict]]:
    """Each implementation's measurements, in the order of ``impls``: a heat-up of the ``paired``
    ones, then ``rounds`` interleaved rounds of them (``measure_columns`` in ``round_order``),
    then each other one (a reference) once with ``measure``."""
    interleaved = [name for name in impls if name in paired]
    per_round: dict[str, list[dict]] = {name: [] for name in impls}
    if interleaved:
        heat_up([impls[name] for name in interleaved], sets, HEAT_MS)
    for r in range(rounds):
        order = round_order(interleaved, r)
        for name, row in measure_columns({name: impls[name] for name in order}, sets, calls, repetitions).items():
            per_round[name].append(row)
    for name, fn in impls.items():
        if name not in interleaved:
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


def paired_speedup(ours: dict, theirs: dict, column: str) -> float:
    """Their time / ours in ``column``: the median of the rounds' paired ratios where both rows
    have the same rounds, else the ratio of the two figures."""
    a, b = ours.get("rounds"), theirs.get("rounds")
    if a and b and len(a) == len(b):
        return paired_ratio([s[column] for s in b], [o[column] for o in a])
    return theirs[column] / ours[column]


def speedups(rows: list[dict], ours: str = "evo", theirs: str = "sdpa") -> dict[str, float]:
    """The speedups of ``ours`` over ``theirs`` (their time / ours, paired by round) in each time
    column, and both overheads and graph-per-device quotients; empty unless both rows are ok."""
    a = next((r for r in rows if r["impl"] == ours and r["status"] == "ok"), None)
    b = next((r for r in rows if r["impl"] == theirs and r["status"] == "ok"), None)
    if not a or not b:
        return {}
    out = {c: paired_speedup(a, b, c) for c in ("device_us", "eager_us", "graph_us", "graph1_us", "host_us") if a[c] > 0}
    out["overhead_evo_us"], out["overhead_sdpa_us"] = a["overhead_us"], b["overhead_us"]
    out["graph_per_device_evo"] = a.get("graph_per_device", math.nan)
    out["graph_per_device_sdpa"] = b.get("graph_per_device", math.nan)
    return out


def block_lines(title: str, rows: list[dict], ratio: dict, err: float | None) -> list[str]:
    """One row's measurements as printed (plain text within 80 columns): a line per
    implementation, then the speedups and overheads of ``speedups`` and the gate's error."""
    lines = [title, f"  {'impl':<15}{'dev µs':>9}{'eager µs':>10}{'±':>6}{'ovh µs':>8}{'host µs':>9}{'sync µs':>9}"
                    f"{'graph µs':>10}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"  {r['impl']:<15}{r.get('reason', r['status'])[:60]}")
            continue
        lines.append(f"  {r['impl']:<15}{r['device_us']:>9.1f}{r['eager_us']:>10.1f}{r['eager_spread_us']:>6.1f}"
                     f"{r['overhead_us']:>8.1f}{r['host_us']:>9.1f}{r['sync_us']:>9.1f}{r['graph_us']:>10.1f}")
    if ratio:
        lines.append(f"  ×sdpa device {ratio['device_us']:.2f} eager {ratio['eager_us']:.2f} graph {ratio['graph_us']:.2f} "
                     f"graph1 {ratio['graph1_us']:.2f} host {ratio['host_us']:.2f}")
        lines.append(f"  overhead {ratio['overhead_evo_us']:.1f} µs, sdpa's {ratio['overhead_sdpa_us']:.1f} µs; "
                     f"graph / device {ratio['graph_per_device_evo']:.3f}, sdpa's {ratio['graph_per_device_sdpa']:.3f}")
    if err is not None:
        lines.append(f"  max abs error against fp32 SDPA: {err:.1e}")
    return lines
