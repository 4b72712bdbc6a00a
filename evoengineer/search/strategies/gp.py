"""A Gaussian process over configurations, and expected improvement.

Configurations are points in *steps*: an ordinal parameter by the index of its value (two
adjacent values are one step apart), a categorical one one-hot, scaled so that two different
values are one step apart; parameters with one value are left out. The process models the
log objective, standardised, with an isotropic Matern 5/2 kernel; its length scale and noise
are those of a small grid that maximise the marginal likelihood (the signal variance is
profiled out). A configuration still being evaluated (asked ahead, or by another worker)
counts as what the evaluated ones alone predict for it (a kriging believer): the process's
mean there stays, its uncertainty shrinks, so the next proposal looks elsewhere. The length
scale and noise come from the evaluated configurations alone.

Failed configurations stay out of the regression: the fastest kernels often lie next to the
ones that fail (too many registers, too much shared memory), and a failure made to look slow
would push the search away from them. ``feasibility`` estimates the chance that a
configuration runs instead (the successes' share among the evaluated ones near it, weighted
by the same kernel, with a uniform prior); it multiplies the expected improvement.

Beyond ``max_points`` observations the process keeps the best half and the rest evenly over
the ranking. numpy only: on one slow core, fitting 200 points takes ~30 ms with the search
of the grid, ~3 ms with the length scale and noise kept; predicting 100 configurations ~1 ms.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ...space import Config, Space

LENGTH_SCALES = (1.0, 1.4, 2.0, 2.8, 4.0, 5.6, 8.0, 11.2)
"""Length scales tried, in steps."""
NOISES = (1e-4, 1e-2, 1e-1)
"""Noise variances tried, relative to the signal variance."""
_SQRT5 = math.sqrt(5.0)
_erf = np.frompyfunc(math.erf, 1, 1)


class Encoder:
    """Configurations of ``space`` as rows of floats, in steps."""

    def __init__(self, space: Space) -> None:
        self.columns: list[tuple[str, dict[object, np.ndarray]]] = []
        for p in space.params:
            if len(p.values) < 2:
                continue
            if p.ordinal:
                self.columns.append((p.name, {v: np.array([float(i)]) for i, v in enumerate(p.values)}))
            else:
                eye = np.eye(len(p.values)) / math.sqrt(2.0)
                self.columns.append((p.name, {v: eye[i] for i, v in enumerate(p.values)}))
        self.width = sum(len(next(iter(index.values()))) for _, index in self.columns)

    def __call__(self, configs: Sequence[Config]) -> np.ndarray:
        if not self.columns or not len(configs):
            return np.zeros((len(configs), self.width))
        rows = [c.canonical() for c in configs]  # a path's unused parameters at their neutral values
        return np.array([np.concatenate([index[c[name]] for name, index in self.columns]) for c in rows])


def matern52(d: np.ndarray) -> np.ndarray:
    """Matern 5/2 correlation at scaled distances ``d``."""
    s = _SQRT5 * d
    out = np.negative(s)
    np.exp(out, out=out)
    poly = np.multiply(s, s)
    poly /= 3.0
    s += 1.0
    s += poly  # (1 + s) + s^2/3, as written out
    out *= s
    return out


def distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distance of each row of ``a`` to each row of ``b``."""
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.sqrt(np.maximum(d2, 0.0))


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float) -> np.ndarray:
    """Expected improvement below ``best`` of normal predictions (minimisation)."""
    std = np.maximum(std, 1e-12)
    z = (best - mean) / std
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)).astype(float))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (best - mean) * cdf + std * pdf


