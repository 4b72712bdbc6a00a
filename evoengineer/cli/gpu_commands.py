"""GPU commands: ``baseline`` (SDPA's backends) and ``bench`` (one configuration)."""
from __future__ import annotations

import argparse
import json

from rich.console import Console

from ..gpu import SDPA_BACKENDS, Evaluator
from ..kernels import arch_for_device
from ..results import baseline_grid, bench_grid, print_grid
from .common import EXIT_FAILED, EXIT_OK, WIDE_HELP, load_space, parse_config, require_gpu, whole


def cmd_baseline(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    require_gpu()
    backends = args.backends.split(",") if args.backends else None
    with Evaluator(space, device=args.device) as ev:
        info = ev.info()
        result = ev.baseline(backends)
    if args.json:
        print(json.dumps({"gpu": info, "space": space.name, "baseline": result}))
    else:
        print_grid(Console(highlight=False), baseline_grid(space.name, info.get("gpu", "?"), result), wide=args.wide)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    config = parse_config(args.config, space)
    require_gpu()
    console = Console(highlight=False, stderr=args.json)
    with Evaluator(space, device=args.device, gate_trials=args.trials) as ev:
        info = ev.info()
        if info.get("arch"):
            ev.arch = arch_for_device(info["arch"], space.target.arch)
            if ev.arch != space.target.arch:
                console.print(f"[yellow]note:[/] space {space.name} targets {space.target.name} ({space.target.arch}); "
                              f"compiling for the GPU present, {info['gpu']} ({ev.arch})")
        with console.status(f"gating and timing {config.label()}"):
            result = ev.evaluate(config)
            baseline = ev.baseline() if result.ok else {}
    if args.json:
        print(json.dumps({"gpu": info, "space": space.name, "result": result.to_json(), "baseline": baseline}))
        return EXIT_OK if result.ok else EXIT_FAILED
    console.print(f"{config.label()} on {info.get('gpu')}: [bold]{result.status}[/] {result.reason}")
    console.print(f"resources: {result.resources}")
    print_grid(console, bench_grid(result.cases, baseline), wide=args.wide)
    return EXIT_OK if result.ok else EXIT_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("baseline", help="time PyTorch SDPA's backends on every shape of a space (GPU)",
                       description="Time every SDPA backend (flash, cudnn, efficient, math) on every shape of the space "
                       "with the same harness that times candidates: CUDA-graph replay, device time, L2 kept cold.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name")
    p.add_argument("--backends", help=f"comma-separated subset of {','.join(SDPA_BACKENDS)}")
    p.add_argument("--device", type=whole(0), default=0, help="CUDA device index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("bench", help="gate and time one configuration against SDPA (GPU)",
                       description="Gate one configuration against fp32 SDPA on every shape of the space plus edge shapes, "
                       "time it, and print ratios to every SDPA backend measured in the same run.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name")
    p.add_argument("--config", required=True, help="NAME=VALUE,... e.g. PATH=wmma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8 (omitted parameters take their first value)")
    p.add_argument("--trials", type=whole(1), default=3, help="random draws per shape for the gate (default 3)")
    p.add_argument("--device", type=whole(0), default=0, help="CUDA device index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_bench)

