"""GPU commands: ``baseline`` (SDPA's backends) and ``bench`` (one configuration)."""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..gpu import SDPA_BACKENDS, Evaluator, fastest_sdpa
from .common import EXIT_FAILED, EXIT_OK, load_space, parse_config, require_gpu


def ratio(candidate_us: float | None, sdpa: dict | None) -> str:
    if candidate_us is None or not sdpa or sdpa.get("status") != "ok":
        return "-"
    return f"{candidate_us / sdpa['time']['median_us']:.2f}"


def baseline_table(space_name: str, gpu: str, baseline: dict[str, dict]) -> Table:
    table = Table(title=f"PyTorch SDPA on {gpu} ({space_name}): device time, µs (median \\[p20-p80]) and TF/s")
    table.add_column("shape")
    for b in SDPA_BACKENDS:
        table.add_column(b, justify="right")
    table.add_column("fastest")
    best = fastest_sdpa(baseline)
    for label, rows in baseline.items():
        cells = []
        for b in SDPA_BACKENDS:
            r = rows.get(b, {})
            if r.get("status") == "ok":
                t = r["time"]
                cells.append(f"{t['median_us']:.1f} \\[{t['p20_us']:.1f}-{t['p80_us']:.1f}]\n{r['tflops']:.0f} TF/s")
            else:
                cells.append(f"[dim]{r.get('status', '-')}[/]")
        table.add_row(label, *cells, best.get(label, ("-",))[0])
    return table


def cmd_baseline(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    require_gpu()
    backends = args.backends.split(",") if args.backends else list(SDPA_BACKENDS)
    with Evaluator(space, device=args.device) as ev:
        info = ev.info()
        result = ev.baseline(backends)
    if args.json:
        print(json.dumps({"gpu": info, "space": space.name, "baseline": result}))
    else:
        Console(highlight=False).print(baseline_table(space.name, info.get("gpu", "?"), result))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    config = parse_config(args.config, space)
    require_gpu()
    console = Console(highlight=False, stderr=args.json)
    with Evaluator(space, device=args.device, gate_trials=args.trials) as ev:
        info = ev.info()
        if info.get("arch") and info["arch"] != space.target.arch:
            console.print(f"[yellow]note:[/] space {space.name} targets {space.target.name} ({space.target.arch}); "
                          f"compiling for the GPU present, {info['gpu']} ({info['arch']})")
            ev.arch = info["arch"]
        with console.status(f"gating and timing {config.label()}"):
            result = ev.evaluate(config)
            baseline = ev.baseline() if result.ok else {}
    if args.json:
        print(json.dumps({"gpu": info, "space": space.name, "result": result.to_json(), "baseline": baseline}))
        return EXIT_OK if result.ok else EXIT_FAILED
    console.print(f"{config.label()} on {info.get('gpu')}: [bold]{result.status}[/] {result.reason}")
    console.print(f"resources: {result.resources}")
    table = Table(title="gate and device time (time ratio: candidate / SDPA backend, < 1 is faster)")
    for col in ("shape", "gate", "max abs err", "rel L2 err", "trials", "median µs", "p20-p80 µs", "reps", "TF/s", *(f"/{b}" for b in SDPA_BACKENDS)):
        table.add_column(col, justify="left" if col in ("shape", "gate") else "right")
    for c in result.cases:
        t = c.get("time")
        rows = baseline.get(c["label"], {})
        table.add_row(
            c["label"], c["status"],
            f"{c['max_abs_err']:.2e}" if c.get("max_abs_err") is not None else "-",
            f"{c['rel_l2_err']:.2e}" if c.get("rel_l2_err") is not None else "-",
            str(c.get("trials", "-")),
            f"{t['median_us']:.2f}" if t else "-",
            f"{t['p20_us']:.2f}-{t['p80_us']:.2f}" if t else "-",
            str(t["repetitions"]) if t else "-",
            f"{c['tflops']:.1f}" if c.get("tflops") else "-",
            *(ratio(t["median_us"] if t else None, rows.get(b)) for b in SDPA_BACKENDS),
        )
    console.print(table)
    return EXIT_OK if result.ok else EXIT_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("baseline", help="time PyTorch SDPA's backends on every shape of a space (GPU)",
                       description="Time every SDPA backend (flash, cudnn, efficient, math) on every shape of the space "
                       "with the same harness that times candidates: CUDA-graph replay, device time, L2 kept cold.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name")
    p.add_argument("--backends", help=f"comma-separated subset of {','.join(SDPA_BACKENDS)}")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("bench", help="gate and time one configuration against SDPA (GPU)",
                       description="Gate one configuration against fp32 SDPA on every shape of the space plus edge shapes, "
                       "time it, and print ratios to every SDPA backend measured in the same run.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name")
    p.add_argument("--config", required=True, help="NAME=VALUE,... e.g. PATH=wmma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8 (omitted parameters take their first value)")
    p.add_argument("--trials", type=int, default=3, help="random draws per shape for the gate (default 3)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)

