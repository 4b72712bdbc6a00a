"""Load and validate a search-space YAML; enumerate its valid configurations.

A space names the target GPU, the problem shapes, the template, each parameter's
values, the constraints between them, tolerances, the timing protocol and the
search settings. Every mistake in the file becomes a ``SpaceError`` whose text is
one line naming the file and the key path.
"""
from __future__ import annotations

import difflib
import keyword
import math
import random
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import yaml

from .. import paths as kernel_paths
from ..resources import builtin_spaces, template_names
from .config import Config, ParamValue
from .expressions import ExpressionError, SafeExpression, parse_expression, quote

STRATEGIES = ("evo", "tpe", "random", "grid")
DTYPES = ("fp16", "bf16")
"""Element types of Q, K, V and O; softmax and accumulation are fp32 in every kernel."""
DEFAULT_TOLERANCES = {"fp16": (2e-2, 2e-2), "bf16": (3e-2, 3e-2)}
"""(atol, rtol) of the gate per dtype when the space names none. bf16 keeps 8 bits of
mantissa against fp16's 11: on the gate's shapes an fp32-accumulating kernel that rounds P
and O to bf16 (FlashAttention, these kernels, torch's bf16 SDPA on the CPU) misses the fp32
reference by up to ~0.003 + 0.003 * |ref|, one that also rounds the scores to bf16 (SDPA's
math backend) by up to ~0.013 + 0.013 * |ref|; 0.03 passes both with a margin, as 0.02 does
fp16's ~0.0004."""


class SpaceError(ValueError):
    """A space file is missing, malformed or invalid. ``str()`` is the one-line message."""

    def __init__(self, path: str | Path, key: str, message: str) -> None:
        self.path, self.key, self.message = _one_line(str(path), 200), _one_line(str(key), 120), _one_line(str(message), 400)
        super().__init__(f"{self.path}: {self.key}: {self.message}" if self.key else f"{self.path}: {self.message}")


def _one_line(text: str, limit: int) -> str:
    """``text`` with control characters escaped, cut to ``limit`` characters: what a file
    supplies is quoted in an error message, never allowed to flood or break it."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit * 2])
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Variant:
    """Problem-side compile-time constants: one kernel binary per variant."""

    head_dim: int
    causal: bool
    dtype: str = "fp16"
    features: tuple[str, ...] = ()
    """Compile-time features of the kernel (``runtime.features.SWITCHES``: softcap, window, seqlens),
    sorted; the template sees each as a switch (``SOFTCAP=1``, ...)."""

    def label(self) -> str:
        """``D64``, ``D64-causal``; bf16 adds ``-bf16`` (fp16 labels predate the dtype), each feature ``-softcap``..."""
        return (f"D{self.head_dim}{'-causal' if self.causal else ''}{'' if self.dtype == 'fp16' else '-' + self.dtype}"
                + "".join(f"-{f}" for f in self.features))


@dataclass(frozen=True)
class Target:
    name: str
    arch: str
    sms: int
    smem_per_block: int

    @property
    def arch_number(self) -> int:
        return int(re.sub(r"\D", "", self.arch))


def attended_pairs(sq: int, sk: int, causal: bool) -> float:
    """(query, key) pairs one head of one sequence attends: S * S_KV, or with causal (top-left
    aligned, as SDPA) S^2 / 2 when S <= S_KV and S_KV^2 / 2 + (S - S_KV) * S_KV when S > S_KV
    (half of S^2 when they are equal)."""
    if not causal:
        return float(sq) * sk
    if sq <= sk:
        return sq * sq / 2.0
    return sk * sk / 2.0 + float(sq - sk) * sk


def lengths_label(lengths: Sequence[int], padded: bool, seq: str) -> str:
    """The S part of a case label: ``seq`` (``S512``, ``S1/4096``), packed sequences
    ``varlen 1..4099 T5116`` (shortest, longest, tokens), a padded batch ``padded 512..2048 T5120 S2048``."""
    if not lengths:
        return seq
    spread = f"{min(lengths)}..{max(lengths)} T{sum(lengths)}"
    return f"padded {spread} {seq}" if padded else f"varlen {spread}"


@dataclass(frozen=True)
class Case:
    """One problem instance: batch, query heads, query length ``seq``, head dim, causal, K/V heads
    (grouped-query attention when fewer than ``heads``; ``None`` means ``heads``), dtype, and the
    K/V length ``seq_kv`` (``None`` means ``seq``; decode is ``seq`` 1 over a long ``seq_kv``)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    heads_kv: int | None = None
    dtype: str = "fp16"
    seq_kv: int | None = None
    softcap: float = 0.0
    """Logit soft-capping (0: none): scores become softcap * tanh(score * scale / softcap)."""
    window: tuple[int, int] = (-1, -1)
    """Sliding window (left, right) as flash-attn's window_size (-1: unlimited), aligned as causal."""
    lengths: tuple[int, ...] = ()
    """Packed variable-length sequences (``attention_varlen``; empty: the dense layout): each
    sequence's query count, its key count the same; ``batch`` is their count, ``seq`` and
    ``seq_kv`` the longest (the launch's S_q and S_k)."""
    padded: bool = False
    """With ``lengths``: a padded dense batch instead (``attention(seqlens_k=, seqlens_q=)``): batch
    b's queries and keys past ``lengths[b]`` are padding, its tensors ``seq`` long."""

    def __post_init__(self) -> None:
        if self.heads_kv is None:
            object.__setattr__(self, "heads_kv", self.heads)
        if self.seq_kv is None:
            object.__setattr__(self, "seq_kv", self.seq)
        if self.lengths:
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
            longest = max(self.lengths)
            fits = self.seq >= longest if self.padded else self.seq == longest   # padded: S at least the longest
            if min(self.lengths) < 1 or self.batch != len(self.lengths) or not fits or self.seq_kv != self.seq:
                raise ValueError(f"{'padded' if self.padded else 'packed'} lengths {list(self.lengths)[:8]} must be >= 1, "
                                 f"as many as the batch {self.batch}, {'at most' if self.padded else 'the longest'} "
                                 f"S = S_KV ({self.seq}, {self.seq_kv})")
        elif self.padded:
            raise ValueError("a padded case needs its lengths")
        if self.heads_kv < 1 or self.heads % self.heads_kv:
            raise ValueError(f"K/V heads {self.heads_kv} must divide the query heads {self.heads}")
        if self.seq < 1 or self.seq_kv < 1:
            raise ValueError(f"sequence lengths must be >= 1, got S {self.seq}, S_KV {self.seq_kv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def features(self) -> tuple[str, ...]:
        """The kernel features this case needs (sorted)."""
        window = self.window[0] >= 0 or (self.window[1] >= 0 and not self.causal)
        return tuple(name for name, on in (("seqlens", self.padded), ("softcap", self.softcap > 0),
                                           ("varlen", self.packed), ("window", window)) if on)

    @property
    def packed(self) -> bool:
        """Packed sequences (``attention_varlen``'s layout), not a padded dense batch."""
        return bool(self.lengths) and not self.padded

    @property
    def variant(self) -> Variant:
        return Variant(self.head_dim, self.causal, self.dtype, self.features)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(B, H, S, D, S_KV): what ``--shape`` selects (``Space.with_shapes``)."""
        return (self.batch, self.heads, self.seq, self.head_dim, self.seq_kv)

    def label(self) -> str:
        """``B1 H8 S512 D64 causal``; GQA shows the K/V heads (``H32/8``), a K/V length other than
        the query length follows it (``S1/4096``), bf16 adds `` bf16``. Packed sequences read
        ``varlen 1..4099 T5116`` for S: the shortest and longest length and the tokens in all; a
        padded batch ``padded 512..2048 T5120 S2048``."""
        heads = f"{self.heads}" if self.heads_kv == self.heads else f"{self.heads}/{self.heads_kv}"
        seq = f"S{self.seq}" if self.seq_kv == self.seq else f"S{self.seq}/{self.seq_kv}"
        return (f"B{self.batch} H{heads} {lengths_label(self.lengths, self.padded, seq)} D{self.head_dim}{' causal' if self.causal else ''}"
                f"{'' if self.dtype == 'fp16' else ' ' + self.dtype}"
                f"{f' softcap{self.softcap:g}' if self.softcap > 0 else ''}"
                f"{f' window{self.window[0]},{self.window[1]}' if self.window != (-1, -1) else ''}")

    @property
    def tokens(self) -> int:
        """Query rows of one call's tensors: B * S, or the packed sequences' lengths summed."""
        return sum(self.lengths) if self.packed else self.batch * self.seq

    def flops(self) -> float:
        """Matmul FLOPs of the forward pass (QK^T and PV) over the (query, key) pairs attended
        (``attended_pairs``), per batch entry, or per sequence of packed ones (each with as many
        keys as queries, where bottom-right and top-left alignment agree; a padded batch's
        sequences alike: its padding is skipped)."""
        if self.lengths:
            pairs = sum(attended_pairs(n, n, self.causal) for n in self.lengths)
        else:
            pairs = self.batch * attended_pairs(self.seq, self.seq_kv, self.causal)
        return 4.0 * self.heads * pairs * self.head_dim

    def backward_flops(self) -> float:
        """Matmul FLOPs of the backward pass: 2.5 times the forward's (five products against two,
        S = QK^T recomputed), as FlashAttention's papers count them."""
        return 2.5 * self.flops()


