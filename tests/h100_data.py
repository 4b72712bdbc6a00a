"""Figures measured on an NVIDIA H100 (docs/performance.md) shaped like what a search
records: SDPA's backends per shape, finalists with per-shape timings, a re-timed leaderboard."""
from __future__ import annotations

from evoengineer.gpu import SDPA_BACKENDS
from evoengineer.results import build_leaderboard
from evoengineer.search import geomean
from evoengineer.space import Config, load_space

H100 = load_space("h100")
FLOPS = {c.label(): c.flops() for c in H100.cases}
LABELS = [c.label() for c in H100.cases]  # B1 H8 S512 D64, ... causal, B4 H16 S2048 D64, ..., B4 H16 S2048 D128 causal

# SDPA's backends on the H100, µs per shape in LABELS' order: flash, cudnn, efficient, math
SDPA_US = {
    "flash": [10.7, 10.8, 234.8, 157.2, 408.4, 273.6],
    "cudnn": [10.0, 10.1, 153.4, 99.5, 219.5, 148.9],
    "efficient": [23.5, 23.6, 553.1, 339.9, 846.8, 541.3],
    "math": [70.4, 89.5, 4756.3, 5856.9, 6036.7, 7131.7],
}
MMA = dict(PATH="mma", VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=0, P_IN_REGS=0, SPLITS=1, KV_GROUPS=1)
PLAIN = dict(VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=0, P_IN_REGS=0, SPLITS=1, KV_GROUPS=1)
FINALISTS = [  # (configuration, µs per shape, max abs error, registers, shared memory)
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 4, "P_IN_REGS": 1}, [15.4, 15.2, 234.4, 164.7, 394.8, 244.3], 1.1e-3, 255, 65536),
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 4, "STAGES": 2, "P_IN_REGS": 1}, [11.2, 13.3, 220.2, 162.6, 403.7, 255.3], 1.2e-3, 255, 98304),
    ({**MMA, "BLOCK_M": 32, "BLOCK_N": 64, "WARPS": 8, "Q_IN_REGS": 1, "P_IN_REGS": 1, "KV_GROUPS": 4}, [6.4, 6.3, 294.8, 183.0, 578.4, 367.4], 8.3e-4, 136, 135168),
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 128, "WARPS": 8, "STAGES": 3, "SMEM_LAYOUT": "pad", "Q_IN_REGS": 1, "P_IN_REGS": 1,
      "SPLITS": 4, "KV_GROUPS": 4}, [9.0, 9.5, 300.0, 200.0, 600.0, 400.0], 1.4e-3, 255, 212992),
    ({**PLAIN, "PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4}, [21.8, 21.0, 523.0, 346.9, 861.6, 551.4], 2.5e-4, 128, 52224),
    ({**PLAIN, "PATH": "scalar", "BLOCK_M": 32, "BLOCK_N": 32, "WARPS": 4, "VEC": 4}, [39.7, 40.9, 2572.4, 1447.2, 5093.8, 2963.9], 1.2e-4, 96, 30208),
]


def _time(median: float) -> dict:
    return {"median_us": median, "p20_us": round(median * 0.985, 2), "p80_us": round(median * 1.02, 2), "repetitions": 100}


def h100_baseline() -> dict:
    return {label: {b: {"status": "ok", "time": _time(SDPA_US[b][i]), "tflops": FLOPS[label] / (SDPA_US[b][i] * 1e-6) / 1e12}
                    for b in SDPA_BACKENDS} for i, label in enumerate(LABELS)}


def h100_cases(times: list[float], err: float) -> list[dict]:
    return [{"label": label, "status": "ok", "max_abs_err": err * (0.5 + 0.1 * i), "rel_l2_err": err / 7, "trials": 3,
             "time": _time(t), "tflops": FLOPS[label] / (t * 1e-6) / 1e12} for i, (label, t) in enumerate(zip(LABELS, times))]


def h100_board() -> dict:
    """A leaderboard as ``search`` writes it: finalists re-timed interleaved with SDPA."""
    records, retimed = [], {"candidates": {}, "failures": {}, "sdpa": {}}
    for config, times, err, regs, smem in FINALISTS:
        key = Config(config).key()
        records.append({"config": config, "key": key, "status": "ok", "objective_us": geomean(times),
                        "resources": {"registers": regs, "smem": smem, "spill_bytes": 0}, "cases": h100_cases(times, err)})
        retimed["candidates"][key] = {l: {"median_us": t * 1.01, "min_us": t, "max_us": t * 1.03, "rounds": 3} for l, t in zip(LABELS, times)}
    for i, label in enumerate(LABELS):
        retimed["sdpa"][label] = {b: {"median_us": SDPA_US[b][i] * 1.01, "min_us": SDPA_US[b][i], "max_us": SDPA_US[b][i] * 1.02,
                                      "rounds": 3} for b in SDPA_BACKENDS}
    board = build_leaderboard(records, retimed, h100_baseline(), FLOPS, "NVIDIA H100 80GB HBM3")
    board.update(space="h100", run="runs/20250301-101500-h100-3f9a1c")
    return board
