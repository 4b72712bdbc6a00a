"""``evoengineer import-cache``: a Kernel Tuner cache file as a recording and a recorded space."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import EXIT_OK, UsageError


def cmd_import_cache(args: argparse.Namespace) -> int:
    from ..search.kernel_tuner_cache import CacheError, convert

    categorical = [n.strip() for n in (args.categorical or "").split(",") if n.strip()]
    out = Path(args.out)
    if not out.name.endswith((".jsonl", ".jsonl.gz")):
        raise UsageError(f"--out: {out}: a recording's name ends in .jsonl or .jsonl.gz")
    try:
        converted = convert(Path(args.cache), name=args.name, categorical=categorical)
    except CacheError as exc:
        raise UsageError(str(exc)) from None
    space_path = out.with_name(out.name.split(".")[0] + ".yaml")
    converted.write(out, space_path)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(converted.counts().items()))
    print(f"{args.cache}: {len(converted.records)} configurations ({counts}) of {len(converted.space['params'])} parameters")
    print(f"wrote {out} and {space_path}")
    print(f"replay it: evoengineer search --space {space_path} --replay {out}")
    print(f"compare strategies on it: python benchmarks/strategies.py --recording {out}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-cache", help="convert a Kernel Tuner cache file into a recording to replay",
        description="Convert a Kernel Tuner cache file (.json or .json.gz: every configuration it measured) into a "
        "recording (--out, .jsonl or .jsonl.gz) and a recorded space beside it (problem.kind: recorded, the same name "
        "with .yaml). Times become microseconds; CompilationFailedConfig, RuntimeFailedConfig and InvalidConfig become "
        "the statuses compile_failed, launch_failed and invalid. Replay it with `search --replay` or "
        "benchmarks/strategies.py.")
    p.add_argument("cache", help="the Kernel Tuner cache file (.json or .json.gz)")
    p.add_argument("--out", required=True, help="the recording to write: NAME.jsonl or NAME.jsonl.gz (the space: NAME.yaml)")
    p.add_argument("--name", help="the space's name (default: the kernel's name and the file's)")
    p.add_argument("--categorical", metavar="NAMES",
                   help="comma-separated parameters whose integers name choices, not amounts (e.g. use_method)")
    p.set_defaults(func=cmd_import_cache)