@dataclass(frozen=True)
class Param:
    name: str
    values: tuple[ParamValue, ...]
    categorical: bool = False
    """Declared categorical (``{values: [...], categorical: true}``): integers that name choices."""

    @cached_property
    def ordinal(self) -> bool:
        """Numeric parameters are ordered (mutation moves to a neighbouring value), unless
        declared categorical."""
        return not self.categorical and all(isinstance(v, int) and not isinstance(v, bool) for v in self.values)

    def steps(self, value: ParamValue) -> tuple[ParamValue, ...]:
        """Values one step from ``value``: the adjacent ones of an ordinal parameter, every
        other one of a categorical parameter."""
        return self._steps[self.values.index(value)]

    @cached_property
    def _steps(self) -> tuple[tuple[ParamValue, ...], ...]:
        """``steps`` of each value, by the value's index (a mutation asks for them thousands of times)."""
        if self.ordinal:
            return tuple(tuple(self.values[i] for i in (idx - 1, idx + 1) if 0 <= i < len(self.values))
                         for idx in range(len(self.values)))
        return tuple(tuple(v for v in self.values if v != value) for value in self.values)


@dataclass(frozen=True)
class Constraint:
    expression: SafeExpression
    why: str = ""

    @property
    def text(self) -> str:
        return self.expression.text


@dataclass(frozen=True)
class PathSpace:
    """One kernel path of a space: the values of each parameter it uses (the shared ones, then
    its own) and the space's constraints on it (the file's top-level ones, then the path's). The
    path's own rules (``evoengineer.paths``) apply as well, unwritten."""

    name: str
    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...] = ()
    template: str = kernel_paths.FORWARD_TEMPLATE
    """The template whose path this is (the backward's ``mma`` is not the forward's)."""

    @property
    def rules(self) -> kernel_paths.KernelPath:
        return kernel_paths.get(self.name, self.template)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def size(self) -> int:
        return math.prod(len(p.values) for p in self.params)


@dataclass(frozen=True)
class Timing:
    warmup: int = 10
    repetitions: int = 100
    flush_l2: bool = True
    timeout_s: float = 10.0
    min_repetitions: int = 20
    precision: float = 0.002
    race: float = 1.5

    def protocol(self) -> dict:
        """What a timing job needs (``evoengineer.gpu.timing.time_graph``'s arguments, and
        ``race``: the factor over the best time on a case past which a candidate stops at
        five samples, 0 for never)."""
        return {"warmup": self.warmup, "repetitions": self.repetitions, "min_repetitions": self.min_repetitions,
                "precision": self.precision, "flush_l2": self.flush_l2, "race": self.race}


@dataclass(frozen=True)
class SearchSettings:
    strategy: str = "evo"
    budget: int = 100
    time_s: float | None = None
    top_k: int = 5
    population: int = 16
    seeds: tuple[Config, ...] = ()
    """The listed seeds this space contains: generation 0 of the evolutionary strategy."""
    listed_seeds: tuple[Config, ...] = ()
    """Every seed the file lists, in its order. A seed valid at one head dim of the space only
    (a D64 tile too large for D128's registers) joins ``seeds`` where ``--shape`` narrows the
    space to that head dim."""


