"""The ``evoengineer`` command line."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Callable, Sequence

from rich.console import Console
from rich.table import Table

from . import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _console(args: argparse.Namespace | None = None) -> Console:
    return Console(stderr=bool(args and getattr(args, "json", False)), highlight=False)


def _load_space(spec: str):
    from .space import load_space

    return load_space(spec)


# -- check ---------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .compile import normalize_arch
    from .static import build_many

    space = _load_space(args.space)
    try:
        arch = normalize_arch(args.arch or space.target.arch)
    except ValueError as exc:
        raise UsageError(f"--arch: {exc}") from None
    started = time.perf_counter()
    valid = list(space.valid_configs())
    configs = valid if not args.limit or args.limit >= len(valid) else random.Random(args.seed).sample(valid, args.limit)
    console = _console(args)
    reports = []
    with Progress(
        TextColumn("[bold]compiling[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=args.quiet,
    ) as progress:
        task = progress.add_task(f"{space.name} for {arch}", total=len(configs))
        for report in build_many(space.template, configs, space.variants, arch, space.target.smem_per_block, workers=args.jobs):
            reports.append(report)
            progress.advance(task)
    elapsed = time.perf_counter() - started
    failed = [r for r in reports if r.status != "compiled"]
    summary = {
        "space": space.name,
        "arch": arch,
        "total": space.total_size(),
        "valid": len(valid),
        "checked": len(reports),
        "compiled": len(reports) - len(failed),
        "failed": len(failed),
        "spilling": sum(r.spilling for r in reports),
        "variants": [v.label() for v in space.variants],
        "seconds": round(elapsed, 1),
    }
    if args.json:
        print(json.dumps({"summary": summary, "configs": [r.to_json() for r in reports]}, indent=None))
    else:
        out = Console(highlight=False)
        table = Table(title=f"{space.name}: {len(reports)} configurations for {arch} ({', '.join(summary['variants'])})")
        for col in ("config", "regs", "smem B", "spills B", "compile ms", "status"):
            table.add_column(col, justify="left" if col in ("config", "status") else "right")
        shown = reports if args.all or len(reports) <= 40 else failed + [r for r in reports if r.spilling] + [r for r in reports if r.status == "compiled" and not r.spilling][:20]
        for r in shown:
            status = "[red]" + r.error[:80] + "[/]" if r.status != "compiled" else ("[yellow]spills[/]" if r.spilling else "ok")
            table.add_row(r.config.label(), str(r.registers), str(r.smem), str(r.spill_bytes), f"{r.compile_ms:.0f}", status)
        out.print(table)
        if len(shown) < len(reports):
            out.print(f"({len(reports) - len(shown)} more compiled without spills; --all lists every row, --json gives all)")
        out.print(
            f"space {space.name}: {summary['total']} configurations, {summary['valid']} valid; checked {summary['checked']} "
            f"for {arch}: compiled {summary['compiled']}, failed {summary['failed']}, spilling {summary['spilling']} "
            f"in {elapsed:.1f} s"
        )
    return EXIT_OK if not failed else EXIT_FAILED


# -- spaces ----------------------------------------------------------------------


def cmd_spaces(args: argparse.Namespace) -> int:
    from .resources import builtin_spaces
    from .space import load_space

    rows = []
    for name, path in builtin_spaces().items():
        space = load_space(path)
        rows.append({"name": name, "target": space.target.name, "arch": space.target.arch, "cases": len(space.cases),
                     "total": space.total_size(), "valid": space.valid_size(), "path": str(path)})
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    table = Table(title="built-in search spaces")
    for col in ("name", "target", "arch", "cases", "total", "valid"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("name", "target", "arch", "cases", "total", "valid")))
    Console().print(table)
    return EXIT_OK


# -- parser ------------------------------------------------------------------------

_EPILOG = """\
typical session:
  evoengineer spaces                               # the built-in search spaces
  evoengineer check --space spaces/l4.yaml         # render + compile every valid config, no GPU needed
  evoengineer baseline --space h100                # time PyTorch SDPA's backends on this GPU
  evoengineer bench --space h100 --config PATH=wmma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8
  evoengineer search --space h100 --time 10m       # the search (GPU)
  evoengineer leaderboard runs/<run>               # the ranked finalists
  evoengineer export runs/<run> --rank 1 --out best/

--space takes a YAML path or a built-in name (l4, h100); spaces/NAME.yaml falls
back to the built-in space NAME when no such file exists here.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evoengineer",
        description="Search a space of templated CUDA FlashAttention kernels for the fastest correct one.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"evoengineer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("check", help="render and compile every valid configuration without a GPU",
                       description="Render every valid configuration of a space (or --limit N sampled ones) for every "
                       "problem variant, compile it with NVRTC for the space's arch (or --arch), and report registers, "
                       "shared memory, spills and compile time. Exit 0 when nothing failed to compile.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name (l4, h100)")
    p.add_argument("--arch", help="compile for this arch instead of the space's target (e.g. sm_89, sm_90)")
    p.add_argument("--limit", type=int, metavar="N", help="check N configurations sampled at random (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed for --limit sampling (default 0)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="print one JSON object {summary, configs} instead of tables")
    p.add_argument("--all", action="store_true", help="list every configuration in the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("spaces", help="list the built-in search spaces and their sizes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_spaces)

    from . import gpu_cli, search_cli  # noqa: F401 - register their commands

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    from .space import SpaceError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except (SpaceError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
