"""The backward kernels of an export: which configurations, and their ``kernel.json`` entries.

Every (dtype, head_dim, causal) of an export whose head dim the backward supports
(``kernels.backward_rules.HEAD_DIMS``) gets an LSE forward (``forward_lse_config``), a backward
configuration (given with ``--backward``, a backward search's per-case winners, else the head
dim's default) and a deterministic one (dQ without atomics: the chosen one where it is
deterministic already, else the head dim's deterministic default). For calls with a window or a
soft cap it also gets an LSE forward and backward kernels built with those switches
(``feature_configs``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..kernels import Rendered
from ..kernels.backward_rules import (
    BACKWARD_CONFIGS,
    HEAD_DIMS,
    WGMMA_CONFIGS,
    backward_arguments,
    backward_launch_arguments,
    backward_launches,
    default_config,
    deterministic,
    holds_features,
    path_defaults,
    problems,
)
from ..space import Config
from .per_shape import ExportError, Shape

WORKSPACE_FLOATS = {"Dsum": lambda head_dim: 1, "dQacc": lambda head_dim: head_dim}
"""fp32 floats per query row of each backward workspace: D = rowsum(dO * O), and the atomic dQ accumulator."""


@dataclass(frozen=True)
class MeasuredBackward:
    """A measured backward case and the configuration that won it (a backward search's per-shape winner)."""

    shape: Shape
    config: Config
    median_us: float


@dataclass
class BackwardChoice:
    """What ``evoengineer export`` puts in an export's backward: explicit configurations per head
    dim (``--backward``), measured winners of backward runs, or none at all (``enabled`` False)."""

    configs: dict[int, Config] = field(default_factory=dict)
    measured: list[MeasuredBackward] = field(default_factory=list)
    enabled: bool = True
    deterministic: dict[tuple[str, int, bool], Config] = field(default_factory=dict)
    """Per (dtype, head dim, causal): the fastest deterministic configuration backward runs measured."""
    hopper: bool = False
    """The export is for sm_90a (every forward run's space targets it): the defaults are the wgmma path's."""

    def fallback(self, dtype: str, head_dim: int, causal: bool) -> Config:
        """The variant's backward fallback: the explicit one, else the variant's measured winner
        over most cases (of the other dtype where this one was not measured: a configuration
        builds for both), else the head dim's default."""
        if head_dim in self.configs:
            return self.configs[head_dim]
        for same_dtype in (True, False):
            won = [m.config for m in self.measured if (m.shape.head_dim, m.shape.causal) == (head_dim, causal)
                   and (m.shape.dtype == dtype) == same_dtype]
            if won:
                return max(dict.fromkeys(won), key=won.count)
        return default_config(head_dim, hopper=self.hopper)

    def deterministic_for(self, dtype: str, head_dim: int, causal: bool) -> Config:
        """What a deterministic call of the variant runs: the fallback where it is deterministic,
        else the measured fastest deterministic configuration, else the head dim's default one."""
        fallback = self.fallback(dtype, head_dim, causal)
        if deterministic(fallback) or head_dim in self.configs:
            return deterministic_twin(fallback, head_dim)
        return self.deterministic.get((dtype, head_dim, causal)) or deterministic_twin(fallback, head_dim)


def backward_runs(paths: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """``paths`` split into forward runs and backward runs (their space's template is the backward's)."""
    from .per_shape import RunInfo

    forward, backward = [], []
    for path in paths:
        (backward if RunInfo.load(path).space.backward else forward).append(path)
    return forward, backward


def measured_backward(paths: Sequence[Path]) -> tuple[list[MeasuredBackward], dict[tuple[str, int, bool], Config]]:
    """The per-case winners of backward runs, and per variant the deterministic configuration
    (separate dQ) with the lowest geometric mean over the variant's cases among those that ran them all."""
    import math

    from .per_shape import RunInfo, per_shape_winners

    per = per_shape_winners(paths)
    winners = [MeasuredBackward(w.shape, Config(per.configs[w.config].config), w.median_us) for w in per.winners]
    totals: dict[tuple[str, int, bool], dict[Config, list[float]]] = {}
    for path in paths:
        run = RunInfo.load(path)
        for record in run.records:
            config = Config(record["config"])
            if not deterministic(config):
                continue
            for case in record.get("cases", []):
                median = (case.get("time") or {}).get("median_us")
                shape = run.shape(case["label"])
                if median and shape is not None:
                    totals.setdefault(shape.variant_key, {}).setdefault(config, []).append(math.log(median))
    exact = {}
    for key, by_config in totals.items():
        most = max(len(v) for v in by_config.values())
        full = {c: sum(v) for c, v in by_config.items() if len(v) == most}
        exact[key] = min(full, key=full.__getitem__)
    return winners, exact


def parse_backward_option(text: str) -> dict[int, Config]:
    """A ``--backward`` value as head dim -> configuration: ``[D<head_dim>:]NAME`` (a configuration
    of ``BACKWARD_CONFIGS`` or ``WGMMA_CONFIGS``; without a head dim, for each head dim that has that name) or
    ``[D<head_dim>:]BLOCK_M=32,BLOCK_N=64,...`` (parameters over the defaults; without a head dim,
    for each head dim it is valid for). ExportError in one line for anything else."""
    head_dim: int | None = None
    body = text.strip()
    if body[:1] in ("D", "d") and ":" in body:
        prefix, body = body.split(":", 1)
        if not prefix[1:].isdigit():
            raise ExportError(f"--backward {text!r}: expected D<head_dim>:CONFIG, e.g. D128:m32n64")
        head_dim = int(prefix[1:])
        if head_dim not in HEAD_DIMS:
            raise ExportError(f"--backward {text!r}: the backward supports head dims {', '.join(map(str, HEAD_DIMS))}")
    dims = [head_dim] if head_dim is not None else list(HEAD_DIMS)
    if "=" in body:
        try:
            parsed = Config.parse(body)
            config = Config({**path_defaults(parsed), **parsed})
        except ValueError as exc:
            raise ExportError(f"--backward {text!r}: {exc}") from None
        found = {d: problems(config, d) for d in dims}
        valid = {d: config for d in dims if not found[d]}
        if not valid or (head_dim is not None and found[head_dim]):
            raise ExportError(f"--backward {text!r}: {next(f for f in found.values() if f)[0]}")
        return valid
    kept = {d: {**BACKWARD_CONFIGS[d], **WGMMA_CONFIGS.get(d, {})} for d in dims}
    named = {d: kept[d][body] for d in dims if body in kept[d]}
    if not named:
        names = sorted({n for d in dims for n in kept[d]})
        raise ExportError(f"--backward {text!r}: no configuration {body!r}; named ones: {', '.join(names)}")
    return named


def backward_choice(options: Sequence[str], enabled: bool = True, measured: Sequence[MeasuredBackward] = (),
                    exact: dict[tuple[str, int, bool], Config] | None = None) -> BackwardChoice:
    """The choice ``--backward`` options make (later options win for a head dim), over what backward
    runs measured (``measured``, ``exact``: see ``measured_backward``)."""
    configs: dict[int, Config] = {}
    for option in options:
        configs.update(parse_backward_option(option))
    return BackwardChoice(configs, list(measured), enabled, dict(exact or {}))


def deterministic_twin(config: Config, head_dim: int) -> Config:
    """The configuration a deterministic call runs: ``config`` itself where its dQ uses no
    atomics, else the head dim's deterministic default."""
    return config if deterministic(config) else default_config(head_dim, deterministic_dq=True)


def feature_configs(fallback: Config, exact: Config, head_dim: int) -> list[Config]:
    """The backward configurations of a variant that get kernels with features (``FEATURES``): its
    fallback and its deterministic one where their path holds them (the mma and wgmma paths do), and
    where the fallback's does not, the head dim's mma default in its place."""
    wanted = [fallback if holds_features(fallback) else default_config(head_dim), exact]
    return [c for c in dict.fromkeys(wanted) if holds_features(c)]


def workspaces(rendered: Rendered, config: Config, head_dim: int) -> dict[str, int]:
    """Floats per query row of each workspace argument the backward takes."""
    names = [name for name, kind in backward_arguments(rendered) if kind == "ptr"]
    out = {}
    for name in names:
        if name in WORKSPACE_FLOATS and (name != "dQacc" or not deterministic(config)):
            out[name] = WORKSPACE_FLOATS[name](head_dim)
        elif name in WORKSPACE_FLOATS:
            out[name] = 0   # taken, never touched (dQ computed without atomics)
    return out


def short_backward(config: Config) -> str:
    """``bwd 64x128 st2 atomic``, ``bwd tiles 64x128 st2 sep 64x64``, ``bwd wgmma 64x128 st2 atomic``: a
    backward configuration in tables (``tiles``: the dK/dV kernel with 2-D warp tiles, DKDV=tiles;
    ``halves``: DKDV=halves; ``wgmma``: the wgmma path)."""
    v = {**path_defaults(config), **dict(config)}
    if v["PATH"] == "wgmma":
        tma = " tma" if v.get("LOAD") == "tma" else ""
        return f"bwd wgmma {v['BLOCK_M']}x{v['BLOCK_N']} st{v['STAGES']}{tma} {v['DQ_MODE']}"
    dq = "atomic" if v["DQ_MODE"] == "atomic" else f"sep {v['DQ_BLOCK_M']}x{v['DQ_BLOCK_N']}"
    kind = f"{v['DKDV']} " if v.get("DKDV") in ("tiles", "halves") else ""
    return f"bwd {kind}{v['BLOCK_M']}x{v['BLOCK_N']} st{v['STAGES']} {dq}"


def backward_kernel_entry(rendered: Rendered, config_id: str, config: Config, dtype: str, head_dim: int, causal: bool,
                          source: str) -> dict[str, Any]:
    """A ``backward.kernels`` entry of kernel.json (with LOAD tma, the dK/dV kernel's tensor maps
    and their ``tmap`` arguments after the others)."""
    try:
        args = backward_launch_arguments(rendered)
        launches = backward_launches(rendered)
    except ValueError as exc:
        raise ExportError(f"backward {config.label()} {dtype} D{head_dim}: {exc}") from None
    return {"config": config_id, "dtype": dtype, "head_dim": head_dim, "causal": causal, "source": source,
            "args": [list(a) for a in args], "deterministic": deterministic(config),
            "workspaces": workspaces(rendered, config, head_dim),
            "launches": [launch.to_json() for launch in launches],
            **({"tensor_maps": [m.to_json() for m in rendered.tensor_maps]} if rendered.tensor_maps else {}),
            **({"features": list(rendered.features)} if rendered.features else {})}