@dataclass(frozen=True)
class Space:
    name: str
    path: Path
    description: str
    target: Target
    cases: tuple[Case, ...]
    dtypes: tuple[str, ...]
    scale: float | None
    template: str
    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...]
    atol: float
    rtol: float
    timing: Timing
    search: SearchSettings
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    dtype_tolerances: tuple[tuple[str, float, float], ...] = ()
    """(dtype, atol, rtol) of dtypes whose tolerance differs from ``atol``/``rtol``."""
    paths: tuple[PathSpace, ...] = ()
    """The kernel paths of a space written per path (``paths:`` in the file), each with its own
    parameters; empty for a flat space, whose every configuration has every parameter. ``params``
    is then PATH followed by the union of the paths' parameters (the values a search encodes)."""
    extends: str | None = None
    """The space this one's file extends (``extends:``), as written."""
    kind: str = "attention"
    """``attention`` (a kernel of ours), or ``recorded``: a problem known only by a recording of
    its configurations (``evoengineer import-cache``), without shapes, template or GPU target."""
    domain: frozenset[Config] | None = field(default=None, repr=False, compare=False)
    """A recorded space's configurations (those of its recording, ``with_domain``): only they are valid."""

    @property
    def recorded(self) -> bool:
        return self.kind == "recorded"

    def with_domain(self, configs: "Iterable[Mapping[str, ParamValue]]") -> "Space":
        """This space whose valid configurations are only ``configs`` (a recording's)."""
        return replace(self, domain=frozenset(Config(c) for c in configs))

    # -- derived ---------------------------------------------------------------
    def tolerance(self, dtype: str) -> tuple[float, float]:
        """(atol, rtol) of the gate for cases of ``dtype``."""
        for name, atol, rtol in self.dtype_tolerances:
            if name == dtype:
                return atol, rtol
        return self.atol, self.rtol

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def backward(self) -> bool:
        """A space of the backward pass: its objective is the backward's device time."""
        return kernel_paths.is_backward(self.template)

    def flops(self, case: Case) -> float:
        """FLOPs of one call on ``case``: the forward's, or the backward's for a backward space."""
        return case.backward_flops() if self.backward else case.flops()

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def with_shapes(self, shapes: Sequence[Sequence[int]], added: Sequence[Sequence[int]] = ()) -> "Space":
        """This space restricted to the cases whose (B, H, S, D, S_KV) is in ``shapes`` (full and
        causal), plus the ``added`` shapes, which the space does not list: each full and causal
        (full only where S_KV differs from S) in every dtype of the space, with a head dim of the
        space's. A shape of four numbers (B, H, S, D) means S_KV = S."""
        have = [c.shape for c in self.cases]
        listed = ", ".join(dict.fromkeys(format_shape(h) for h in have))
        wanted = {_shape_key(s) for s in shapes}
        for shape in shapes:
            if _shape_key(shape) not in have:
                raise SpaceError(self.path, "problem.shapes", f"no shape {format_shape(shape)} (B,H,S,D or B,H,S/S_KV,D) "
                                 f"in this space; it has {listed}")
        cases = [c for c, h in zip(self.cases, have) if h in wanted]
        dims = sorted({c.head_dim for c in self.cases})
        for shape in dict.fromkeys(_shape_key(s) for s in added):
            b, h, s, d, s_kv = shape
            if shape in have:
                raise SpaceError(self.path, "problem.shapes", f"shape {format_shape(shape)} is in this space already; "
                                 "select it with --shape")
            if d not in dims:
                raise SpaceError(self.path, "problem.shapes", f"cannot add shape {format_shape(shape)}: its head dim {d} "
                                 f"is not one of the space's ({', '.join(map(str, dims))})")
            flags = (False, True) if s == s_kv else (False,)
            cases += [Case(b, h, s, d, causal, dtype=dtype, seq_kv=s_kv) for dtype in self.dtypes for causal in flags]
        return replace(self, cases=tuple(cases)).reseeded()

    def reseeded(self) -> "Space":
        """This space with ``search.seeds`` re-chosen from the listed seeds: those it contains."""
        seeds = tuple(s for s in self.search.listed_seeds if self.contains(s))
        return replace(self, search=replace(self.search, seeds=seeds))

    @property
    def variants(self) -> tuple[Variant, ...]:
        seen: dict[Variant, None] = {}
        for case in self.cases:
            seen.setdefault(case.variant)
        return tuple(seen)

    def environment(self) -> dict[str, Any]:
        """Names a constraint may use besides the parameters (none in a recorded space)."""
        if self.recorded:
            return {}
        dims = [c.head_dim for c in self.cases]
        return {
            "TEMPLATE": self.template,
            "SMEM_LIMIT": self.target.smem_per_block,
            "SMS": self.target.sms,
            "ARCH": self.target.arch_number,
            "ARCH_NAME": self.target.arch,
            "HEAD_DIMS": tuple(sorted(set(dims))),
            "MAX_HEAD_DIM": max(dims),
            "MIN_HEAD_DIM": min(dims),
            "FEATURES": tuple(sorted({f for c in self.cases for f in c.features})),
        }

    def total_size(self) -> int:
        """Configurations before the constraints: the product of the parameters' value counts,
        summed over the paths of a space written per path."""
        if self.paths:
            return sum(p.size() for p in self.paths)
        return math.prod(len(p.values) for p in self.params)

    def for_arch(self, arch: str) -> "Space":
        """The space compiled for another arch (``check --arch``, a search on another GPU): its
        constraints then see that ``ARCH``/``ARCH_NAME``, so arch-specific paths drop out."""
        return self if arch == self.target.arch else replace(self, target=replace(self.target, arch=arch)).reseeded()

    # -- configurations of a space written per path --------------------------------------
    def path_space(self, name: Any) -> PathSpace | None:
        """The path ``name`` of a space written per path (None for another name or a flat space)."""
        for p in self.paths:
            if p.name == name:
                return p
        return None

    def unused(self, path: str) -> dict[str, ParamValue]:
        """The space's parameters that ``path`` does not use, at their neutral values (what its
        configurations hash with, see ``Config.key``); empty for a flat space."""
        own = self.path_space(path)
        if own is None:
            return {}
        used = {"PATH", *own.param_names}
        return {p.name: kernel_paths.NEUTRAL.get(p.name, p.values[0]) for p in self.params if p.name not in used}

    def config(self, values: Mapping[str, ParamValue]) -> Config:
        """The space's configuration of ``values``: on a space written per path, the parameters
        of ``values``' path (others dropped), hashing as before; on a flat space, ``values``."""
        own = self.path_space(values.get("PATH"))
        if own is None:
            return Config(values)
        names = {"PATH", *own.param_names}
        return Config({k: v for k, v in values.items() if k in names}, unused=self.unused(own.name))

    def complete(self, values: Mapping[str, ParamValue], key: str = "config") -> Config:
        """A configuration from a partial one (a seed, ``--config``): what it leaves out takes its
        path's first value (PATH: the first path). A parameter its path does not use is accepted
        at its neutral value (a configuration recorded when every path carried every parameter)
        and dropped. SpaceError naming ``key`` for an unknown parameter or value."""
        values = dict(values)
        if not self.paths:
            for name in values:
                if name not in self.param_names:
                    raise SpaceError(self.path, f"{key}.{name}", f"unknown parameter{_hint(name, self.param_names)}")
            params = self.params
        else:
            path = values.setdefault("PATH", self.paths[0].name)
            own = self.path_space(path)
            if own is None:
                names = [p.name for p in self.paths]
                raise SpaceError(self.path, f"{key}.PATH", f"{path!r} is not one of {names}{_hint(str(path), names)}")
            neutral = self.unused(own.name)
            for name in list(values):
                if name == "PATH" or name in own.param_names:
                    continue
                if name in neutral and values[name] == neutral[name]:
                    del values[name]
                    continue
                where = f"the {own.name} path does not use it" if name in self.param_names else "unknown parameter"
                raise SpaceError(self.path, f"{key}.{name}", f"{where}{_hint(name, own.param_names)}")
            params = own.params
        for p in params:
            values.setdefault(p.name, p.values[0])
            if values[p.name] not in p.values:
                raise SpaceError(self.path, f"{key}.{p.name}", f"{values[p.name]!r} is not one of {list(p.values)}")
        return self.config(values)

    def violations(self, config: Mapping[str, ParamValue], head_dim: int | None = None,
                   features: Sequence[str] | None = None) -> list[str]:
        """Constraint texts that ``config`` breaks (empty when valid), the path's own rules first
        on a space written per path; with ``head_dim``, those it breaks in this space narrowed to
        the shapes of that head dim; with ``features``, to shapes needing those kernel features
        (``()``: a plain kernel)."""
        env = self.environment()
        if head_dim is not None:
            env.update(HEAD_DIMS=(head_dim,), MAX_HEAD_DIM=head_dim, MIN_HEAD_DIM=head_dim)
        if features is not None:
            env.update(FEATURES=tuple(sorted(features)))
        if not self.paths:
            env.update(config)
            return [c.text for c in self.constraints if not c.expression(env)]
        own = self.path_space(config.get("PATH"))
        if own is None:
            return [f"PATH is one of {', '.join(p.name for p in self.paths)}"]
        scope = own.rules.scope(config, env)
        return own.rules.violations(scope) + [c.text for c in own.constraints if not c.expression(scope)]

    def contains(self, config: Mapping[str, ParamValue]) -> bool:
        if self.paths:
            own = self.path_space(config.get("PATH"))
            if own is None or set(config) != {"PATH", *own.param_names}:
                return False
            if any(config[p.name] not in p.values for p in own.params):
                return False
            return not self.violations(config)
        if set(config) != set(self.param_names):
            return False
        if any(config[p.name] not in p.values for p in self.params):
            return False
        if self.domain is not None and Config(config) not in self.domain:
            return False
        return not self.violations(config)

    def valid_configs(self) -> Iterator[Config]:
        """Every configuration that satisfies all constraints, in a fixed order (that of
        ``itertools.product`` over the parameters; per path, path after path, on a space written
        per path). A constraint (or a path's rule) is checked as soon as every parameter it names
        has a value, so whole subtrees of the product are skipped at once."""
        if self.domain is not None:
            yield from self._domain_configs()
            return
        if not self.paths:
            yield from _walk(self.params, [c.expression for c in self.constraints], self.environment(), {})
            return
        for own in self.paths:
            scope = {**own.rules.defaults, "PATH": own.name}
            checks = [*own.rules.rules, *(c.expression for c in own.constraints)]
            yield from _walk(own.params, checks, {**self.environment(), **scope}, self.unused(own.name), fixed=("PATH",))

    def _domain_configs(self) -> Iterator[Config]:
        """The domain's configurations that satisfy the constraints, in the product's order."""
        assert self.domain is not None
        index = [{v: i for i, v in enumerate(p.values)} for p in self.params]
        names = self.param_names

        def order(config: Config) -> tuple[int, ...]:
            return tuple(index[i].get(config.get(n), len(index[i])) for i, n in enumerate(names))

        for config in sorted(self.domain, key=order):
            if set(config) == set(names) and all(config[n] in index[i] for i, n in enumerate(names)) \
                    and not self.violations(config):
                yield config

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without ``valid_list`` (a process it is sent to enumerates its own if it needs one)."""
        return {k: v for k, v in self.__dict__.items() if k != "valid_list"}

    @cached_property
    def valid_list(self) -> tuple[Config, ...]:
        """``valid_configs`` as a tuple, enumerated once per space object: a search's partition
        plan, its strategies and its progress read the same enumeration."""
        return tuple(self.valid_configs())

    def valid_size(self) -> int:
        return len(self.valid_list)

    def sample(self, n: int, rng: random.Random | None = None) -> list[Config]:
        """``n`` distinct valid configurations drawn uniformly (all of them if fewer)."""
        rng = rng or random.Random(0)
        valid = list(self.valid_configs())
        return valid if n >= len(valid) else rng.sample(valid, n)

    def neighbours(self, config: Config) -> list[Config]:
        """Valid configurations one step away: an ordinal parameter moved to an adjacent
        value, or a categorical parameter changed to another value. On a space written per path,
        another PATH keeps the parameters both paths use and gives the rest their first value."""
        own = self.path_space(config.get("PATH"))
        out: list[Config] = []
        if own is None:
            for p in self.params:
                for value in p.steps(config[p.name]):
                    candidate = config.replace(**{p.name: value})
                    if not self.violations(candidate) and (self.domain is None or candidate in self.domain):
                        out.append(candidate)
            return out
        for other in self.paths:
            if other is not own:
                moved = {p.name: config[p.name] if config.get(p.name) in p.values else p.values[0] for p in other.params}
                candidate = self.config({"PATH": other.name, **moved})
                if not self.violations(candidate):
                    out.append(candidate)
        for p in own.params:
            for value in p.steps(config[p.name]):
                candidate = config.replace(**{p.name: value})
                if not self.violations(candidate) and (self.domain is None or candidate in self.domain):
                    out.append(candidate)
        return out

    def source_text(self) -> str:
        """The space file as a run keeps it: its own text, or, where it extends another space,
        the merged document (a run directory then needs no other file)."""
        if self.path.is_file() and not self.extends:
            return self.path.read_text()
        return f"# {self.name}: {self.path.name} merged with the spaces it extends\n" + yaml.safe_dump(dict(self.raw), sort_keys=False)


def _walk(params: Sequence[Param], checks: Sequence[Any], scope: dict[str, Any], unused: Mapping[str, ParamValue],
          fixed: Sequence[str] = ()) -> Iterator[Config]:
    """The product of ``params``' values that passes ``checks`` (constraints' expressions or
    path rules), each check run once every parameter it reads has a value (a check that calls a
    scope function, at the last); ``fixed`` names entries of ``scope`` a configuration carries."""
    names = [p.name for p in params]
    if not names:
        return
    position = {name: i for i, name in enumerate(names)}
    ready: list[list[Any]] = [[] for _ in names]  # checks that can run once parameter i is set
    for check in checks:
        reads = getattr(check, "needs", None) or getattr(check, "names", ())
        used = [position[n] for n in reads if n in position]
        if getattr(check, "calls", None):
            used.append(len(names) - 1)
        ready[max(used) if used else 0].append(check)
    values = [p.values for p in params]
    carried = [*fixed, *names]

    def walk(i: int) -> Iterator[Config]:
        for value in values[i]:
            scope[names[i]] = value
            if all(check(scope) for check in ready[i]):
                if i + 1 == len(names):
                    yield Config({n: scope[n] for n in carried}, unused=unused)
                else:
                    yield from walk(i + 1)

    yield from walk(0)


# -- loading -------------------------------------------------------------------

_TOP_KEYS = ("extends", "name", "description", "target", "problem", "template", "params", "paths", "constraints", "tolerances",
             "timing", "search")
_PATH_KEYS = ("params", "constraints")
_MAX_EXTENDS = 8
_REQUIRED_TOP = ("target", "problem", "template")
_REQUIRED_RECORDED = ("problem", "params")
_RECORDED_TOP = ("name", "description", "target", "problem", "params", "constraints", "search")
KINDS = ("attention", "recorded")
_TARGET_KEYS = ("name", "arch", "sms", "smem_per_block")
_PROBLEM_KEYS = ("kind", "dtype", "scale", "shapes")
_SHAPE_KEYS = ("B", "H", "H_KV", "S", "S_KV", "D", "causal", "softcap", "window", "lengths", "padded")
_LENGTHS_KEYS = ("count", "min", "max", "seed")
MAX_SEQUENCES = 4096
"""Packed sequences a shape may list or draw (``lengths``)."""
MAX_LENGTH = 1 << 20
"""The longest packed sequence a shape may name."""
_TOL_KEYS = ("atol", "rtol", *DTYPES)
_TIMING_KEYS = ("warmup", "repetitions", "min_repetitions", "precision", "race", "flush_l2", "timeout_s")
_SEARCH_KEYS = ("strategy", "budget", "time", "top_k", "population", "seeds")


def resolve_space_path(spec: str | Path, cwd: Path | None = None) -> Path:
    """A path, or a built-in space's name (``h100``); ``spaces/l4.yaml`` falls back to the
    built-in ``l4`` when no such file exists relative to the working directory."""
    text = str(spec)
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    if path.is_file():
        return path
    builtins = builtin_spaces()
    stem = Path(text).name
    for suffix in (".yaml", ".yml"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    if stem in builtins:
        return builtins[stem]
    known = ", ".join(builtins) or "none"
    close = difflib.get_close_matches(stem, list(builtins), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SpaceError(text, "", f"no such file and no built-in space of that name{hint}; built-in spaces: {known}")


def load_space(spec: str | Path, cwd: Path | None = None) -> Space:
    path = resolve_space_path(spec, cwd)
    display = _display_path(path, cwd)
    data = _read_yaml(path, display)
    try:
        space = parse_space(data, display, path)
    except ExpressionError as exc:  # a constraint that fails on the values a seed gives it
        raise SpaceError(display, _constraint_key(data, exc.expression), str(exc)) from None
    except RecursionError:
        raise SpaceError(display, "", "nested too deeply") from None
    _probe_constraints(space, display)
    return space


def _read_yaml(path: Path, display: str) -> Any:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPACE_BYTES + 1)
    except OSError as exc:
        raise SpaceError(display, "", f"cannot read: {exc.strerror}") from None
    if len(raw) > MAX_SPACE_BYTES:
        raise SpaceError(display, "", f"larger than {MAX_SPACE_BYTES // 1024} KiB; a space file is a short YAML document")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpaceError(display, "", f"not UTF-8 text (byte {exc.start})") from None
    return _load_yaml(text, display)


def _constraint_key(data: Any, text: str | None) -> str:
    """``constraints[i]`` of the constraint whose expression is ``text`` (``constraints`` if none is)."""
    items = data.get("constraints") if isinstance(data, dict) else None
    for index, item in enumerate(items if isinstance(items, list) else []):
        expr = item.get("expr") if isinstance(item, dict) else item
        if isinstance(expr, str) and expr.strip() == text:
            return f"constraints[{index}]"
    return "constraints"


def _probe_constraints(space: Space, display: str) -> None:
    """Evaluate every constraint on each parameter's every value (the others at their first):
    a constraint that cannot be evaluated (a divisor that some value makes 0) fails here,
    naming its key, instead of in the middle of a search."""
    env = {**space.environment(), **{p.name: p.values[0] for p in space.params}}
    for index, constraint in enumerate(space.constraints):
        for param in space.params:
            for value in param.values:
                try:
                    constraint.expression({**env, param.name: value})
                except ExpressionError as exc:
                    raise SpaceError(display, f"constraints[{index}]", str(exc)) from None


MAX_SPACE_BYTES = 1 << 20
"""The largest space file read (the built-in ones are under 20 KiB)."""
MAX_YAML_NODES = 100_000
"""YAML nodes a space may hold once its aliases are expanded: an alias repeats its anchor's
whole subtree, so a few nested ones ("billion laughs") would otherwise stand for billions."""


def _load_yaml(text: str, display: str) -> Any:
    """``yaml.safe_load`` of a space's text, refusing documents whose aliases expand past
    ``MAX_YAML_NODES`` nodes or whose nesting exhausts the parser."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _count_nodes(node, display)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpaceError(display, "", f"malformed YAML: {where}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise SpaceError(display, "", f"malformed YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    except (RecursionError, MemoryError):
        raise SpaceError(display, "", "malformed YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _count_nodes(root: yaml.Node, display: str) -> None:
    """Raise unless the node graph, aliases expanded, holds at most ``MAX_YAML_NODES`` nodes
    (a node's expanded size is counted once per node, then reused for every alias to it)."""
    sizes: dict[int, int] = {}
    order: list[yaml.Node] = []
    stack: list[yaml.Node] = [root]
    seen: set[int] = set()
    while stack:  # children before parents, without recursion (a document may nest deeply)
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(_children(node))
    for node in reversed(order):
        size = 1 + sum(sizes.get(id(child), 1) for child in _children(node))
        if size > MAX_YAML_NODES:
            raise SpaceError(display, "", f"YAML aliases expand to more than {MAX_YAML_NODES} nodes; "
                             "write the values out (or use fewer aliases)")
        sizes[id(node)] = size


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _extended(data: Any, display: str, path: Path | None) -> Any:
    """``data`` merged onto the space its ``extends:`` names (a built-in space's name, or a file
    relative to this one's), recursively: a mapping merges key by key, anything else (a list,
    a value) replaces the base's; ``extends`` itself is left out of the result."""
    chain: list[Path] = [path.resolve()] if path is not None else []
    while isinstance(data, dict) and "extends" in data:
        spec = data["extends"]
        if not isinstance(spec, str) or not spec.strip():
            raise SpaceError(display, "extends", f"expected a space name or a file, got {_describe(spec)}")
        base_path = resolve_space_path(spec, path.parent if path is not None else None)
        if base_path.resolve() in chain or len(chain) > _MAX_EXTENDS:
            raise SpaceError(display, "extends", f"{spec!r} extends back to a space already in the chain")
        chain.append(base_path.resolve())
        base = _read_yaml(base_path, str(base_path))
        if not isinstance(base, dict):
            raise SpaceError(display, "extends", f"{spec!r} is not a space (a mapping)")
        data = _merge(base, {k: v for k, v in data.items() if k != "extends"})
        path = base_path
    return data


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def _display_path(path: Path, cwd: Path | None) -> str:
    try:
        return str(path.relative_to(cwd or Path.cwd()))
    except ValueError:
        return str(path)


def parse_space(data: Any, display: str, path: Path | None = None) -> Space:
    v = _Validator(display)
    if isinstance(data, dict) and isinstance(data.get("problem"), dict) and data["problem"].get("kind") == "recorded":
        return _parse_recorded(v, data, display, path)
    extends = data.get("extends") if isinstance(data, dict) else None
    data = _extended(data, display, path)
    root = v.mapping(data, "", _TOP_KEYS, required=_REQUIRED_TOP)
    if "params" not in root and "paths" not in root:
        v.fail("params", "required key is missing")

    name = path_component(v.string(root.get("name", Path(display).stem), "name"), Path(display).stem)
    description = v.string(root.get("description", ""), "description", allow_empty=True)

    t = v.mapping(root["target"], "target", _TARGET_KEYS, required=_TARGET_KEYS)
    arch = v.string(t["arch"], "target.arch")
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        v.fail("target.arch", f"expected an arch such as sm_89 or sm_90, got {arch!r}")
    target = Target(
        name=v.string(t["name"], "target.name"),
        arch=arch,
        sms=v.integer(t["sms"], "target.sms", minimum=1),
        smem_per_block=v.integer(t["smem_per_block"], "target.smem_per_block", minimum=1024),
    )

    pr = v.mapping(root["problem"], "problem", _PROBLEM_KEYS, required=("shapes",))
    kind = v.string(pr.get("kind", "attention"), "problem.kind")
    if kind not in KINDS:
        v.fail("problem.kind", f"expected one of {', '.join(KINDS)}, got {kind!r}{_hint(kind, KINDS)}")
    dtypes = _parse_dtypes(v, pr.get("dtype", "fp16"))
    if "bf16" in dtypes and target.arch_number < 80:
        v.fail("problem.dtype", f"bf16 needs target.arch sm_80 or newer, got {arch}")
    scale = pr.get("scale")
    if scale is not None:
        scale = v.number(scale, "problem.scale", positive=True)
    template = v.string(root["template"], "template")
    if template not in template_names():
        v.fail("template", f"no template {template!r}{_hint(template, template_names())}")
    cases = _parse_shapes(v, pr["shapes"], dtypes, kernel_paths.head_dims(template))
    if kernel_paths.is_backward(template):
        if "paths" not in root:
            v.fail("paths", f"the {template} template's space is written per path (paths: mma: ...)")
        if any(c.features for c in cases):
            v.fail("problem.shapes", "the backward takes no soft cap, window, packed sequences or padded batch")

    space_env_names = {"SMEM_LIMIT", "SMS", "ARCH", "ARCH_NAME", "HEAD_DIMS", "MAX_HEAD_DIM", "MIN_HEAD_DIM", "FEATURES"}
    path_spaces: tuple[PathSpace, ...] = ()
    if "paths" in root:
        params, path_spaces = _parse_paths(v, root.get("params"), root["paths"], root.get("constraints", []), space_env_names,
                                           template)
        constraints: tuple[Constraint, ...] = ()
    else:
        params = _parse_params(v, root["params"])
        known = {p.name for p in params} | space_env_names
        constraints = _parse_constraints(v, root.get("constraints", []), known)

    atol, rtol, dtype_tolerances = _parse_tolerances(v, root.get("tolerances", {}))

    tm = v.mapping(root.get("timing", {}), "timing", _TIMING_KEYS)
    timing = Timing(
        warmup=v.integer(tm.get("warmup", 10), "timing.warmup", minimum=0),
        repetitions=v.integer(tm.get("repetitions", 100), "timing.repetitions", minimum=1),
        flush_l2=v.boolean(tm.get("flush_l2", True), "timing.flush_l2"),
        timeout_s=v.number(tm.get("timeout_s", 10.0), "timing.timeout_s", positive=True),
        min_repetitions=v.integer(tm.get("min_repetitions", 20), "timing.min_repetitions", minimum=1),
        precision=v.number(tm.get("precision", 0.002), "timing.precision", non_negative=True),
        race=v.number(tm.get("race", 1.5), "timing.race", non_negative=True),
    )

    space = Space(
        name=name,
        path=path or Path(display),
        description=description,
        target=target,
        cases=cases,
        dtypes=dtypes,
        scale=scale,
        template=template,
        params=params,
        constraints=constraints,
        atol=atol,
        rtol=rtol,
        timing=timing,
        search=SearchSettings(),
        raw=root,
        dtype_tolerances=dtype_tolerances,
        paths=path_spaces,
        extends=extends,
    )
    return Space(**{**space.__dict__, "search": _parse_search(v, root, space)}).reseeded()


def _parse_recorded(v: "_Validator", data: dict, display: str, path: Path | None) -> Space:
    """A ``problem.kind: recorded`` space: parameters (any identifiers; integers may be declared
    categorical), constraints among them, search settings, and optionally ``target.name``."""
    root = v.mapping(data, "", _RECORDED_TOP, required=_REQUIRED_RECORDED)
    v.mapping(root["problem"], "problem", ("kind",))
    t = v.mapping(root.get("target", {}), "target", ("name",))
    name = path_component(v.string(root.get("name", Path(display).stem), "name"), Path(display).stem)
    params = _parse_params(v, root["params"], upper_case=False)
    constraints = _parse_constraints(v, root.get("constraints", []), {p.name for p in params})
    space = Space(
        name=name, path=path or Path(display), description=v.string(root.get("description", ""), "description", allow_empty=True),
        target=Target(name=v.string(t.get("name", "recorded"), "target.name"), arch="", sms=0, smem_per_block=0),
        cases=(), dtypes=(), scale=None, template="", params=params, constraints=constraints,
        atol=0.0, rtol=0.0, timing=Timing(), search=SearchSettings(), raw=root, kind="recorded",
    )
    return replace(space, search=_parse_search(v, root, space)).reseeded()


def _parse_search(v: "_Validator", root: dict, space: Space) -> SearchSettings:
    se = v.mapping(root.get("search", {}), "search", _SEARCH_KEYS)
    strategy = v.string(se.get("strategy", "evo"), "search.strategy")
    if strategy not in STRATEGIES:
        v.fail("search.strategy", f"expected one of {', '.join(STRATEGIES)}, got {strategy!r}{_hint(strategy, STRATEGIES)}")
    time_s = None
    if se.get("time") is not None:
        try:
            time_s = parse_duration(se["time"])
        except ValueError as exc:
            v.fail("search.time", str(exc))
    seeds = tuple(_parse_seed(v, space, s, f"search.seeds[{i}]") for i, s in enumerate(v.sequence(se.get("seeds", []), "search.seeds")))
    return SearchSettings(
        strategy=strategy,
        budget=v.integer(se.get("budget", 100), "search.budget", minimum=1),
        time_s=time_s,
        top_k=v.integer(se.get("top_k", 5), "search.top_k", minimum=1),
        population=v.integer(se.get("population", 16), "search.population", minimum=2),
        listed_seeds=seeds,
    )


def _parse_dtypes(v: "_Validator", raw: Any) -> tuple[str, ...]:
    """``fp16``, ``bf16`` or a non-empty list of them."""
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        v.fail("problem.dtype", f"expected one of {', '.join(DTYPES)} or a non-empty list of them, got []")
    for item in items:
        if item not in DTYPES:
            v.fail("problem.dtype", f"expected one of {', '.join(DTYPES)} or a list of them, got {item!r}{_hint(str(item), DTYPES)}")
    if len(set(items)) != len(items):
        v.fail("problem.dtype", f"values repeat: {items!r}")
    return tuple(items)


def _parse_tolerances(v: "_Validator", raw: Any) -> tuple[float, float, tuple[tuple[str, float, float], ...]]:
    """Top-level ``atol``/``rtol`` (fp16, and every dtype without its own entry, when given)
    and per-dtype ``{bf16: {atol, rtol}}`` entries; what is left out takes the dtype's default."""
    tol = v.mapping(raw, "tolerances", _TOL_KEYS)
    top = {name: v.number(tol[name], f"tolerances.{name}", positive=True) for name in ("atol", "rtol") if name in tol}
    per: dict[str, tuple[float, float]] = {}
    for dtype in DTYPES:
        own = v.mapping(tol.get(dtype, {}), f"tolerances.{dtype}", ("atol", "rtol"))
        merged = dict(zip(("atol", "rtol"), DEFAULT_TOLERANCES[dtype])) | top
        merged |= {name: v.number(own[name], f"tolerances.{dtype}.{name}", positive=True) for name in ("atol", "rtol") if name in own}
        per[dtype] = (merged["atol"], merged["rtol"])
    atol, rtol = per["fp16"]
    return atol, rtol, tuple((d, *per[d]) for d in DTYPES if per[d] != (atol, rtol))


def _parse_shapes(v: "_Validator", raw: Any, dtypes: Sequence[str] = ("fp16",),
                  head_dims: Sequence[int] = kernel_paths.head_dims()) -> tuple[Case, ...]:
    """The cases of ``problem.shapes``: each shape per dtype and causal flag; a head dim must be
    one of ``head_dims`` (those the template's paths hold)."""
    items = v.sequence(raw, "problem.shapes", non_empty=True)
    cases: list[Case] = []
    for i, item in enumerate(items):
        key = f"problem.shapes[{i}]"
        s = v.mapping(item, key, _SHAPE_KEYS, required=("H", "D") if isinstance(item, dict) and "lengths" in item
                      else ("B", "H", "S", "D"))
        d = v.integer(s["D"], f"{key}.D", minimum=1)
        if d not in head_dims:
            v.fail(f"{key}.D", f"head dim must be one of {list(head_dims)} (what this template's paths hold), got {d}")
        heads = v.integer(s["H"], f"{key}.H", minimum=1)
        heads_kv = v.integer(s.get("H_KV", heads), f"{key}.H_KV", minimum=1)
        if heads % heads_kv:
            v.fail(f"{key}.H_KV", f"K/V heads must divide the query heads H={heads}, got {heads_kv}")
        lengths: tuple[int, ...] = ()
        padded = v.boolean(s.get("padded", False), f"{key}.padded")
        if padded and "lengths" not in s:
            v.fail(f"{key}.padded", "a padded batch needs its lengths (each sequence's length, the rest padding)")
        if "lengths" in s:
            lengths = _parse_lengths(v, s["lengths"], f"{key}.lengths")
            for name in ("S_KV",) if padded else ("S", "S_KV"):
                if name in s:
                    v.fail(f"{key}.{name}", "a shape with lengths takes its sequence lengths from them; leave "
                                            f"{'S_KV' if padded else 'S and S_KV'} out")
            if "B" in s and v.integer(s["B"], f"{key}.B", minimum=1) != len(lengths):
                v.fail(f"{key}.B", f"expected the number of lengths ({len(lengths)}) or no B, got {s['B']}")
        seq = v.integer(s["S"], f"{key}.S", minimum=1) if "S" in s else max(lengths)   # S is required without lengths
        if lengths and seq < max(lengths):
            v.fail(f"{key}.S", f"a padded batch is at least its longest length ({max(lengths)}) long, got {s['S']}")
        seq_kv = seq if lengths else v.integer(s.get("S_KV", seq), f"{key}.S_KV", minimum=1)
        softcap = v.number(s["softcap"], f"{key}.softcap", positive=True) if "softcap" in s else 0.0
        window = (-1, -1)
        if "window" in s:
            raw = s["window"]
            if (not isinstance(raw, list) or len(raw) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < -1 for x in raw)
                    or raw == [-1, -1]):
                v.fail(f"{key}.window", f"expected [left, right], integers >= -1 (-1: unlimited), not both -1, got {raw!r}")
            window = (raw[0], raw[1])
        first = len(cases)
        causal_raw = s.get("causal", False)
        flags = causal_raw if isinstance(causal_raw, list) else [causal_raw]
        if not flags:
            v.fail(f"{key}.causal", "expected true, false or a non-empty list of them")
        for dtype in dtypes:
            for flag in flags:
                cases.append(
                    Case(
                        batch=len(lengths) if lengths else v.integer(s["B"], f"{key}.B", minimum=1),
                        heads=heads,
                        seq=seq,
                        head_dim=d,
                        causal=v.boolean(flag, f"{key}.causal"),
                        heads_kv=heads_kv,
                        dtype=dtype,
                        seq_kv=seq_kv,
                        softcap=softcap,
                        window=window,
                        lengths=lengths,
                        padded=padded,
                    )
                )
        for case in cases[first:]:
            twin = next((c for c in cases[:first] if c.label() == case.label()), case)
            if twin != case:
                v.fail(key, f"its label {case.label()!r} is another shape's; packed shapes need another "
                            "shortest or longest length or token count")
    return tuple(dict.fromkeys(cases))


def _parse_lengths(v: "_Validator", raw: Any, key: str) -> tuple[int, ...]:
    """``lengths``: a list of sequence lengths, or ``{count, min, max, seed}``: ``count`` lengths
    drawn uniformly from min .. max by ``random.Random(seed)`` (the same list every time)."""
    if isinstance(raw, dict):
        spec = v.mapping(raw, key, _LENGTHS_KEYS, required=("count", "min", "max"))
        count = v.integer(spec["count"], f"{key}.count", minimum=1)
        low = v.integer(spec["min"], f"{key}.min", minimum=1)
        high = v.integer(spec["max"], f"{key}.max", minimum=low)
        seed = v.integer(spec.get("seed", 0), f"{key}.seed", minimum=0)
        if count > MAX_SEQUENCES:
            v.fail(f"{key}.count", f"expected at most {MAX_SEQUENCES} sequences, got {count}")
        if high > MAX_LENGTH:
            v.fail(f"{key}.max", f"expected at most {MAX_LENGTH}, got {high}")
        if seed >= 1 << 64:
            v.fail(f"{key}.seed", "expected an integer below 2**64")
        rng = random.Random(seed)
        return tuple(rng.randint(low, high) for _ in range(count))
    if not isinstance(raw, list) or not raw or len(raw) > MAX_SEQUENCES:
        v.fail(key, f"expected a list of 1 to {MAX_SEQUENCES} sequence lengths or {{count, min, max, seed}}, "
                    f"got {_describe(raw)}")
    for i, n in enumerate(raw):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LENGTH:
            v.fail(f"{key}[{i}]", f"expected an integer from 1 to {MAX_LENGTH}, got {_describe(n)}")
    return tuple(raw)


def _parse_params(v: "_Validator", raw: Any, where: str = "params", allow_empty: bool = False,
                  upper_case: bool = True) -> tuple[Param, ...]:
    """``NAME: [values]``, or ``NAME: {values: [...], categorical: true}`` for integers that name
    choices (not ordered). Names are UPPER_CASE (template variables) unless ``upper_case`` is off
    (a recorded space): then any identifier but the constraint functions' names."""
    mapping = v.mapping(raw, where, None)
    if not mapping and not allow_empty:
        v.fail(where, "expected a mapping of parameter name -> non-empty list of values")
    params = []
    for name, values in mapping.items():
        key = f"{where}.{name}"
        if upper_case and (not isinstance(name, str) or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name)):
            v.fail(key, "parameter names are UPPER_CASE identifiers (they become template variables)")
        if not upper_case and (not isinstance(name, str) or not name.isidentifier() or name in ("min", "max", "abs")
                               or keyword.iskeyword(name)):
            v.fail(key, "parameter names are identifiers (letters, digits, underscores), not min, max or abs")
        categorical = False
        if isinstance(values, dict):
            entry = v.mapping(values, key, ("values", "categorical"), required=("values",))
            values = entry["values"]
            categorical = v.boolean(entry.get("categorical", False), f"{key}.categorical")
        if not isinstance(values, list) or not values:
            v.fail(key, f"expected a non-empty list of integers or strings, got {values!r}")
        kinds = {type(x) for x in values}
        if not (kinds <= {int} or kinds <= {str} or kinds <= {bool}):
            v.fail(key, f"expected a non-empty list of integers or strings (one type), got {values!r}")
        if len(set(values)) != len(values):
            v.fail(key, f"values repeat: {values!r}")
        if kinds <= {int} and not categorical:
            values = sorted(values)
        params.append(Param(name, tuple(values), categorical))
    return tuple(params)


