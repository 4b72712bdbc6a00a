"""Write ``replay_synthetic.jsonl``: a made-up recording over a small space, for strategy tests.

The objective is smooth in the ordinal parameters' indices with one optimum, multiplicative
noise of about 2 %, and about 10 % failures. Run ``python tests/data/make_synthetic.py``.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from evoengineer.space import Config, parse_space

SPACE: dict[str, Any] = {
    "name": "synthetic",
    "description": "Synthetic space for strategy tests (no GPU).",
    "target": {"name": "synthetic", "arch": "sm_89", "sms": 58, "smem_per_block": 101376},
    "problem": {"shapes": [{"B": 1, "H": 8, "S": 512, "D": 64, "causal": [False, True]}]},
    "template": "flash_attention",
    "params": {
        "PATH": ["scalar", "wmma"],
        "BLOCK_M": [16, 32, 64, 128],
        "BLOCK_N": [32, 64, 128],
        "WARPS": [1, 2, 4, 8],
        "VEC": [4, 8],
        "SCHED": ["row", "col", "swizzle"],
    },
    "constraints": [
        "WARPS <= BLOCK_M // 16 or (PATH == 'scalar' and WARPS <= BLOCK_M)",
        "(BLOCK_M + 2 * BLOCK_N) * (MAX_HEAD_DIM + 8) * 2 + BLOCK_M * (BLOCK_N + 4) * 4 <= SMEM_LIMIT",
        "PATH == 'wmma' or SCHED == 'row'",
    ],
    "search": {
        "population": 12,
        "seeds": [
            {"PATH": "scalar", "BLOCK_M": 32, "BLOCK_N": 32, "WARPS": 4, "VEC": 8, "SCHED": "row"},
            {"PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8, "SCHED": "row"},
        ],
    },
}

OPTIMUM = {"PATH": "wmma", "BLOCK_M": 128, "BLOCK_N": 32, "WARPS": 8, "VEC": 4, "SCHED": "swizzle"}
FAILURES = (
    ("compile_failed", "ptxas: too many resources requested"),
    ("incorrect", "max abs error 0.31 > atol 0.02"),
    ("crashed", "CUDA error: misaligned address"),
    ("timeout", "exceeded 10 s"),
)


def objective(cfg: Config, params: dict[str, list[Any]]) -> float:
    """Device time in µs without noise: minimal at ``OPTIMUM``."""
    d = {n: params[n].index(cfg[n]) - params[n].index(OPTIMUM[n]) for n in ("BLOCK_M", "BLOCK_N", "WARPS", "VEC")}
    shape = 1 + 0.12 * d["BLOCK_M"] ** 2 + 0.10 * d["BLOCK_N"] ** 2 + 0.08 * d["WARPS"] ** 2 + 0.06 * abs(d["VEC"])
    shape += 0.03 * abs(d["BLOCK_M"] - d["WARPS"])  # mild coupling of tile height and warps
    path = 1.0 if cfg["PATH"] == "wmma" else 1.8
    sched = {"row": 1.0, "col": 1.08, "swizzle": 0.93}[str(cfg["SCHED"])]
    return 100.0 * shape * path * sched


def records(seed: int = 7) -> list[dict[str, Any]]:
    space = parse_space(SPACE, "synthetic.yaml")
    rng = random.Random(seed)
    protected = {Config(OPTIMUM), *space.search.seeds}
    out = []
    for cfg in space.valid_configs():
        noise = math.exp(rng.gauss(0.0, 0.02))
        if cfg not in protected and rng.random() < 0.10:
            status, reason = rng.choice(FAILURES)
            out.append({"config": cfg.to_dict(), "key": cfg.key(), "status": status, "reason": reason, "objective_us": None})
            continue
        value = objective(cfg, SPACE["params"]) * (1.0 if cfg == Config(OPTIMUM) else noise)
        out.append({"config": cfg.to_dict(), "key": cfg.key(), "status": "ok", "reason": "", "objective_us": round(value, 3)})
    best = min(r["objective_us"] for r in out if r["status"] == "ok")
    near = [r for r in out if r["status"] == "ok" and r["objective_us"] <= 1.02 * best]
    assert len(near) == 1 and Config(near[0]["config"]) == Config(OPTIMUM), near
    return out


def main() -> None:
    path = Path(__file__).with_name("replay_synthetic.jsonl")
    rows = records()
    with path.open("w") as fh:
        fh.write(json.dumps({"header": {"space_inline": SPACE, "gpu": "synthetic"}}) + "\n")
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    fails = sum(r["status"] != "ok" for r in rows)
    print(f"wrote {path} ({len(rows)} records, {fails} failures)")


if __name__ == "__main__":
    main()