class GaussianProcess:
    """Posterior of the log objective, given evaluated (and pending) configurations as rows."""

    def __init__(self, *, length_scales: Sequence[float] = LENGTH_SCALES,
                 noises: Sequence[float] = NOISES, max_points: int = 200) -> None:
        if not length_scales or min(length_scales) <= 0 or not noises or min(noises) < 0:
            raise ValueError("length scales must be > 0 and noises >= 0 (at least one of each)")
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, got {max_points}")
        self.max_points = max_points
        self.length_scales = tuple(length_scales)
        self.noises = tuple(noises)
        self.length_scale = self.length_scales[0]
        self.noise = self.noises[0]
        self.best = math.inf  # the lowest log objective observed
        self._x = np.zeros((0, 0))
        self._chol: np.ndarray | None = None  # Cholesky factor of the training rows' correlations
        self._w = np.zeros(0)  # its inverse times the standardised objectives
        self._mean, self._scale, self._var = 0.0, 1.0, 1.0

    def fit(self, ok: np.ndarray, objectives: Sequence[float], pending: np.ndarray | None = None,
            keep_hyperparameters: bool = False) -> "GaussianProcess":
        """``ok``: rows with their objectives (> 0); ``pending``: rows still being evaluated.
        ``keep_hyperparameters``: the length scale and noise of the last fit, not searched again
        (a batch's later proposals: the same data plus fantasised pending rows)."""
        logs = np.log(np.asarray(objectives, dtype=float))
        rows, ys = [ok], [logs]
        if pending is not None and len(pending) and len(logs):
            # a kriging believer: each pending row at the mean the evaluated rows alone predict
            # for it, under their own length scale and noise
            self.fit(ok, objectives, keep_hyperparameters=keep_hyperparameters)
            rows.append(pending)
            ys.append(self.predict(pending)[0])
            keep_hyperparameters = True
        self.best = float(logs.min()) if len(logs) else math.inf
        x, y = np.vstack(rows), np.concatenate(ys)
        if len(y) > self.max_points:  # the best half, and the rest evenly over the ranking
            order = np.argsort(y, kind="stable")
            half = self.max_points // 2
            rest = order[half:][np.linspace(0, len(order) - half - 1, self.max_points - half).round().astype(int)]
            keep = np.concatenate([order[:half], rest])
            x, y = x[keep], y[keep]
        self._x = x
        self._chol = None
        if not len(y):
            return self
        self._mean = float(y.mean())
        self._scale = float(y.std()) if y.std() > 0 else 1.0
        z = (y - self._mean) / self._scale
        d = distances(x, x)
        n = len(z)
        best = None
        scales, noises = ((self.length_scale,), (self.noise,)) if keep_hyperparameters else (self.length_scales, self.noises)
        for ls in scales:
            r = matern52(d / ls)
            for noise in noises:
                try:
                    chol = np.linalg.cholesky(r + (noise + 1e-8) * np.eye(n))
                except np.linalg.LinAlgError:
                    continue
                w = np.linalg.solve(chol, z)
                var = max(float(w @ w) / n, 1e-12)
                lml = -0.5 * n * math.log(var) - float(np.log(np.diag(chol)).sum())
                if best is None or lml > best[0]:
                    best = (lml, ls, noise, chol, var, w)
        if best is None:
            return self
        _, self.length_scale, self.noise, self._chol, self._var, self._w = best
        return self

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the log objective at rows ``x``."""
        if self._chol is None:
            return np.full(len(x), self._mean), np.full(len(x), self._scale)
        k = matern52(distances(x, self._x) / self.length_scale)
        v = np.linalg.solve(self._chol, k.T)  # L^-1 k: the mean is v.w, the variance 1 - v.v
        var = np.maximum(1.0 - (v * v).sum(0), 1e-12) * self._var
        return self._mean + self._scale * (self._w @ v), self._scale * np.sqrt(var)

    def feasibility(self, x: np.ndarray, ok: np.ndarray, failed: np.ndarray) -> np.ndarray:
        """The chance that rows ``x`` run: the share of successes among the evaluated rows
        (``ok``, ``failed``) near them, weighted by the kernel, a Beta(1, 1) prior; 1 without failures."""
        if not len(failed):
            return np.ones(len(x))
        k_ok = matern52(distances(x, ok) / self.length_scale).sum(1) if len(ok) else 0.0
        k_failed = matern52(distances(x, failed) / self.length_scale).sum(1)
        return (1.0 + k_ok) / (2.0 + k_ok + k_failed)

    def expected_improvement(self, x: np.ndarray) -> np.ndarray:
        """Expected improvement of the log objective below the best observed, at rows ``x``."""
        mean, std = self.predict(x)
        return expected_improvement(mean, std, self.best)