def _parse_paths(v: "_Validator", shared_raw: Any, raw: Any, constraints_raw: Any, env_names: set[str],
                 template: str = kernel_paths.FORWARD_TEMPLATE) -> tuple[tuple[Param, ...], tuple[PathSpace, ...]]:
    """``params`` (every path's), ``paths: {name: {params, constraints}}`` and the top-level
    ``constraints`` (every path's) of a space written per path: the union of the parameters
    (PATH first) and each path's space. A parameter a path does not use is an error."""
    shared = _parse_params(v, shared_raw, allow_empty=True)
    if "PATH" in {p.name for p in shared}:
        v.fail("params.PATH", "a space with 'paths' takes its PATH values from the names under 'paths'")
    entries = v.mapping(raw, "paths", None)
    if not entries:
        v.fail("paths", "expected a mapping of path name -> {params, constraints}")
    out: list[PathSpace] = []
    union: dict[str, list[ParamValue]] = {}
    for name, entry in entries.items():
        key = f"paths.{name}"
        known_paths = kernel_paths.of_template(template)
        if name not in known_paths:
            v.fail(key, f"no kernel path {name!r}{_hint(str(name), list(known_paths))} "
                        f"(known: {', '.join(known_paths)})")
        rules = kernel_paths.get(name, template)
        spec = v.mapping(entry, key, _PATH_KEYS)
        own = _parse_params(v, spec.get("params"), f"{key}.params", allow_empty=True)
        mine = {p.name: p for p in own}
        params = tuple(mine.pop(p.name, p) for p in shared) + tuple(mine.values())
        for p in params:
            if p.name not in rules.params:
                where = f"{key}.params.{p.name}" if p.name in {q.name for q in own} else f"params.{p.name}"
                v.fail(where, f"the {name} path does not use {p.name} (it uses {', '.join(rules.params)})")
            seen = union.setdefault(p.name, [])
            seen += [x for x in p.values if x not in seen]
        known = {"PATH", *(p.name for p in params)} | env_names
        checks = _parse_constraints(v, constraints_raw, known, "constraints", name)
        checks += _parse_constraints(v, spec.get("constraints", []), known, f"{key}.constraints")
        out.append(PathSpace(name, params, checks, template))
    merged = [Param(n, tuple(sorted(x) if all(isinstance(y, int) and not isinstance(y, bool) for y in x) else x))
              for n, x in union.items()]
    return (Param("PATH", tuple(p.name for p in out)), *merged), tuple(out)


