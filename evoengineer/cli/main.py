"""The ``evoengineer`` command line."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .. import __version__
from . import gpu_commands, import_commands, results_commands, search_commands, space_commands
from .common import EXIT_USAGE, UsageError

# -- parser ------------------------------------------------------------------------

_EPILOG = """\
typical session:
  evoengineer spaces                          # the built-in search spaces
  evoengineer check --space spaces/l4.yaml    # compile every config, no GPU
  evoengineer baseline --space h100           # time SDPA's backends on this GPU
  evoengineer bench --space h100 \\
      --config PATH=wmma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8   # one config
  evoengineer search --space h100 --time 10m  # the search (GPU)
  evoengineer leaderboard runs/<run>          # the ranked finalists
  evoengineer leaderboard runs/<run> --per-shape   # the fastest config per case
  evoengineer report runs/<run>               # one HTML page about the run
  evoengineer export runs/<run> --out best/   # a module choosing per call

--space takes a YAML path or a built-in name (l4, h100, h100-bf16,
h100-decode); spaces/NAME.yaml falls back to the built-in space NAME when no
such file exists here.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evoengineer",
        description="Search templated CUDA FlashAttention kernels for the fastest correct one.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"evoengineer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for commands in (space_commands, gpu_commands, search_commands, results_commands, import_commands):
        commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..space import SpaceError

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
