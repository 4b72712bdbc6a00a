"""Kernels called back to back for seconds, as under a long run: time per call, the SM clock and
the board power (nvidia-smi every 50 ms), so that a difference in the table can be told apart
from a difference in the clock the power limit leaves each kernel.

    python benchmarks/sustained_clock.py --shape 4,16,2048,128 --sdpa cudnn \\
        --config PERSISTENT=2,O_TMA=1,REG_PRODUCER=32,REG_CONSUMER=232 \\
        --config PERSISTENT=1,O_TMA=1,REG_PRODUCER=32,REG_CONSUMER=232 --seconds 4 --rounds 2

Each kernel is checked against fp32 SDPA first. Calls rotate over input sets that together
outgrow the L2 and are replayed from one CUDA graph, so the GPU never waits for Python. Rounds
interleave the kernels (A B C A B C). Per kernel and round: µs per call, and the medians of the
SM clock and the power over the last three quarters of the samples; mJ per call is their
product. ``--config`` overrides the h100 space's TMA seed; ``--sdpa`` adds SDPA backends.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ncu_profile import MAX_ERROR, sdpa_call, seed_kernel
from rich import box
from rich.console import Console
from rich.table import Table


def sample_clocks(gpu: int) -> subprocess.Popen | None:
    """nvidia-smi printing 'SM MHz, W' every 50 ms, or None without nvidia-smi."""
    try:
        return subprocess.Popen(["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None


def settled_medians(lines: list[str]) -> tuple[float, float] | None:
    """Median SM MHz and W over the last three quarters of nvidia-smi's lines."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,16,2048,128", metavar="B,H,S,D", help="B,H,S,D (default 4,16,2048,128)")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--config", action="append", default=[], help="NAME=VALUE,... over the TMA seed (repeatable)")
    parser.add_argument("--sdpa", action="append", default=[], choices=("cudnn", "flash", "efficient"),
                        help="an SDPA backend (repeatable)")
    parser.add_argument("--fa4", action="store_true", help="add flash-attn-4's forward (flash_attn.cute), if importable")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of calls per kernel and round (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all kernels (default 2)")
    parser.add_argument("--gpu", type=int, default=0, help="nvidia-smi's index of the GPU (default 0)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not args.config and not args.sdpa and not args.fa4:
        parser.error("give at least one --config, --sdpa or --fa4")

    import torch

    from evoengineer.gpu.timing import capture_graph, input_sets_for_cold_l2, launches_per_sample
    from evoengineer.space import parse_shape

    batch, heads, seq, head_dim, seq_kv = parse_shape(args.shape)
    torch.manual_seed(0)
    set_bytes = 2 * head_dim * (2 * batch * heads * seq + 2 * batch * heads * seq_kv)
    sets = max(2, input_sets_for_cold_l2(set_bytes, flush_l2=True))
    inputs = []
    for _ in range(sets):
        q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, heads, seq_kv, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
        inputs.append((q, k, v, torch.empty_like(q)))
    q0, k0, v0, _ = inputs[0]
    reference = torch.nn.functional.scaled_dot_product_attention(q0.float(), k0.float(), v0.float(), is_causal=args.causal)
    flops = 4 * batch * heads * seq * seq_kv * head_dim / (2 if args.causal else 1)

    kernels: dict[str, list] = {}
    for backend in args.sdpa:
        kernels[f"SDPA {backend}"] = [sdpa_call(backend, q, k, v, args.causal) for q, k, v, _ in inputs]
    if args.fa4:
        from flash_attn.cute import flash_attn_func  # (B, S, H, D) tensors; returns (out, lse)

        def fa4(q, k, v):
            result = flash_attn_func(q, k, v, causal=args.causal)
            return (result[0] if isinstance(result, tuple) else result).transpose(1, 2)
        bshd = [tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) for q, k, v, _ in inputs]
        kernels["flash-attn-4"] = [lambda t=t: fa4(*t) for t in bshd]
    for overrides in args.config:
        label, kernel = seed_kernel(overrides, head_dim, args.causal)
        kernels[label] = [lambda q=q, k=k, v=v, o=o, kernel=kernel: kernel(q, k, v, o, checked=False) for q, k, v, o in inputs]
    console = Console(highlight=False)
    for label, ops in list(kernels.items()):
        error = (ops[0]().float() - reference).abs().max().item()
        if not error < MAX_ERROR:
            console.print(f"[red]{label}: max |error| {error:.2e} against fp32 SDPA, left out[/]")
            del kernels[label]
    if not kernels:
        return 1

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
    for _ in range(args.rounds):
        for label, (graph, launches, per_call_ms) in graphs.items():
            replays = max(1, round(args.seconds * 1e3 / (launches * per_call_ms)))
            with torch.cuda.stream(stream):
                for _ in range(max(1, replays // 8)):   # warm: the clock settles
                    graph.replay()
                stream.synchronize()
                sampler = sample_clocks(args.gpu)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
            lines = []
            if sampler is not None:
                time.sleep(0.06)
                sampler.terminate()
                lines = sampler.communicate()[0].splitlines()
            us = start.elapsed_time(end) * 1e3 / (replays * launches)
            clock = settled_medians(lines)
            figures[label].append({"us": us, "tflops": flops / us / 1e6, "mhz": clock[0] if clock else None,
                                   "watts": clock[1] if clock else None,
                                   "mj_per_call": clock[1] * us * 1e-3 if clock else None})

    base = next(iter(figures))
    base_us = statistics.median(r["us"] for r in figures[base])
    table = Table(title=f"{torch.cuda.get_device_name()}: B{batch} H{heads} S{seq} D{head_dim}"
                        f"{' causal' if args.causal else ''}, {args.seconds:g} s of calls a round",
                  box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("kernel", no_wrap=True)
    for column in ("µs", f"÷{base.split()[-1]}", "MHz", "W", "mJ"):
        table.add_column(column, justify="right", no_wrap=True)
    for label, rounds in figures.items():
        for i, r in enumerate(rounds):
            table.add_row(label if i == 0 else "", f"{r['us']:.1f}", f"{r['us'] / base_us:.3f}",
                          *("-" if r[key] is None else fmt % r[key] for key, fmt in
                            (("mhz", "%.0f"), ("watts", "%.0f"), ("mj_per_call", "%.1f"))))
    console.print(f"÷{base.split()[-1]}: µs over the median of {base}'s rounds; MHz, W: medians of nvidia-smi's "
                  "samples over the last three quarters of the round; mJ: a call's energy")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": args.shape, "causal": args.causal,
                                         "seconds": args.seconds, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
