"""A cheap surrogate of the objective: kernel regression over configurations.

The prediction for a configuration is the Gaussian-kernel-weighted mean (Nadaraya-Watson) of
the log objective of the configurations evaluated so far. The distance between two
configurations adds, per parameter, the index difference of an ordinal parameter over its
range times two (adjacent values of a four-valued parameter are 2/3 apart, its extremes 2),
and 1 for a categorical parameter that differs. A failed configuration counts as
``fail_penalty`` (in log units) worse than the worst success, so that regions that fail to
compile or run look slow. The model makes no claim to accuracy: it ranks a handful of
children of good parents, which is all the evolutionary strategy asks of it.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ...space import Config, Space


class KernelRegression:
    """Predicts the log objective of configurations of ``space`` from evaluated ones."""

    def __init__(self, space: Space, *, bandwidth: float = 1.0, fail_penalty: float = 0.5) -> None:
        if bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
        self.bandwidth = bandwidth
        self.fail_penalty = fail_penalty
        params = [p for p in space.params if len(p.values) > 1]
        self._ordinal = [(p.name, {v: i / (len(p.values) - 1) for i, v in enumerate(p.values)}) for p in params if p.ordinal]
        self._categorical = [(p.name, {v: i for i, v in enumerate(p.values)}) for p in params if not p.ordinal]
        self._x: tuple[np.ndarray, np.ndarray] | None = None
        self._y = np.zeros(0)

    def encode(self, configs: Sequence[Config]) -> tuple[np.ndarray, np.ndarray]:
        """Ordinal positions in [0, 1] and categorical indices, one row per configuration."""
        rows = [c.canonical() for c in configs]  # a path's unused parameters at their neutral values
        ordinal = np.array([[index[c[name]] for name, index in self._ordinal] for c in rows], dtype=float)
        categorical = np.array([[index[c[name]] for name, index in self._categorical] for c in rows], dtype=int)
        return ordinal.reshape(len(configs), len(self._ordinal)), categorical.reshape(len(configs), len(self._categorical))

    def fit(self, complete: Sequence[tuple[Config, float]], failed: Sequence[Config] = ()) -> "KernelRegression":
        """Evaluated configurations: (config, objective > 0) pairs and failed configurations."""
        logs = [math.log(v) for _, v in complete if v > 0]
        worst = max(logs) if logs else 0.0
        configs = [c for c, v in complete if v > 0] + list(failed)
        self._y = np.array(logs + [worst + self.fail_penalty] * len(failed))
        self._x = self.encode(configs) if configs else None
        return self

    def distances(self, configs: Sequence[Config]) -> np.ndarray:
        """Distance of each of ``configs`` (rows) to each fitted configuration (columns)."""
        if self._x is None:
            return np.zeros((len(configs), 0))
        ordinal, categorical = self.encode(configs)
        fitted_o, fitted_c = self._x
        d = 2.0 * np.abs(ordinal[:, None, :] - fitted_o[None, :, :]).sum(-1)
        return d + (categorical[:, None, :] != fitted_c[None, :, :]).sum(-1)

    def predict(self, configs: Sequence[Config]) -> np.ndarray:
        """Predicted log objective of each configuration (0 for all before any data)."""
        if self._x is None or not len(configs):
            return np.zeros(len(configs))
        weights = np.exp(-0.5 * (self.distances(configs) / self.bandwidth) ** 2) + 1e-12
        return (weights * self._y[None, :]).sum(1) / weights.sum(1)