def _parse_constraints(v: "_Validator", raw: Any, known: set[str], where: str = "constraints",
                       path: str | None = None) -> tuple[Constraint, ...]:
    out = []
    for i, item in enumerate(v.sequence(raw, where)):
        key = f"{where}[{i}]"
        why = ""
        if isinstance(item, dict):
            entry = v.mapping(item, key, ("expr", "why"), required=("expr",))
            text, why = entry["expr"], v.string(entry.get("why", ""), f"{key}.why", allow_empty=True)
        else:
            text = item
        if not isinstance(text, str):
            v.fail(key, f"expected an expression string, got {text!r}")
        try:
            out.append(Constraint(parse_expression(text, known, kernel_paths.SCOPE_FUNCTIONS), why))
        except ExpressionError as exc:
            on = f" (on the {path} path: a constraint of every path names only their shared parameters)" if path else ""
            v.fail(key, f"{exc} in {text!r}{on}")
    return tuple(out)


def _parse_seed(v: "_Validator", space: Space, raw: Any, key: str) -> Config:
    if isinstance(raw, str):
        try:
            values = dict(Config.parse(raw))
        except ValueError as exc:
            v.fail(key, str(exc))
    else:
        values = dict(v.mapping(raw, key, None))
    try:
        config = space.complete(values, key)  # parameters a seed leaves out take their path's first value
    except SpaceError as exc:
        v.fail(exc.key, exc.message)
    broken = space.violations(config)
    dims = sorted({c.head_dim for c in space.cases})
    groups = {(c.head_dim, c.features) for c in space.cases}
    if broken and all(space.violations(config, head_dim=d, features=f) for d, f in groups):
        where = "" if len(groups) == 1 else " at every head dim" if len(dims) > 1 else " for every shape"
        v.fail(key, f"seed is outside the space{where}: violates {broken[0]!r}")
    return config


