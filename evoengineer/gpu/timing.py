"""Device time of a GPU operation, not Python's launch overhead.

The operation is captured ``launches`` times into one CUDA graph and the graph is
replayed; CUDA events around each replay divided by ``launches`` give one sample.
A 5 µs kernel then reads 5 µs, where events around an eager call would read the
host's dispatch time. To keep the L2 cache from serving the inputs, each launch in
the graph works on the next of several input sets whose total size is at least
twice the L2 (``flush_l2``). Candidate kernels and SDPA's backends are timed by
this one function.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class DeviceTime:
    median_us: float
    p20_us: float
    p80_us: float
    repetitions: int
    launches_per_sample: int

    @property
    def spread(self) -> float:
        """(p80 - p20) / median."""
        return (self.p80_us - self.p20_us) / self.median_us if self.median_us else math.inf

    def to_json(self) -> dict:
        return {
            "median_us": round(self.median_us, 3),
            "p20_us": round(self.p20_us, 3),
            "p80_us": round(self.p80_us, 3),
            "repetitions": self.repetitions,
            "launches_per_sample": self.launches_per_sample,
        }


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def input_sets_for_cold_l2(set_bytes: int, flush_l2: bool, l2_bytes: int | None = None, cap: int = 64) -> int:
    """How many input sets to rotate through so that L2 cannot hold them."""
    if not flush_l2:
        return 1
    if l2_bytes is None:
        import torch

        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(cap, math.ceil(2 * l2_bytes / max(1, set_bytes))))


def time_graph(
    ops: Sequence[Callable[[], object]],
    *,
    repetitions: int = 100,
    warmup: int = 10,
    target_sample_us: float = 500.0,
    max_launches: int = 256,
    max_total_ms: float = 3000.0,
) -> DeviceTime:
    """Median device time of one call of ``ops[i]`` (each op the same work on its own inputs).

    Calls rotate through ``ops``. A graph holds enough launches for one sample to take
    about ``target_sample_us``; the first replays are warm-up.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(3, len(ops))):  # warm-up eager: module load, autotuning, workspace allocation
            ops[i % len(ops)]()
    stream.synchronize()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for i in range(len(ops)):
            ops[i]()
        end.record()
    end.synchronize()
    rough_us = max(start.elapsed_time(end) * 1e3 / len(ops), 1.0)
    launches = max(len(ops), min(max_launches, math.ceil(target_sample_us / rough_us)))
    repetitions = max(5, min(repetitions, int(max_total_ms * 1e3 / (launches * rough_us))))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(launches):
            ops[i % len(ops)]()
    for _ in range(max(1, warmup)):
        graph.replay()
    torch.cuda.synchronize()

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repetitions)]
    with torch.cuda.stream(stream):
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) * 1e3 / launches for a, b in events]
    del graph
    return DeviceTime(
        median_us=statistics.median(samples),
        p20_us=quantile(samples, 0.2),
        p80_us=quantile(samples, 0.8),
        repetitions=repetitions,
        launches_per_sample=launches,
    )


def profiler_kernel_us(op: Callable[[], object], calls: int = 50) -> float:
    """Mean device time per call of ``op`` as the profiler records its kernels (sum of
    the kernels' durations per call). Used to cross-check ``time_graph``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        op()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            op()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total += evt.device_time
    return total / calls
