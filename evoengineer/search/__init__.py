"""The search: strategies that propose configurations, the loop that evaluates and
records them in an Optuna study, and replay of recorded measurements (no GPU)."""
from __future__ import annotations

from .ledger import Ledger
from .loop import (
    DEFAULT_STORAGE,
    PHASES,
    RESULTS,
    RUN_META,
    CandidateEvaluator,
    RunDir,
    RunFileError,
    SearchPart,
    SearchStats,
    best_results,
    check_records,
    counted_trials,
    geomean,
    open_study,
    recover_interrupted,
    run_parts,
    run_search,
    tell,
)
from .replay import (
    NOT_RECORDED,
    ReplayCandidates,
    ReplayEvaluator,
    ReplayResult,
    evaluations_to_reach,
    replay_trial,
    run_replay,
)
from .strategies import make_sampler, suggest_config
from .study import DEFAULT_HEARTBEAT_S, GRACE_BEATS, link_run, make_storage, requeue_stale, storage_error, study_problem

__all__ = [
    "DEFAULT_HEARTBEAT_S", "DEFAULT_STORAGE", "GRACE_BEATS", "Ledger", "PHASES", "RunFileError", "link_run", "make_storage",
    "requeue_stale", "storage_error", "study_problem",
    "NOT_RECORDED", "RESULTS", "ReplayCandidates", "RUN_META", "CandidateEvaluator", "ReplayEvaluator", "ReplayResult", "RunDir",
    "SearchPart", "SearchStats", "best_results", "check_records", "counted_trials", "evaluations_to_reach", "geomean", "make_sampler",
    "open_study", "recover_interrupted", "replay_trial", "run_parts", "run_replay", "run_search", "suggest_config", "tell",
]