def parse_duration(raw: Any) -> float:
    """``90``, ``'90s'``, ``'15m'``, ``'1h'``, ``'1h30m'`` -> seconds."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw > 0:
        return float(raw)
    text = str(raw).strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", text)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"expected a duration such as 90s, 15m or 1h, got {raw!r}")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {raw!r}")
    return seconds


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``'1,8,512,64'`` -> (B, H, S, D, S_KV) with S_KV = S; ``'8,32,1/4096,128'`` (query length
    1 over 4096 keys, as a case label writes it) -> (8, 32, 1, 128, 4096)."""
    parts = [p.strip() for p in str(text).split(",")]
    seqs = parts[2].split("/") if len(parts) == 4 else []
    numbers = parts[:2] + seqs + parts[3:]
    if len(parts) != 4 or len(seqs) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in numbers):
        raise ValueError(f"expected B,H,S,D (or B,H,S/S_KV,D) as positive integers such as 1,8,512,64 or 8,32,1/4096,128, "
                         f"got {text!r}")
    b, h, s, d = (int(parts[0]), int(parts[1]), int(seqs[0]), int(parts[3]))
    return b, h, s, d, int(seqs[1]) if len(seqs) == 2 else s


def format_shape(shape: Sequence[int]) -> str:
    """(B, H, S, D[, S_KV]) as ``--shape`` takes it: ``1,8,512,64`` or ``8,32,1/4096,128``."""
    b, h, s, d, skv = _shape_key(shape)
    return f"{b},{h},{s if skv == s else f'{s}/{skv}'},{d}"


