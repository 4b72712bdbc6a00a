"""Commands that need no GPU: ``spaces`` (the built-in spaces) and ``check`` (render and
compile every valid configuration)."""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from rich.console import Console

from .common import EXIT_FAILED, EXIT_OK, WIDE_HELP, UsageError, load_space, restrict_shapes, whole


def _console(args: argparse.Namespace | None = None) -> Console:
    return Console(stderr=bool(args and getattr(args, "json", False)), highlight=False)


# -- check ---------------------------------------------------------------------

PROGRESS_LINE_S = 30.0
"""Seconds between two progress lines where the output is not a terminal (a log)."""


class ProgressLines:
    """Progress as plain lines for a log: one at the start, then one every ``period_s``."""

    def __init__(self, console: Console, what: str, total: int, period_s: float = PROGRESS_LINE_S) -> None:
        self.console, self.what, self.total, self.period_s = console, what, total, period_s
        self.started = self.last = time.perf_counter()
        console.print(f"{what}: {total} configurations", soft_wrap=True)

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.period_s or done >= self.total:
            return
        self.last = now
        elapsed = now - self.started
        left = elapsed / done * (self.total - done) if done else None
        self.console.print(f"{self.what}: {done}/{self.total} ({done / self.total:.0%}) in {_clock(elapsed)}"
                           + (f", about {_clock(left)} left" if left is not None else ""), soft_wrap=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"



def cmd_check(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..kernels import build_many, normalize_arch

    space = load_space(args.space)
    try:
        arch = normalize_arch(args.arch or space.target.arch)
    except ValueError as exc:
        raise UsageError(f"--arch: {exc}") from None
    space = restrict_shapes(space, args.shape, args.add_shape)
    space = space.for_arch(arch)  # constraints on ARCH/ARCH_NAME see the arch compiled for
    started = time.perf_counter()
    valid = list(space.valid_configs())
    if args.where:
        from ..space import ExpressionError, parse_expression

        try:
            where = parse_expression(args.where, set(space.param_names) | set(space.environment()))
        except ExpressionError as exc:
            raise UsageError(f"--where: {exc}") from None
        # every parameter of the space, those a configuration's path does not use at their neutral values
        valid = [c for c in valid if where({**space.environment(), **c.canonical()})]
    configs = valid if args.limit is None or args.limit >= len(valid) else random.Random(args.seed).sample(valid, args.limit)
    console = _console(args)
    reports = []
    log = None if args.quiet or console.is_terminal else ProgressLines(console, f"compiling {space.name} for {arch}", len(configs))
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
            if log:
                log.update(len(reports))
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
        "wgmma_serialized": sum(r.wgmma_serialized for r in reports),
        "variants": [v.label() for v in space.variants],
        "seconds": round(elapsed, 1),
    }
    if args.json:
        print(json.dumps({"summary": summary, "configs": [r.to_json() for r in reports]}, indent=None))
    else:
        from ..results import check_grid, print_grid

        out = Console(highlight=False)
        shown = reports if args.all or len(reports) <= 40 else failed + [r for r in reports if r.spilling] + [r for r in reports if r.status == "compiled" and not r.spilling][:20]
        title = f"{space.name}: {len(reports)} configurations for {arch} ({', '.join(summary['variants'])})"
        print_grid(out, check_grid(title, shown), wide=args.wide)
        if len(shown) < len(reports):
            out.print(f"({len(reports) - len(shown)} more compiled without spills; --all lists every row, --json gives all)")
        out.print(
            f"space {space.name}: {summary['total']} configurations, {summary['valid']} valid; checked {summary['checked']} "
            f"for {arch}: compiled {summary['compiled']}, failed {summary['failed']}, spilling {summary['spilling']}"
            + (f", wgmma serialized {summary['wgmma_serialized']}" if summary["wgmma_serialized"] else "")
            + f" in {elapsed:.1f} s"
        )
    return EXIT_OK if not failed else EXIT_FAILED


# -- spaces ----------------------------------------------------------------------


SIZES_FILE = "space-sizes.json"
"""Valid sizes of spaces, in the cache directory: space file's hash + code's hash -> size."""


def _code_hash() -> str:
    """A hash of the Python sources that decide which configurations are valid (the space
    and kernel stages)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted([*root.joinpath("space").rglob("*.py"), *root.joinpath("kernels").rglob("*.py")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cached_valid_size(space, cache: dict[str, int], code: str) -> tuple[int, bool]:
    """The space's valid size from ``cache`` (keyed by the space file's content and the code),
    counted (and added to ``cache``) when absent; returns (size, whether it was counted)."""
    import hashlib

    key = hashlib.sha256(space.path.read_bytes()).hexdigest()[:16] + "-" + code
    if key in cache:
        return cache[key], False
    cache[key] = space.valid_size()
    return cache[key], True


def cmd_spaces(args: argparse.Namespace) -> int:
    from ..kernels.compile import cache_dir
    from ..resources import builtin_spaces

    sizes_path = cache_dir().parent / SIZES_FILE
    try:
        cache = {str(k): int(v) for k, v in json.loads(sizes_path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        cache = {}  # none yet, or unreadable: counted again
    code, counted, rows = _code_hash(), False, []
    spaces = builtin_spaces()
    status = Console(stderr=True, highlight=False)
    for i, (name, path) in enumerate(spaces.items(), 1):
        space = load_space(path)
        with status.status(f"counting the valid configurations of {name} ({i}/{len(spaces)}; kept for next time)"):
            valid, fresh = cached_valid_size(space, cache, code)
        counted |= fresh
        rows.append({"name": name, "target": space.target.name, "arch": space.target.arch, "cases": len(space.cases),
                     "total": space.total_size(), "valid": valid, "path": str(path)})
    if counted:
        tmp = sizes_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
            tmp.replace(sizes_path)
        except OSError:
            pass  # a read-only cache: counted again next time
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    from ..results import print_grid, spaces_grid

    print_grid(Console(highlight=False), spaces_grid(rows), wide=args.wide)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="render and compile every valid configuration without a GPU",
                       description="Render every valid configuration of a space (or --limit N sampled ones) for every "
                       "problem variant, compile it with NVRTC for the space's arch (or --arch), and report registers, "
                       "shared memory, spills and compile time. Exit 0 when nothing failed to compile.")
    p.add_argument("--space", required=True, help="space YAML path or built-in name (l4, h100, h100-bf16, h100-decode; `evoengineer spaces` lists them)")
    p.add_argument("--arch", help="compile for this arch instead of the space's target (e.g. sm_89, sm_90)")
    p.add_argument("--limit", type=whole(1), metavar="N", help="check N configurations sampled at random (default: all)")
    p.add_argument("--where", metavar="EXPR", help="only the configurations for which EXPR holds, an expression in the "
                   "constraints' language, e.g. \"PATH == 'wgmma'\"")
    p.add_argument("--shape", action="append", metavar="B,H,S,D",
                   help="the space narrowed to this shape, as `search --shape` narrows it (repeatable): its head dims "
                        "only, so the configurations valid there alone are checked too, e.g. --shape 4,16,2048,64 "
                        "for the 192x128 tiles that fit at D64 and not D128")
    p.add_argument("--add-shape", action="append", metavar="B,H,S,D", dest="add_shape",
                   help="the space with this shape added, as `search --add-shape` adds it (repeatable)")
    p.add_argument("--seed", type=whole(0), default=0, help="seed for --limit sampling (default 0)")
    p.add_argument("--jobs", type=whole(1), default=None, help="parallel compile processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="print one JSON object {summary, configs} instead of tables")
    p.add_argument("--all", action="store_true", help="list every configuration in the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("spaces", help="list the built-in search spaces and their sizes")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_spaces)
