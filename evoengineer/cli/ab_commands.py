"""``ab``: two kernels timed against each other in one process, interleaved rounds, paired ratios."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..space import Config
from .common import EXIT_FAILED, EXIT_OK, UsageError, load_space, parse_config, require_gpu, restrict_shapes

_DESCRIPTION = """\
Time a configuration (A) against its neighbour in one parameter (--param),
another configuration (--against) or itself rendered from a git revision's
templates (--before), in one process: both gated against fp32 SDPA, then timed
in interleaved rounds; one table of paired ratios B/A."""

_EPILOG = """\
examples:
  # BLOCK_N=64 against the next BLOCK_N the space allows, 5 rounds
  evoengineer ab --space h100 --rounds 5 --param BLOCK_N \\
      --config PATH=mma,BLOCK_M=64,BLOCK_N=64,WARPS=4,VEC=8,P_IN_REGS=1
  # both values given: A has STAGES=1, B STAGES=2
  evoengineer ab --space h100 --param STAGES=1,2 --config PATH=mma,...
  # two configurations
  evoengineer ab --space h100 --config PATH=mma,... --against PATH=wgmma,...
  # a template change: HEAD~1's templates (A) against the working tree's (B)
  evoengineer ab --space h100 --config PATH=mma,... --before HEAD~1 \\
      --add-shape 4,16,2048,128
  # no GPU: compile both sides; registers, spills, shared memory
  evoengineer ab --space h100 --config PATH=mma,... --param STAGES \\
      --compile-only

Parameters left out of --config take their first value in the space. Each
round times A then B on every case (B then A every other round), every
repetition taken; B/A is the median of the rounds' own time ratios, and the
verdict says whether it is below 1 (B faster), above (B slower) or within the
rounds' noise of 1 (same). Exit 0 when both sides are measured, 1 when one
fails its build or gate, 2 on a usage mistake or without a GPU.
"""


def _sides(args: argparse.Namespace, space, config: Config, into):
    from ..bench import AbError, config_sides, param_sides, revision_sides

    try:
        if args.param is not None:
            space, a, b = param_sides(space, config, args.param)
        elif args.against is not None:
            try:
                other = parse_config(args.against, space)
            except UsageError as exc:
                raise UsageError(str(exc).replace("--config", "--against", 1)) from None
            a, b = config_sides(space, config, other)
        else:
            a, b = revision_sides(config, args.before, into)
    except AbError as exc:
        raise UsageError(str(exc)) from None
    return space, (a, b)


def cmd_ab(args: argparse.Namespace) -> int:
    from ..bench import ab_templates_dir

    if args.rounds < 1:
        raise UsageError(f"--rounds: at least 1, got {args.rounds}")
    if args.repetitions is not None and args.repetitions < 5:
        raise UsageError(f"--repetitions: at least 5, got {args.repetitions}")
    space = restrict_shapes(load_space(args.space), args.shape, args.add_shape)
    config = parse_config(args.config, space)
    with ab_templates_dir() as tmp:
        space, sides = _sides(args, space, config, Path(tmp))
        if args.compile_only:
            return _compile_only(space, sides, args.json)
        require_gpu()
        return _measure(args, space, sides)


def _compile_only(space, sides, as_json: bool) -> int:
    from ..bench import build_side

    rows = []
    for side in sides:
        report = build_side(space, side, space.target.arch)
        rows.append({"name": side.name, "config": side.config.to_dict(), "label": side.config.short_label(),
                     "status": report.status, "registers": report.registers, "spill_bytes": report.spill_bytes,
                     "smem": report.smem, "error": report.error})
    ok = all(r["status"] == "compiled" for r in rows)
    if as_json:
        print(json.dumps({"space": space.name, "arch": space.target.arch, "compile_only": True, "sides": rows}))
    else:
        for key, r in zip("AB", rows):
            detail = (f"{r['registers']} registers, {r['spill_bytes']} B spilled, {r['smem']} B shared"
                      if r["status"] == "compiled" else f"{r['status']}: {(r['error'] or '').splitlines()[0][:60]}")
            print(f"{key}: {r['name']}  {r['label']}\n   {space.target.arch}: {detail}")
    return EXIT_OK if ok else EXIT_FAILED


def _measure(args: argparse.Namespace, space, sides) -> int:
    from ..bench import ab_lines, ab_rows, run_ab
    from ..gpu import Evaluator
    from ..kernels import arch_for_device

    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    with Evaluator(space, device=args.device, gate_trials=args.trials) as evaluator:
        info = evaluator.info()
        if info.get("arch"):
            evaluator.arch = arch_for_device(info["arch"], space.target.arch)
        if not args.json:
            print(f"{info.get('gpu', '?')} ({evaluator.arch}), {len(space.cases)} cases, {args.rounds} rounds")
        measured = run_ab(evaluator, sides, args.rounds, args.repetitions, say=None if args.json else say)
    rows = ab_rows(measured)
    ok = all(s["status"] == "ok" for s in measured["sides"])
    if args.json:
        print(json.dumps({"gpu": info, "space": space.name, "rounds": args.rounds, **measured, "rows": rows}))
    else:
        print("\n".join(ab_lines(measured, rows)))
    return EXIT_OK if ok else EXIT_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ab", help="time two kernels against each other: one parameter, two configs or a template change (GPU)",
                       description=_DESCRIPTION,
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", required=True, help="space YAML path or built-in name (its shapes, tolerances, timing)")
    p.add_argument("--config", required=True, help="side A: NAME=VALUE,... (omitted parameters take their first value)")
    other = p.add_mutually_exclusive_group(required=True)
    other.add_argument("--param", metavar="NAME[=..]",
                       help="side B differs in one parameter: NAME (its next value the space allows), NAME=B, or "
                            "NAME=A,B (both sides set); a value the space does not list is judged by its constraints")
    other.add_argument("--against", metavar="CONFIG", help="side B: another configuration NAME=VALUE,...")
    other.add_argument("--before", metavar="REV",
                       help="side A rendered from the templates of git revision REV (or of a directory REV), "
                            "side B from the working tree's")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--repetitions", type=int, help="graph replays per timing (default: the space's)")
    p.add_argument("--shape", action="append", metavar="B,H,S,D", help="only this shape of the space (repeatable)")
    p.add_argument("--add-shape", action="append", metavar="B,H,S,D",
                   help="a shape the space does not list, full and causal (repeatable; alone: only these)")
    p.add_argument("--trials", type=int, default=1, help="random draws per shape for the gate (default 1)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU: compile both sides for the space's arch; registers, spills, shared memory")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.set_defaults(func=cmd_ab)