def _shape_key(shape: Sequence[int]) -> tuple[int, int, int, int, int]:
    b, h, s, d, *rest = (int(x) for x in shape)
    return (b, h, s, d, rest[0] if rest else s)


def path_component(name: str, fallback: str = "space") -> str:
    """``name`` as one safe path component (a run directory is named after its space):
    characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-``, leading
    dots and dashes go, at most 64 characters; ``fallback`` (made safe too) if nothing is left."""
    for text in (name, fallback, "space"):
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).lstrip(".-")[:64].rstrip("-")
        if safe:
            return safe
    return "space"


def _hint(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word)[:100], list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Validator:
    """Type checks that fail with a SpaceError naming the file and key path."""

    def __init__(self, display: str) -> None:
        self.display = display

    def fail(self, key: str, message: str) -> None:
        raise SpaceError(self.display, key, message)

    def mapping(self, raw: Any, key: str, allowed: Sequence[str] | None, required: Sequence[str] = ()) -> dict:
        if raw is None and not required:
            raw = {}
        if not isinstance(raw, dict):
            self.fail(key or "(top level)", f"expected a mapping, got {_describe(raw)}")
        for name in raw:
            if allowed is not None and name not in allowed:
                where = f"{key}.{name}" if key else str(name)
                self.fail(where, f"unknown key{_hint(str(name), allowed)}")
        for name in required:
            if name not in raw:
                self.fail(f"{key}.{name}" if key else name, "required key is missing")
        return raw

    def sequence(self, raw: Any, key: str, non_empty: bool = False) -> list:
        if raw is None and not non_empty:
            return []
        if not isinstance(raw, list) or (non_empty and not raw):
            self.fail(key, f"expected a {'non-empty ' if non_empty else ''}list, got {_describe(raw)}")
        return raw

    def string(self, raw: Any, key: str, allow_empty: bool = False) -> str:
        if not isinstance(raw, str) or (not allow_empty and not raw.strip()):
            self.fail(key, f"expected a {'' if allow_empty else 'non-empty '}string, got {_describe(raw)}")
        return raw

    def integer(self, raw: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            self.fail(key, f"expected an integer, got {_describe(raw)}")
        if minimum is not None and raw < minimum:
            self.fail(key, f"expected an integer >= {minimum}, got {raw}")
        return raw

    def number(self, raw: Any, key: str, positive: bool = False, non_negative: bool = False) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            self.fail(key, f"expected a number, got {_describe(raw)}")
        if positive and raw <= 0:
            self.fail(key, f"expected a positive number, got {raw}")
        if non_negative and raw < 0:
            self.fail(key, f"expected a number >= 0, got {raw}")
        return float(raw)

    def boolean(self, raw: Any, key: str) -> bool:
        if not isinstance(raw, bool):
            self.fail(key, f"expected true or false, got {_describe(raw)}")
        return raw


def _describe(raw: Any) -> str:
    if isinstance(raw, (dict, list)):
        return f"a {type(raw).__name__} {quote(raw, 70)}"
    return quote(raw, 80)
