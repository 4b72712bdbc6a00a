"""Device time of a GPU operation, not Python's launch overhead.

The operation is captured ``launches`` times into one CUDA graph and the graph is
replayed; CUDA events around each replay divided by ``launches`` give one sample.
A 5 µs kernel then reads 5 µs, where events around an eager call would read the
host's dispatch time. To keep the L2 cache from serving the inputs, each launch in
the graph works on the next of several input sets whose total size is at least
twice the L2 (``flush_l2``). Candidate kernels and SDPA's backends are timed by
this one function.

Samples are taken until the median is known well enough: at least ``min_repetitions``,
then in rounds of ten until the median's standard error (estimated from the
interquartile range, 1.2533 * IQR / 1.349 / sqrt(n)) falls below ``precision`` times
the median, or ``repetitions`` samples are in. A steady kernel (spread ~0.3 %) stops
at ``min_repetitions``; a noisy one takes every repetition. ``precision=0`` always
takes ``repetitions`` samples.

Racing (``give_up_above_us``): a kernel whose first five samples put its median above
that bound (the search passes 1.5 times the best time seen on the case) stops there.
Its median is still measured, on fewer samples; only precision is given up, on
candidates that are not in the running. Warm-up replays stop after ``warmup`` replays
or ~25 ms, whichever comes first, so a 5 ms kernel does not spend 50 ms warming up.
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
    rel_stderr: float = 0.0
    raced: bool = False
    sampled_s: float = 0.0
    """Device time of the samples taken (repetitions times the launches of a sample)."""


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
            "rel_stderr": round(self.rel_stderr, 5),
            **({"raced": True} if self.raced else {}),
        }


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_rel_stderr(samples: Sequence[float]) -> float:
    """Standard error of the sample median over the median, from the interquartile range
    (robust to the odd slow sample a context switch or a clock change leaves)."""
    if len(samples) < 4:
        return math.inf
    median = statistics.median(samples)
    sigma = (quantile(samples, 0.75) - quantile(samples, 0.25)) / 1.349
    return 1.2533 * sigma / math.sqrt(len(samples)) / median if median > 0 else math.inf


def input_sets_for_cold_l2(set_bytes: int, flush_l2: bool, l2_bytes: int | None = None, cap: int = 64) -> int:
    """How many input sets to rotate through so that L2 cannot hold them."""
    if not flush_l2:
        return 1
    if l2_bytes is None:
        import torch

        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(cap, math.ceil(2 * l2_bytes / max(1, set_bytes))))


def launches_per_sample(call_us: float, n_ops: int, target_sample_us: float = 500.0, max_launches: int = 256) -> int:
    """Launches in the graph of one sample: about ``target_sample_us`` of calls of ``call_us``
    each, at least one per op, at most ``max_launches`` (unless the ops are more)."""
    return max(n_ops, min(max_launches, math.ceil(target_sample_us / max(call_us, 1e-3))))


def capture_graph(ops: Sequence[Callable[[], object]], launches: int, stream: object, pool: object = None) -> object:
    """A CUDA graph of ``launches`` calls, rotating through ``ops``, captured on ``stream``
    (in the memory ``pool`` of another graph, where given)."""
    import torch

    # capture_begin/end rather than ``torch.cuda.graph``, whose entry empties the caching
    # allocator (and may collect garbage): the next inputs would pay cudaMalloc again.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            for i in range(launches):
                ops[i % len(ops)]()
        finally:
            graph.capture_end()
    return graph


def time_graph(
    ops: Sequence[Callable[[], object]],
    *,
    repetitions: int = 100,
    warmup: int = 10,
    target_sample_us: float = 500.0,
    max_launches: int = 256,
    max_total_ms: float = 3000.0,
    min_repetitions: int | None = None,
    precision: float = 0.0,
    after_capture: Callable[[], object] | None = None,
    give_up_above_us: float | None = None,
    max_warmup_ms: float = 25.0,
) -> DeviceTime:
    """Median device time of one call of ``ops[i]`` (each op the same work on its own inputs).

    Calls rotate through ``ops``. A graph holds enough launches for one sample to take
    about ``target_sample_us``; the first replays are warm-up. ``repetitions`` samples at
    most, ``min_repetitions`` (default: all of them) at least, stopping in between once the
    median's relative standard error is below ``precision``. ``after_capture`` runs after
    the graph is captured and before its first replay (to poison outputs the replay must
    write). ``give_up_above_us``: stop after five samples whose median is above it.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up eager: module load, autotuning, workspace allocation (the rough timing warms every set)
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
    launches = launches_per_sample(rough_us, len(ops), target_sample_us, max_launches)
    repetitions = max(5, min(repetitions, int(max_total_ms * 1e3 / (launches * rough_us))))
    graph = capture_graph(ops, launches, stream)
    if after_capture is not None:
        after_capture()
    sample_ms = launches * rough_us / 1e3
    for _ in range(max(1, min(warmup, math.ceil(max_warmup_ms / sample_ms)))):
        graph.replay()
    torch.cuda.synchronize()

    at_least = repetitions if min_repetitions is None else max(5, min(repetitions, min_repetitions))
    samples: list[float] = []
    raced = False
    batch = 5 if give_up_above_us is not None else at_least
    while batch > 0:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(batch)]
        with torch.cuda.stream(stream):
            for a, b in events:
                a.record()
                graph.replay()
                b.record()
        torch.cuda.synchronize()
        samples += [a.elapsed_time(b) * 1e3 / launches for a, b in events]
        n = len(samples)
        if give_up_above_us is not None and statistics.median(samples) > give_up_above_us and n < at_least:
            raced = True
            break
        if n >= at_least and precision > 0 and median_rel_stderr(samples) <= precision:
            break
        batch = at_least - n if n < at_least else min(10, repetitions - n)
    del graph
    return DeviceTime(
        median_us=statistics.median(samples),
        p20_us=quantile(samples, 0.2),
        p80_us=quantile(samples, 0.8),
        repetitions=len(samples),
        launches_per_sample=launches,
        rel_stderr=median_rel_stderr(samples),
        raced=raced,
        sampled_s=sum(samples) * launches / 1e6,
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
