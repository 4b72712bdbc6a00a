"""A sample of a space's configurations compiled with two revisions of the templates: same SASS?

    python benchmarks/sass_sample.py --space h100 --before fb5a84c --sample 200 --seed 0 --out DIR

Draws ``--sample`` valid configurations of the space (``--seed``), stratified by path: each path
gets its share of the sample in proportion to its valid configurations (largest remainder),
drawn uniformly within the path. The i-th
configuration of a path takes the space's variant i (cycling), so every head dim x full/causal
appears on each path that has enough configurations. Each is rendered from ``--before``'s
templates (``git archive``; its configuration flat, as every path carried every parameter then)
and from ``--after``'s (default: the working tree's), compiled for the space's arch by a pool of
``--workers`` NVRTC processes (at ``nice`` 19) where the sources differ, and disassembled by
``nvdisasm`` (``pip install nvidia-cuda-nvdisasm``); ``evoengineer.kernels.sass`` compares them.

Prints, per path: sampled, identical, different, refused by both, broken (one side alone
refuses, other launches, a failed compile), and over the different ones the change (after minus
before) of registers, shared memory and SASS instructions as min/median/max. ``--out DIR``
writes ``DIR/sass_sample.json``: the table, the different configurations' short labels and every
comparison. Exit code 1 when a comparison is broken, 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from evoengineer.kernels import sass  # noqa: E402
from evoengineer.space import Config, Space, SpaceError, Variant, load_space  # noqa: E402

DELTAS = (("registers", "registers"), ("smem", "shared memory"), ("instructions", "instructions"))


def allocation(counts: dict[str, int], sample: int) -> dict[str, int]:
    """``sample`` spread over the paths in proportion to their valid configurations ``counts``
    (largest remainder; ties to the earlier path)."""
    total = sum(counts.values())
    sample = min(sample, total)
    exact = {p: sample * n / total for p, n in counts.items()} if total else {p: 0.0 for p in counts}
    share = {p: int(x) for p, x in exact.items()}
    order = sorted(counts, key=lambda p: (-(exact[p] - share[p]), list(counts).index(p)))
    for p in order[: sample - sum(share.values())]:
        share[p] += 1
    return share


def stratified_sample(space: Space, sample: int, seed: int) -> tuple[list[tuple[Config, Variant]], dict[str, int], dict[str, int]]:
    """The sampled (configuration, variant) pairs, path by path in the space's order; the valid
    configurations per path and the sample's share of each."""
    by_path: dict[str, list[Config]] = {}
    for config in space.valid_configs():
        by_path.setdefault(str(config["PATH"]), []).append(config)
    counts = {p: len(c) for p, c in by_path.items()}
    shares = allocation(counts, sample)
    rng = random.Random(seed)
    variants = list(space.variants)
    pairs: list[tuple[Config, Variant]] = []
    for path, configs in by_path.items():
        pairs += sass.variants_cycled(rng.sample(configs, shares[path]), variants)
    return pairs, counts, shares


def _spread(values: list[int]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{min(values):+d}/{median:+g}/{max(values):+d}"


def table(results: list[sass.Comparison]) -> list[dict]:
    """One row per path (in order of appearance) and a total: verdict counts and the deltas'
    min/median/max over the different comparisons."""
    rows = []
    paths = list(dict.fromkeys(str(r.config["PATH"]) for r in results))
    for path in [*paths, "all"]:
        mine = [r for r in results if path == "all" or r.config["PATH"] == path]
        row: dict = {"path": path, "sampled": len(mine), **{v: sum(r.verdict == v for r in mine) for v in sass.VERDICTS}}
        different = [r for r in mine if r.verdict == "different"]
        for field, _ in DELTAS:
            values = [d for r in different if (d := r.delta(field)) is not None]
            row[field] = {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None
            row[f"{field}_text"] = _spread(values)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    header = ["path", "sampled", *sass.VERDICTS, *(f"d {name} min/med/max" for _, name in DELTAS)]
    lines = [[str(row["path"]), str(row["sampled"]), *(str(row[v]) for v in sass.VERDICTS),
              *(row[f"{field}_text"] for field, _ in DELTAS)] for row in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    for line in [header, *lines]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--space", default="h100", help="built-in space name or a space file")
    parser.add_argument("--before", default="fb5a84c", help="git revision whose templates are the base")
    parser.add_argument("--after", default=None, help="git revision to compare with (default: the working tree's templates)")
    parser.add_argument("--sample", type=int, default=200, help="configurations to draw (stratified by path)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="NVRTC processes")
    parser.add_argument("--out", type=Path, default=None, help="directory for sass_sample.json")
    args = parser.parse_args(argv)
    if args.sample < 1 or args.workers < 1:
        print("sass_sample: --sample and --workers take a positive number", file=sys.stderr)
        return 2
    try:
        space = load_space(args.space)
    except (SpaceError, OSError) as exc:
        print(f"sass_sample: --space {args.space}: {exc}", file=sys.stderr)
        return 2
    tool = sass.nvdisasm()
    if tool is None:
        print("sass_sample: nvdisasm not found (pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    os.nice(19)  # the compile processes inherit it
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sass-sample-") as tmp:
        before = sass.revision_templates(args.before, Path(tmp) / "before", REPO)
        if before is None:
            print(f"sass_sample: --before {args.before}: no such git revision with templates/ in {REPO}", file=sys.stderr)
            return 2
        after = None
        if args.after is not None:
            after = sass.revision_templates(args.after, Path(tmp) / "after", REPO)
            if after is None:
                print(f"sass_sample: --after {args.after}: no such git revision with templates/ in {REPO}", file=sys.stderr)
                return 2
        pairs, counts, shares = stratified_sample(space, args.sample, args.seed)
        arch = space.target.arch
        print(f"{space.name}: {len(pairs)} of {sum(counts.values())} valid configurations, stratified by path "
              f"(in proportion, largest remainder): " + ", ".join(f"{p} {shares[p]} of {counts[p]}" for p in counts))
        print(f"before {args.before}, after {args.after or 'the working tree'}; {arch}; variants cycled: "
              + ", ".join(v.label() for v in space.variants), flush=True)
        results = sass.compare(pairs, before, after, arch, tool, workers=args.workers)
    rows = table(results)
    print_table(rows)
    different = [r for r in results if r.verdict == "different"]
    broken = [r for r in results if r.verdict == "broken"]
    for r in broken:
        print(f"broken: {r.label}: {r.why}")
    print(f"{len(different)} different, {len(broken)} broken; {time.monotonic() - started:.0f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"space": space.name, "arch": arch, "before": args.before, "after": args.after or "working tree",
                  "sample": len(pairs), "seed": args.seed, "valid_per_path": counts, "sampled_per_path": shares,
                  "table": [{k: v for k, v in row.items() if not k.endswith("_text")} for row in rows],
                  "different": [r.config.short_label() for r in different],
                  "comparisons": [r.to_json() for r in results]}
        (args.out / "sass_sample.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out / 'sass_sample.json'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
