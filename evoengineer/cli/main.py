"""The ``evoengineer`` command line."""
from __future__ import annotations

import argparse
import errno
import re
import sys
from typing import NoReturn, Sequence

from .. import __version__
from . import ab_commands, gpu_commands, import_commands, results_commands, search_commands, space_commands
from .common import EXIT_USAGE, UsageError

_FILE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

# -- parser ------------------------------------------------------------------------

_EPILOG = """\
typical session:
  evoengineer spaces                          # the built-in search spaces
  evoengineer check --space spaces/l4.yaml    # compile every config, no GPU
  evoengineer baseline --space h100           # time SDPA's backends on this GPU
  evoengineer bench --space h100 \\
      --config PATH=wmma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8   # one config
  evoengineer ab --space h100 --config ... --param BLOCK_N  # one parameter A/B
  evoengineer search --space h100 --time 10m  # the search (GPU)
  evoengineer leaderboard runs/<run>          # the ranked finalists
  evoengineer leaderboard runs/<run> --per-shape   # the fastest config per case
  evoengineer report runs/<run>               # one HTML page about the run
  evoengineer export runs/<run> --out best/   # a module choosing per call

--space takes a YAML path or a built-in name (l4, h100, h100-bf16,
h100-decode); spaces/NAME.yaml falls back to the built-in space NAME when no
such file exists here.
"""


class Parser(argparse.ArgumentParser):
    """argparse with a mistake reported as one line (``error: --trials: ...``) and exit code 2."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        message = re.sub(r"^argument (\S+?)(/\S+)?: ", r"\1: ", message)
        self.exit(EXIT_USAGE, f"error: {message} (`{self.prog} --help` lists the options)\n")


_NEGATIVE = re.compile(r"^-\d")


def _negative_values(argv: Sequence[str]) -> list[str]:
    """``--time -5m`` as ``--time=-5m``: a value that starts with a minus sign reaches the
    option's range check (argparse takes ``-5m`` for an unknown option)."""
    out: list[str] = []
    for token in argv:
        if out and _NEGATIVE.match(token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="evoengineer",
        description="Search templated CUDA FlashAttention kernels for the fastest correct one.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"evoengineer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for commands in (space_commands, gpu_commands, ab_commands, search_commands, results_commands,
                     import_commands):
        commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..search import RunFileError, storage_error
    from ..search.loop import describe_os_error
    from ..space import ExpressionError, SpaceError

    parser = build_parser()
    args = parser.parse_args(_negative_values(sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except (SpaceError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ExpressionError as exc:  # a constraint that fails on values the load-time probe did not reach
        print(f"error: constraint {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a file outside the run's own (an export, a report): full disk, read-only place
        if exc.errno not in _FILE_ERRNOS:
            raise
        print(f"error: {exc.filename or 'a file'}: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        message = storage_error(exc)
        if not message:
            raise
        print(f"error: the study's storage: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
