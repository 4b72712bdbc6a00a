"""Kernel Tuner's strategies replayed on our recordings (Kernel Tuner >= 1.0, simulation mode).

``write_cache`` converts a recording into Kernel Tuner's cache file: a JSON object with
``device_name``, ``kernel_name``, ``problem_size``, ``tune_params_keys`` (parameter order),
``tune_params`` and ``cache``, whose keys are the values joined by commas in that order and
whose entries hold the parameters, ``time`` (our objective in µs; Kernel Tuner minimises it
whatever the unit) or, for a failed configuration, the name of Kernel Tuner's error
(``CompilationFailedConfig``, ``RuntimeFailedConfig``, ``InvalidConfig``), and zero compile,
verification and benchmark times. Every valid configuration of the space is in the cache.

``run_strategy`` calls ``kernel_tuner.tune_kernel(..., simulation_mode=True, cache=...)``
with the space's constraints as one restriction (the set of valid configurations), so
Kernel Tuner's search space is ours exactly, and returns the objective of each configuration
in the order Kernel Tuner first evaluated it: its budget counts unique configurations in the
cache, as ours counts unique valid configurations. Kernel Tuner draws from the global
``random`` and ``numpy.random`` generators; both are seeded per run.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import warnings
from pathlib import Path
from typing import Any, Sequence

from evoengineer.search import ReplayEvaluator
from evoengineer.space import Config, Space

PROBLEM_SIZE = (1,)

# Kernel Tuner's strategies that fit a constrained space of discrete values, run by default.
STRATEGIES = (
    "brute_force", "random_sample", "genetic_algorithm", "diff_evo", "pso", "firefly_algorithm",
    "simulated_annealing", "dual_annealing", "basinhopping", "minimize", "mls", "greedy_mls",
    "ordered_greedy_mls", "greedy_ils", "bayes_opt", "adaptive_tabu_greywolf",
)
# Those left out, and why (Kernel Tuner 1.5).
EXCLUDED = {
    "skopt": "needs scikit-optimize (not a dependency of Kernel Tuner)",
    "pyatf_strategies": "needs pyATF (not a dependency of Kernel Tuner)",
    "nsga2": "pymoo's multi-objective NSGA-II: over 2 minutes per run on a 208-configuration space",
    "nsga3": "pymoo's many-objective NSGA-III: over 2 minutes per run on a 208-configuration space",
    "hybrid_vndx": "over 2 minutes per run on a 208-configuration space",
}
DETERMINISTIC = {"brute_force"}
# Evaluations a run may ask for, repeats of configurations already evaluated included, per
# configuration of its budget: Kernel Tuner charges only new configurations, and some of its
# strategies (greedy_ils on a 778-configuration space) revisit cached ones without end.
REPEAT_CAP = 50

_ERRORS = {"compile_failed": "CompilationFailedConfig", "invalid": "InvalidConfig"}


def available() -> bool:
    try:
        import kernel_tuner  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str | None:
    try:
        from importlib.metadata import version as _version

        return _version("kernel_tuner")
    except Exception:
        return None


def cache_key(config: Config, names: Sequence[str]) -> str:
    return ",".join(str(config[n]) for n in names)


def write_cache(replay: ReplayEvaluator, space: Space, path: Path) -> Path:
    """Kernel Tuner's cache file for ``space`` from the recording ``replay`` (``path`` ends in .json)."""
    if path.suffix != ".json":
        raise ValueError(f"{path}: Kernel Tuner's cache file name must end in .json")
    names = list(space.param_names)
    cache: dict[str, dict[str, Any]] = {}
    for config in space.valid_configs():
        result = replay.evaluate(config)
        entry: dict[str, Any] = {n: config[n] for n in names}
        if result.ok:
            entry["time"] = result.objective_us
        else:
            entry["time"] = _ERRORS.get(result.status, "RuntimeFailedConfig")
        entry.update(compile_time=0.0, verification_time=0.0, benchmark_time=0.0, status=result.status)
        cache[cache_key(config, names)] = entry
    doc = {
        "device_name": str(replay.header.get("gpu") or "recording"),
        "kernel_name": space.name,
        "problem_size": list(PROBLEM_SIZE),
        "tune_params_keys": names,
        "tune_params": {p.name: list(p.values) for p in space.params},
        "objective": "time",
        "cache": cache,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def run_strategy(cache: Path, space: Space, strategy: str, seed: int, budget: int) -> list[float | None]:
    """Objective (None: failed) of each configuration Kernel Tuner's ``strategy`` evaluated, in order."""
    import numpy as np
    from constraint import FunctionConstraint
    from kernel_tuner import tune_kernel

    names = list(space.param_names)
    valid = {tuple(c[n] for n in names) for c in space.valid_configs()}

    def is_valid(*values: Any) -> bool:
        return values in valid

    random.seed(seed)
    np.random.seed(seed)
    options = {} if strategy in DETERMINISTIC else {"max_fevals": budget}
    capped = _Capped(strategy, REPEAT_CAP * budget)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        results, _ = tune_kernel(
            space.name, "", PROBLEM_SIZE, [], {p.name: list(p.values) for p in space.params},
            restrictions=[FunctionConstraint(is_valid)], strategy=capped, strategy_options=options,
            cache=str(cache), simulation_mode=True, quiet=True, verbose=False,
        )
    trace: list[float | None] = []
    seen: set[tuple] = set()
    for result in results:
        if not result:
            continue
        key = tuple(result[n] for n in names)
        if key in seen or key not in valid:
            continue
        seen.add(key)
        value = result.get("time")
        ok = "__error__" not in result and isinstance(value, (int, float)) and not isinstance(value, bool)
        trace.append(float(value) if ok else None)
    return trace[:budget]


class _Capped:
    """Kernel Tuner's strategy ``name`` (its own ``tune``), stopped after ``cap`` evaluations
    in all: the runner it is handed raises Kernel Tuner's own stop signal, which its
    strategies catch to return what they evaluated so far."""

    def __init__(self, name: str, cap: int) -> None:
        from kernel_tuner.interface import strategy_map

        if name not in strategy_map:
            raise ValueError(f"unknown Kernel Tuner strategy {name!r}; expected one of: {', '.join(strategy_map)}")
        self.name = name
        self.module = strategy_map[name]
        self.cap = cap

    def tune(self, searchspace: Any, runner: Any, tuning_options: Any) -> list:
        from kernel_tuner.util import StopCriterionReached

        capped = _CappedRunner(runner, self.cap)
        try:
            return self.module.tune(searchspace, capped, tuning_options)
        except StopCriterionReached:  # a strategy that does not catch it: what the runner returned
            return capped.results


class _CappedRunner:
    """A Kernel Tuner runner that stops the search after ``cap`` evaluations."""

    def __init__(self, runner: Any, cap: int) -> None:
        self._runner = runner
        self._left = cap
        self.results: list = []

    def run(self, parameter_space: Any, tuning_options: Any) -> list:
        from kernel_tuner.util import StopCriterionReached

        configs = list(parameter_space)
        self._left -= len(configs)
        if self._left < 0:
            raise StopCriterionReached("evaluation cap (repeats included) reached")
        out = self._runner.run(configs, tuning_options)
        self.results.extend(r for r in out if r)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
