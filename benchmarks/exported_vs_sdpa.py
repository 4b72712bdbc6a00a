"""Time an exported module as a user calls it, against torch's SDPA.

Exports nothing: give it an export directory (evoengineer export RUN --out DIR).

    python benchmarks/exported_vs_sdpa.py --module best/ --out bench/
    python benchmarks/exported_vs_sdpa.py --module best/ --quick --dtype fp16 \\
        --shape "B1 H8 S512 D64"
    python benchmarks/exported_vs_sdpa.py --module best/ --decode --out bench-decode/

A row is a shape, dtype and causal flag (skipped, with a note, where the export has no
kernel for it). evo (module.attention), evo op (the custom op) and sdpa (torch's own backend
choice) and, where flash-attn-4 is installed, fa4 are measured in --rounds interleaved rounds
after a heat-up; each SDPA backend forced once after them. A decode row (q_len 1; --decode: only
those) also shows the bandwidth of each: the bytes of K and V over its device time, and their
share of the GPU's memory bandwidth. What each column measures: ``evoengineer.bench.calls``; the targets checked
on each row, evo against sdpa (eager, overhead, graph): ``evoengineer.bench.targets``. Tables
fit 80 columns; --out gets results.json and results.csv; --launch-paths also times the raw
launch calls the module could use.

--features: only the feature rows (``evoengineer.bench.features``, bf16 unless --dtype says):
a sliding window, soft-capping, a padded batch, packed sequences (attention_varlen) and head
dims 96 and 256, every row causal. Each is timed against the SDPA call that computes the same
(a boolean mask for the window and the padding, a loop over the packed sequences; none for the
soft cap), SDPA's plain causal call as a floor where the feature costs SDPA a mask or has no
SDPA call, and flash-attn-4 with the same feature where it takes it; a row the export has no
kernel for prints one line. --list prints the rows (and, with --module, the kernel that serves
each) without a GPU.

    python benchmarks/exported_vs_sdpa.py --module best/ --features --quick --out bench-features/
    python benchmarks/exported_vs_sdpa.py --module best/ --features --list
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evoengineer.bench.exported import (
    DTYPES,
    ROUNDS,
    SHAPES,
    decode_shapes,
    hbm_peak_gbs,
    launch_paths,
    load_module,
    measure_export,
    write_results,
)
from evoengineer.bench.features import FEATURE_ROWS, feature_summary_lines, list_lines, measure_features
from evoengineer.bench.targets import evaluate_targets, summarize_targets, target_lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argparse's own errors exit 2); ``check_args`` checks how flags combine."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, help="an export directory (kernel.json and the module); required "
                        "unless --list")
    parser.add_argument("--out", type=Path, help="write results.json and results.csv here")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="fp16 and/or bf16 (default both; with "
                        "--features bf16)")
    parser.add_argument("--shape", action="append", help="only these rows, by name (SHAPES', or with --features the "
                        "feature rows'; repeatable)")
    parser.add_argument("--decode", action="store_true", help="only the decode rows (q_len 1 over a K/V cache)")
    parser.add_argument("--features", action="store_true", help="only the feature rows (window, soft cap, padding, "
                        "varlen, D96, D256; bf16 unless --dtype)")
    parser.add_argument("--list", action="store_true", help="print the rows (with --module: the kernel serving each "
                        "feature row) and exit; no GPU needed")
    parser.add_argument("--no-fa4", action="store_true", help="leave flash-attn-4 out even where it is installed")
    parser.add_argument("--calls", type=int, default=200, help="calls per eager loop, per graph1 sample and over a "
                        "round's graph samples, at least")
    parser.add_argument("--repetitions", type=int, default=50, help="graph replays per device-time measurement, "
                        "split over the rounds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of evo, evo op and sdpa, "
                        f"each column by column: device, eager, graph (default {ROUNDS}; forced backends after)")
    parser.add_argument("--quick", action="store_true", help="fewer calls and repetitions")
    parser.add_argument("--no-backends", action="store_true", help="skip the forced SDPA backend rows")
    parser.add_argument("--launch-paths", action="store_true", help="also time the raw launch calls")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> str:
    """Why the flags cannot run together ('' where they can): one line, without a GPU."""
    if args.features and args.decode:
        return "--features and --decode: pick one set of rows"
    if args.features and args.launch_paths:
        return "--launch-paths: the raw launch calls go with the default rows, not --features"
    if args.rounds < 1:
        return "--rounds: at least 1"
    names = [row.name for row in FEATURE_ROWS] if args.features else [s[0] for s in SHAPES]
    unknown = sorted(set(args.shape or ()) - set(names))
    if unknown:
        return f"--shape {unknown[0]!r}: not one of {', '.join(names)}"
    if args.module is None and not args.list:
        return "--module: required (an export directory: evoengineer export ... --out DIR)"
    if args.module is not None and not (args.module / "kernel.json").exists():
        return f"{args.module}: no kernel.json; give an export directory (evoengineer export ... --out DIR)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    dtypes = args.dtype or (["bf16"] if args.features else list(DTYPES))
    if args.list:
        module = load_module(args.module) if args.module else None
        if args.features:
            rows = [r for r in FEATURE_ROWS if not args.shape or r.name in args.shape]
            print("\n".join(list_lines(rows, dtypes, module)))
        else:
            for name, _, flags in (decode_shapes() if args.decode else SHAPES):
                if not args.shape or name in args.shape:
                    print(f"{name}: {'causal and full' if len(flags) == 2 else 'full'}, {', '.join(dtypes)}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU found on this machine", file=sys.stderr)
        return 2
    if args.quick:
        args.calls, args.repetitions = min(args.calls, 50), min(args.repetitions, 15)
    module = load_module(args.module)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}; module {args.module} ({len(module.CONFIGS)} configs, "
          f"op {module.OP_NAMESPACE}); speedups are SDPA / ours")
    peak = hbm_peak_gbs()
    if args.features:
        rows = [r for r in FEATURE_ROWS if not args.shape or r.name in args.shape]
        print("feature rows, every one causal. sdpa: SDPA's call for the same result;\n"
              "sdpa floor: SDPA's plain causal call, not the same computation")
        results, notes = measure_features(module, rows, dtypes, args.calls, args.repetitions, args.rounds,
                                          peers=not args.no_fa4)
        print("\n".join(feature_summary_lines(results)))
    else:
        shapes = [s for s in (decode_shapes() if args.decode else SHAPES) if not args.shape or s[0] in args.shape]
        if peak:
            print(f"memory bandwidth {peak:.0f} GB/s (decode rows: K+V bytes / device time)")
        results, notes = measure_export(module, shapes, dtypes, args.calls, args.repetitions,
                                        args.rounds, backends=not args.no_backends, peers=not args.no_fa4)
    targets = evaluate_targets(results)
    print("\n".join(target_lines(targets)))
    paths = launch_paths(module, torch.float16 if "fp16" in module.DTYPES else torch.bfloat16, args.calls) if args.launch_paths else []
    if paths:
        print("launch paths (host µs per call, B1 H8 S512 D64, GPU not saturated)")
        for p in paths:
            print(f"  {p['path']:<48}" + (f"{p['host_us']:>8.2f}" if "host_us" in p else f"  {p['error']}"))
    if args.out:
        write_results(args.out, {"gpu": props.name, "torch": torch.__version__, "module": str(args.module), "hbm_gbs": peak,
                                 "op": module.OP_NAMESPACE, "rows": results, "notes": notes, "launch_paths": paths,
                                 "targets": {"rows": targets, "summary": summarize_targets(targets)}}, results)
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
