"""Kernels called back to back for seconds, as under a long run: time per call beside the SM
clock and the board power (nvidia-smi every 50 ms), so that a difference between kernels can be
told apart from a difference in the clock the power limit leaves each of them."""
from __future__ import annotations

import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

from ..gpu.timing import capture_graph, launches_per_sample
from .protocol import round_order


def sample_clocks(gpu: int) -> subprocess.Popen | None:
    """nvidia-smi printing 'SM MHz, W' every 50 ms, or None without nvidia-smi."""
    try:
        return subprocess.Popen(["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None


def settled_medians(lines: Sequence[str]) -> tuple[float, float] | None:
    """Median SM MHz and W over the last three quarters of nvidia-smi's lines (None for none)."""
    pairs = []
    for line in lines:
        try:
            mhz, watts = (float(x) for x in line.split(","))
        except ValueError:
            continue
        pairs.append((mhz, watts))
    pairs = pairs[len(pairs) // 4:]
    if not pairs:
        return None
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def sustained_rounds(kernels: dict[str, Sequence[Callable[[], Any]]], seconds: float, rounds: int, gpu: int,
                     flops: float) -> dict[str, list[dict]]:
    """Per kernel (its calls rotating over the input sets) and round: µs per call over ``seconds``
    of back-to-back replays of one CUDA graph (~20 ms of calls), TF/s, the settled SM MHz and W,
    and mJ per call. Rounds interleave the kernels (``round_order``)."""
    import torch

    stream = torch.cuda.Stream()
    graphs = {}
    with torch.cuda.stream(stream):
        for label, ops in kernels.items():
            for op in ops:
                op()
            stream.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for op in ops:
                op()
            end.record()
            end.synchronize()
            per_call_ms = start.elapsed_time(end) / len(ops)
            launches = launches_per_sample(per_call_ms * 1e3, len(ops), target_sample_us=20_000.0, max_launches=4096)
            graphs[label] = (capture_graph(ops, launches, stream), launches, per_call_ms)

    figures: dict[str, list[dict]] = {label: [] for label in kernels}
    for r in range(rounds):
        for label in round_order(list(graphs), r):
            graph, launches, per_call_ms = graphs[label]
            replays = max(1, round(seconds * 1e3 / (launches * per_call_ms)))
            with torch.cuda.stream(stream):
                for _ in range(max(1, replays // 8)):   # warm: the clock settles
                    graph.replay()
                stream.synchronize()
                sampler = sample_clocks(gpu)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
            lines: list[str] = []
            if sampler is not None:
                time.sleep(0.06)
                sampler.terminate()
                lines = sampler.communicate()[0].splitlines()
            us = start.elapsed_time(end) * 1e3 / (replays * launches)
            clock = settled_medians(lines)
            figures[label].append({"us": us, "tflops": flops / us / 1e6, "mhz": clock[0] if clock else None,
                                   "watts": clock[1] if clock else None,
                                   "mj_per_call": clock[1] * us * 1e-3 if clock else None})
    return figures


def sustained_lines(figures: dict[str, list[dict]]) -> list[str]:
    """The table (80 columns): per kernel and round µs, ÷ the first kernel's median µs, MHz, W, mJ."""
    from .tables import TextColumn, text_table

    base = next(iter(figures))
    base_us = statistics.median(r["us"] for r in figures[base])
    columns = [TextColumn("kernel", left=True), TextColumn("µs"), TextColumn(f"÷{base.split()[-1]}"[:12]),
               TextColumn("MHz"), TextColumn("W"), TextColumn("mJ")]
    rows = []
    for label, measured in figures.items():
        for i, r in enumerate(measured):
            rows.append([label if i == 0 else "", f"{r['us']:.1f}", f"{r['us'] / base_us:.3f}",
                         *("-" if r[key] is None else fmt % r[key] for key, fmt in
                           (("mhz", "%.0f"), ("watts", "%.0f"), ("mj_per_call", "%.1f")))])
    return text_table(columns, rows)
