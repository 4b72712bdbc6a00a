"""Everything that touches the GPU: launch, correctness gate, device timing, worker processes.

``Evaluator`` gates and times one configuration in a crash-isolating worker process
and returns an ``EvalResult`` whose ``status`` is one of ``STATUSES``; ``baseline``
times SDPA's backends with the same harness (``evoengineer.bench`` re-times in rounds). torch and CuPy are
imported only when a GPU job runs.
"""
from __future__ import annotations

from .evaluate import (
    EDGE_KV,
    EDGE_SEQS,
    HANDLER,
    REFERENCE_CALLS,
    SDPA_BACKENDS,
    STATUSES,
    CaseResult,
    EvalResult,
    Evaluator,
    fastest_sdpa,
    gate_cases,
    gpu_info,
)
from .launch import AttentionKernel, LaunchError
from .worker import Worker, WorkerOutcome, WorkerPool

__all__ = [
    "EDGE_KV", "EDGE_SEQS", "HANDLER", "REFERENCE_CALLS", "SDPA_BACKENDS", "STATUSES", "AttentionKernel", "CaseResult", "EvalResult",
    "Evaluator", "LaunchError", "Worker", "WorkerOutcome", "WorkerPool", "fastest_sdpa", "gate_cases",
    "gpu_info",
]
