"""The best configuration of each path against SDPA's backends, shape by shape: the candidates
a comparison takes (hand-picked, or the best of recorded runs), the fastest of each path in a
first pass, and the one a path reports after the rounds (``retime.interleaved_times``)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..gpu import EvalResult
from ..space import Config

HAND_PICKED = [  # per-regime winners of h100 searches (NVIDIA H100)
    "PATH=scalar,BLOCK_M=16,BLOCK_N=64,WARPS=4,VEC=8",
    "PATH=wmma,BLOCK_M=64,BLOCK_N=32,WARPS=2,VEC=8",
    "PATH=mma,BLOCK_M=128,BLOCK_N=64,WARPS=4,VEC=8,STAGES=1,SMEM_LAYOUT=swizzle,Q_IN_REGS=0,P_IN_REGS=1,SPLITS=1,KV_GROUPS=1",
    "PATH=mma,BLOCK_M=32,BLOCK_N=64,WARPS=8,VEC=8,STAGES=1,SMEM_LAYOUT=swizzle,Q_IN_REGS=1,P_IN_REGS=1,SPLITS=1,KV_GROUPS=4",
]


def configs_from_leaderboards(runs: list[Path], top: int = 1) -> list[Config]:
    """For each shape and path the runs recorded, the ``top`` configurations with the shortest times
    on that shape (each configuration once, at its best time over the runs)."""
    times: dict[tuple[str, str], dict[str, tuple[float, dict]]] = {}
    for run in runs:
        for line in (run / "results.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("status") != "ok":
                continue
            for case in r.get("cases", []):
                us = (case.get("time") or {}).get("median_us")
                per = times.setdefault((case["label"], r["config"]["PATH"]), {})
                key = Config(r["config"]).key()
                if us is not None and (key not in per or us < per[key][0]):
                    per[key] = (us, r["config"])
    best = [x for per in times.values() for x in sorted(per.values(), key=lambda x: x[0])[:top]]
    picked = {Config(cfg).key(): Config(cfg) for _, cfg in sorted(best, key=lambda x: x[0])}
    return list(picked.values())


def case_time(result: EvalResult, label: str) -> dict | None:
    return next((c for c in result.cases if c["label"] == label and c.get("time")), None)


def fastest(results: list[EvalResult], label: str, path: str, n: int) -> list[Config]:
    """The ``n`` fastest candidates of ``path`` on shape ``label`` in the first pass."""
    timed = [(c["time"]["median_us"], Config(r.config)) for r in results if r.ok and r.config["PATH"] == path
             for c in [case_time(r, label)] if c is not None]
    return [config for _, config in sorted(timed, key=lambda x: x[0])[:n]]


def candidate_name(path: str, index: int) -> str:
    """The re-timed candidate ``index`` (0: the first pass's fastest) of ``path``: ``wgmma#1``, ``wgmma#2``, ..."""
    return f"{path}#{index + 1}"


def rounds_winner(us: dict[str, list[float]], path: str) -> str | None:
    """Of the re-timed candidates of ``path``, the one with the lowest median over the rounds."""
    names = [n for n in us if n.split("#")[0] == path]
    return min(names, key=lambda n: statistics.median(us[n])) if names else None
