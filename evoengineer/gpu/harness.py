"""What every job in a worker shares: the fault that costs the worker its CUDA context, the
stream synchronisation that surfaces it, per-case results and seeds, the output check, and the
one place a timing protocol becomes ``time_graph``'s arguments."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..space import Case


@dataclass
class CaseResult:
    label: str
    status: str
    reason: str = ""
    max_abs_err: float | None = None
    rel_l2_err: float | None = None
    trials: int = 0
    seed: int | None = None
    time: dict | None = None
    tflops: float | None = None

    @property
    def median_us(self) -> float | None:
        return self.time["median_us"] if self.time else None


def case_seed(base: int, key: str, case: Case) -> int:
    digest = hashlib.sha256(f"{base}:{key}:{case.label()}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _KernelFault(Exception):
    """A CUDA error during or after a launch: the context may be poisoned."""


def _sync(stream: Any = None) -> None:
    import torch

    try:
        (stream or torch.cuda.current_stream()).synchronize()
    except Exception as exc:  # noqa: BLE001 - CUDA errors surface here as RuntimeError or CUDADriverError
        raise _KernelFault(f"CUDA error: {str(exc).splitlines()[0]}") from exc


def check_output(out: Any, ref: Any, atol: float, rtol: float) -> tuple[str, float, float]:
    """(reason or '', max abs error, relative L2 error) of ``out`` against ``ref``."""
    import torch

    outf = out.float()
    finite = torch.isfinite(outf)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        count = int((~finite).sum())
        return f"{count} of {out.numel()} outputs not finite or never written (first at {tuple(bad)})", math.inf, math.inf
    err = (outf - ref).abs()
    max_abs = float(err.max())
    rel_l2 = float(torch.linalg.vector_norm(outf - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
    over = err > atol + rtol * ref.abs()
    if bool(over.any()):
        where = tuple(over.nonzero()[0].tolist())
        return f"max abs error {max_abs:.4g} exceeds atol {atol:g} + rtol {rtol:g}*|ref| (first at {where})", max_abs, rel_l2
    return "", max_abs, rel_l2


def _time_ops(ops: Sequence[Callable[[], Any]], timing: dict, **extra: Any) -> Any:
    """``time_graph`` under a timing protocol (``Timing.protocol()``, plus a job's
    ``give_up_above_us``): the one place a protocol becomes time_graph's arguments."""
    from .timing import time_graph

    return time_graph(ops, repetitions=timing["repetitions"], warmup=timing["warmup"],
                      min_repetitions=timing.get("min_repetitions"), precision=timing.get("precision", 0.0),
                      give_up_above_us=timing.get("give_up_above_us"), **extra)
