"""Search strategies: Optuna samplers that propose valid, unseen configurations of a space.

Every strategy is an ``optuna.samplers.BaseSampler``, so any number of workers sharing one
study (any Optuna storage) share the strategy. A trial takes its configuration with
``suggest_config(trial, space)``.
"""
from __future__ import annotations

import inspect
from typing import Any

import optuna

from ...space import Config, Space
from .base import CLAIM_KEY, History, HistoryReader, Proposal, SpaceSampler, read_history, trial_config
from .evo import EvoSampler
from .remote import Recipe
from .grid import GridSearchSampler
from .random_search import RandomSearchSampler
from .tpe import TPESearchSampler

SAMPLERS: dict[str, type[SpaceSampler]] = {
    "evo": EvoSampler,
    "tpe": TPESearchSampler,
    "random": RandomSearchSampler,
    "grid": GridSearchSampler,
}

__all__ = [
    "CLAIM_KEY",
    "EvoSampler",
    "GridSearchSampler",
    "History",
    "HistoryReader",
    "Proposal",
    "RandomSearchSampler",
    "SAMPLERS",
    "SpaceSampler",
    "TPESearchSampler",
    "make_sampler",
    "sampler_recipe",
    "read_history",
    "strategy_options",
    "suggest_config",
    "trial_config",
]


def strategy_options(name: str) -> dict[str, Any]:
    """The options strategy ``name`` accepts, with their defaults."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "seed"}


def sampler_recipe(name: str, space: Space, *, seed: int | None = None, **options: Any) -> Recipe:
    """How ``make_sampler(name, space, seed=seed, **options)`` makes its sampler (what a batch
    process makes its own from)."""
    cls = _lookup(name)
    accepted = strategy_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        known = ", ".join(accepted) or "none"
        raise ValueError(f"unknown option(s) for strategy {name!r}: {', '.join(unknown)} (accepted: {known})")
    return (cls, space, seed, dict(options))


def make_sampler(name: str, space: Space, *, seed: int | None = None, **options: Any) -> SpaceSampler:
    """The sampler of strategy ``name`` (evo, tpe, random, grid) over ``space``."""
    recipe = sampler_recipe(name, space, seed=seed, **options)
    cls, _, _, _ = recipe
    sampler = cls(space, seed=seed, **options)
    sampler.recipe = recipe
    return sampler


def suggest_config(trial: optuna.trial.BaseTrial, space: Space) -> Config:
    """Suggest every parameter of ``space`` on ``trial``; the sampler makes them one valid config
    (on a space written per path, the parameters of its path)."""
    return space.config({p.name: trial.suggest_categorical(p.name, list(p.values)) for p in space.params})


def _lookup(name: str) -> type[SpaceSampler]:
    try:
        return SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; expected one of: {', '.join(SAMPLERS)}") from None
