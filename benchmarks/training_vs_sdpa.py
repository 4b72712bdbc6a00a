"""The backward of an export against SDPA's (cuDNN, flash) and flash-attn-4's, and a small Llama's
training step (eager and under torch.compile) with SDPA and with the export (--padded: also on a
right-padded batch, SDPA with the padding mask, the export with the batch's lengths; --packed: training
calls on packed sequences, attention_varlen against SDPA sequence by sequence).

    python benchmarks/training_vs_sdpa.py --module best/ [--out bench/] [--quick]
    python benchmarks/training_vs_sdpa.py --module best/ --llama-only --padded
    python benchmarks/training_vs_sdpa.py --module best/ --no-llama --packed

Rows: B4 H16 S2048 D64 and D128, B8 H16 S4096 D128, GQA B2 H32/8 S4096 D128, B1 H32 S8192
D128, full and causal, fp16 and bf16 (a row whose variant the export's backward does not cover
is skipped). Per row: each side's backward device time (CUDA-graph replay) and TF/s (2.5 x the
forward's FLOPs, half for causal) in interleaved rounds, and evo's time over each other side's,
paired per round.
What is measured and how: ``evoengineer.bench.training``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evoengineer.bench.exported import load_module
from evoengineer.bench.protocol import Summary, paired_ratio
from evoengineer.bench.training import (PACKED_ROWS, PADDED_LENGTHS, SHAPES, SIDES, backward_row, llama_step_times,
                                        packed_call_times, summary_lines, time_backwards)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, required=True, help="an export directory (kernel.json and the module)")
    parser.add_argument("--out", type=Path, help="write results.json here")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (default 5)")
    parser.add_argument("--repetitions", type=int, default=30, help="CUDA-graph samples per measurement (default 30)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 10 samples, the first shape only, no Llama")
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama training step")
    parser.add_argument("--llama-only", action="store_true", help="only the Llama training step, eager and compiled")
    parser.add_argument("--packed", action="store_true",
                        help="training calls on packed sequences as well (attention_varlen with gradients, H32/8 D128 "
                             "causal bf16: lengths 1,17,1000,4099 and 16 mixed) against SDPA sequence by sequence")
    parser.add_argument("--padded", action="store_true",
                        help="the Llama step on a padded batch as well (4 rows of 2048/1536/1024/512 tokens, right "
                             "padding): SDPA takes the padding mask, the export its lengths")
    args = parser.parse_args(argv)

    import torch

    module = load_module(args.module)
    rounds, repetitions = (2, 10) if args.quick else (args.rounds, args.repetitions)
    shapes = [] if args.llama_only else SHAPES[:1] if args.quick else SHAPES
    rows = []
    for dtype_name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for shape in shapes:
            for causal in (False, True):
                label = f"{shape.label()}{' causal' if causal else ''} {dtype_name}"
                if (dtype_name, shape.head_dim, causal) not in module.BACKWARD:
                    print(f"{label}: skipped, the export has no backward for it")
                    continue
                row = backward_row(shape, dtype_name, causal,
                                   time_backwards(module, shape, dtype, causal, SIDES, rounds, repetitions))
                rows.append(row)
                cells = [f"{side} {s['median_us']:.0f}us {s['tflops']:.0f}TF/s" if "median_us" in s else f"{side} -"
                         for side, s in row["sides"].items()]
                ratios = " ".join(f"/{side} {r:.2f}" for side, r in row["evo_time_over"].items())
                print(f"{label}: {', '.join(cells)}; evo time {ratios}")
                sys.stdout.flush()
    for line in summary_lines(rows):
        print(line)
    llama: dict[str, dict] = {}
    if not (args.quick or args.no_llama):
        batches = [("B2 S2048", None)] + ([("padded " + "/".join(map(str, PADDED_LENGTHS)), PADDED_LENGTHS)]
                                          if args.padded else [])
        for mode in ("eager", "compiled"):
            for batch, lengths in batches:
                try:
                    steps = llama_step_times(module, rounds=3, steps=5, dtype=torch.bfloat16,
                                             compiled=mode == "compiled", lengths=lengths)
                except ImportError as exc:
                    print(f"Llama step skipped: {exc}")
                    break
                key = mode if lengths is None else f"{mode}, {batch}"
                llama[key] = {name: {"median_ms": Summary.of(ms).median_us, "rounds": ms} for name, ms in steps.items()
                              if ms}
                print(f"Llama (4 layers, 2048 hidden, {batch}, bf16) training step, {mode}, ms: "
                      + ", ".join(f"{name} {s['median_ms']:.1f}" for name, s in llama[key].items()))
                sys.stdout.flush()
    packed: dict[str, dict] = {}
    if args.packed:
        for name, lengths in PACKED_ROWS:
            times = packed_call_times(module, lengths, rounds=3, calls=5, dtype=torch.bfloat16)
            packed[name] = {side: {"median_ms": Summary.of(ms).median_us, "rounds": ms} for side, ms in times.items()}
            ratio = paired_ratio(times["evo"], times["sdpa per sequence"])
            print(f"packed {name} (H32/8 D128 causal bf16) training call, eager, ms: "
                  + ", ".join(f"{side} {s['median_ms']:.2f}" for side, s in packed[name].items())
                  + f"; evo time / sdpa per sequence {ratio:.2f}")
            sys.stdout.flush()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"rows": rows, "llama_step_ms": llama or None,
                                                           "packed_call_ms": packed or None}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
