"""Per-shape winners across runs: for every measured case, the fastest configuration.

Every ``ok`` record of a run's ``results.jsonl`` carries the median device time of that
configuration on each case of the space. For each case (dtype, B, H, H_kv, S_q, S_k, D,
causal) measured by any of the given runs, the configuration with the shortest median
wins. The exported module dispatches a call to the winner of the *nearest* measured
case of the same (dtype, head dim, causal) by the rule of ``evoengineer.runtime.dispatch``
(``nearest`` applies it here). A (dtype, head dim, causal) with no measured case gets the
fallback configuration: the geometric-mean winner (rank 1) of the first run.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..gpu import fastest_sdpa
from ..runtime.dispatch import RULE, nearest_index, point
from ..search import RunDir, best_results
from ..space import Case, Config, Space, Variant, lengths_label, load_space

DISPATCH_RULE = RULE
"""The rule every export dispatches by (``evoengineer.runtime.dispatch``)."""
DTYPES = ("fp16", "bf16")
_DTYPE_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
                  "bf16": "bf16", "bfloat16": "bf16"}


def canonical_dtype(name: str) -> str:
    """``fp16`` or ``bf16`` (the names the exported module keys its kernels by)."""
    try:
        return _DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ExportError(f"dtype {name!r}: the exported module knows fp16 and bf16") from None


class ExportError(ValueError):
    """Runs that cannot be combined or exported; ``str()`` is the one-line message."""


@dataclass(frozen=True)
class Shape:
    """The dimensions of one measured case."""

    dtype: str
    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    features: tuple[str, ...] = ()
    """Kernel features the case needs (soft-capping, a window, packed sequences): its winner ships a
    kernel with them."""
    lengths: tuple[int, ...] = ()
    """Packed sequences' lengths (``batch`` of them, ``seq_q`` and ``seq_k`` the longest); empty: dense."""
    padded: bool = False
    """With ``lengths``: a padded dense batch (``seq_q`` long) whose batch b ends at ``lengths[b]``."""

    @property
    def variant_key(self) -> tuple[str, int, bool]:
        return (self.dtype, self.head_dim, self.causal)

    @property
    def varlen(self) -> bool:
        """A case on packed sequences: calls of ``attention_varlen`` dispatch among these."""
        return bool(self.lengths) and not self.padded

    def point(self) -> tuple[float, float, float, float]:
        """The coordinates the dispatch distance is measured in."""
        return point(self.batch, self.heads, self.heads_kv, self.seq_q, self.seq_k)

    def label(self) -> str:
        heads = f"H{self.heads}" + (f"/{self.heads_kv}" if self.heads_kv != self.heads else "")
        seq = f"S{self.seq_q}" if self.seq_q == self.seq_k else f"S{self.seq_q}/{self.seq_k}"
        seq = lengths_label(self.lengths, self.padded, seq)
        return f"B{self.batch} {heads} {seq} D{self.head_dim}{' causal' if self.causal else ''} {self.dtype}"


def nearest(cases: Sequence[tuple[Shape, str]], shape: Shape) -> str | None:
    """The configuration of the case of ``shape``'s variant that serves ``shape`` by the exports'
    rule (``DISPATCH_RULE``), or None when the variant has no case."""
    pool = [(case, config_id) for case, config_id in cases if case.variant_key == shape.variant_key]
    index = nearest_index([case for case, _ in pool], shape.batch, shape.heads, shape.heads_kv, shape.seq_q, shape.seq_k,
                          shape.varlen, shape.padded)
    return None if index is None else pool[index][1]


# -- what a run measured ---------------------------------------------------------------


def variant_dtype(variant: Any, space: Space) -> str:
    """The dtype a variant's kernel is built for (``Variant.dtype`` where templates have one)."""
    return canonical_dtype(getattr(variant, "dtype", None) or _space_dtype(space))


def _space_dtype(space: Space) -> str:
    dtype = getattr(space, "dtype", "fp16")
    return dtype if isinstance(dtype, str) else str(list(dtype)[0])


def case_shape(case: Case, space: Space) -> Shape:
    """A space's case as a ``Shape``: the one place that reads ``Case`` fields (``seq`` is S_q,
    ``seq_kv`` S_k; heads_kv, seq_kv and dtype where the case has them, one ``S`` and ``H`` otherwise)."""
    seq = getattr(case, "seq", None)
    return Shape(
        dtype=canonical_dtype(getattr(case, "dtype", None) or getattr(getattr(case, "variant", None), "dtype", None)
                              or _space_dtype(space)),
        batch=case.batch,
        heads=case.heads,
        heads_kv=int(getattr(case, "heads_kv", None) or case.heads),
        seq_q=int(getattr(case, "seq_q", None) or seq),
        seq_k=int(getattr(case, "seq_kv", None) or getattr(case, "seq_k", None) or seq),
        head_dim=case.head_dim,
        causal=bool(case.causal),
        features=tuple(getattr(case, "features", ())),
        lengths=tuple(getattr(case, "lengths", ())),
        padded=bool(getattr(case, "padded", False)),
    )


_TOKEN = re.compile(r"^(B|H|Hkv|S|Sq|Sk|D)(\d+)(?:/(\d+))?$")


def parse_label(label: str, default_dtype: str = "fp16") -> Shape | None:
    """A case label such as ``B4 H16 S2048 D64 causal``, ``B8 H32 S1/4096 D128 bf16`` (S_q 1,
    S_k 4096; also written ``Sq1 Sk4096``) or ``B2 H32/8 S2048 D128`` as a ``Shape``; None when
    it is not one."""
    dims: dict[str, int] = {}
    causal, dtype = False, _DTYPE_ALIASES.get(str(default_dtype).lower(), default_dtype)
    features: set[str] = set()
    for token in label.split():
        if token == "causal":
            causal = True
        elif re.fullmatch(r"softcap\d+(\.\d+)?", token):
            features.add("softcap")
        elif (w := re.fullmatch(r"window(-1|\d+),(-1|\d+)", token)) is not None:
            features.add("window" if w.group(1) != "-1" else "window?")
        elif token.lower() in _DTYPE_ALIASES:
            dtype = _DTYPE_ALIASES[token.lower()]
        elif (m := _TOKEN.match(token)) is not None:
            dims[m.group(1)] = int(m.group(2))
            if m.group(1) == "H" and m.group(3):
                dims["Hkv"] = int(m.group(3))
            elif m.group(1) == "S" and m.group(3):
                dims["Sq"], dims["Sk"] = int(m.group(2)), int(m.group(3))
            elif m.group(3):
                return None
        else:
            return None
    seq_q, seq_k = dims.get("Sq", dims.get("S")), dims.get("Sk", dims.get("S"))
    if not all(k in dims for k in ("B", "H", "D")) or seq_q is None or seq_k is None:
        return None
    if "window?" in features:  # only a right side: a window unless causal stops at the diagonal anyway
        features.discard("window?")
        if not causal:
            features.add("window")
    return Shape(dtype, dims["B"], dims["H"], dims.get("Hkv", dims["H"]), seq_q, seq_k, dims["D"], causal,
                 tuple(sorted(features)))


@dataclass
class RunInfo:
    path: Path
    space: Space
    gpu: str
    arch: str
    records: list[dict]
    baseline: dict
    shapes: dict[str, Shape]

    @classmethod
    def load(cls, path: Path) -> "RunInfo":
        run = RunDir(Path(path))
        if not (run.path / "space.yaml").exists():
            raise ExportError(f"{run.path}: no space.yaml; not a run directory")
        space = load_space(run.path / "space.yaml")
        meta = run.meta() if (run.path / "run.json").exists() else {}
        baseline = run.read_json("baseline.json", {})
        shapes = {case.label(): case_shape(case, space) for case in space.cases}
        return cls(run.path, space, str((meta.get("gpu") or {}).get("gpu") or "?"), str(meta.get("arch") or space.target.arch),
                   [r for r in run.results() if r.get("status") == "ok"], baseline, shapes)

    def shape(self, label: str) -> Shape | None:
        return self.shapes.get(label) or parse_label(label, _space_dtype(self.space))

    def variants(self) -> list[Variant]:
        """The space's variants, each full and causal (an export serves both)."""
        from dataclasses import replace

        seen: dict[Any, None] = {}
        for variant in self.space.variants:
            for causal in (False, True):  # plain kernels; those with features go to the cases that need them
                seen.setdefault(replace(variant, causal=causal, **({"features": ()} if hasattr(variant, "features") else {})))
        return sorted(seen, key=lambda v: (variant_dtype(v, self.space), v.head_dim, v.causal))


@dataclass
class MeasuredConfig:
    """A configuration some run measured; ``id`` is its key (template-qualified if two
    templates share a key)."""

    id: str
    key: str
    config: dict
    template: str
    run: str

    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.config.items()))


@dataclass
class CaseWinner:
    label: str
    shape: Shape
    config: str
    median_us: float
    run: str
    candidates: int
    sdpa_backend: str | None = None
    sdpa_us: float | None = None

    @property
    def speedup(self) -> float | None:
        """Fastest SDPA backend's time / the winner's (> 1: the winner is faster)."""
        return self.sdpa_us / self.median_us if self.sdpa_us else None

    def to_json(self) -> dict:
        return {**asdict(self), "shape": asdict(self.shape), "speedup_vs_sdpa": self.speedup}


@dataclass
class PerShape:
    runs: list[RunInfo]
    winners: list[CaseWinner]
    configs: dict[str, MeasuredConfig]
    fallback: str
    notes: list[str] = field(default_factory=list)

    @property
    def gpu(self) -> str:
        return self.runs[0].gpu

    def table(self) -> list[tuple[Shape, str]]:
        return [(w.shape, w.config) for w in self.winners]

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "runs": [str(r.path) for r in self.runs],
            "rule": DISPATCH_RULE,
            "fallback": self.fallback,
            "cases": [w.to_json() for w in self.winners],
            "configs": {cid: asdict(c) for cid, c in self.configs.items()},
            "notes": self.notes,
        }


def per_shape_winners(paths: Iterable[Path]) -> PerShape:
    """Load the runs and pick, for every measured case, the fastest configuration."""
    runs = [RunInfo.load(Path(p)) for p in paths]
    if not runs:
        raise ExportError("no run given")
    gpus = {r.gpu for r in runs}
    if len(gpus) > 1:
        listed = ", ".join(f"{r.gpu} ({r.path.name})" for r in runs)
        raise ExportError(f"the runs were measured on different GPUs: {listed}; combine runs of one GPU")
    configs: dict[str, MeasuredConfig] = {}
    by_template_key: dict[tuple[str, str], str] = {}
    best: dict[Shape, CaseWinner] = {}
    counts: dict[Shape, set[str]] = {}
    notes: list[str] = []
    for run in runs:
        template = run.space.template
        for record in run.records:
            ident = by_template_key.get((template, record["key"]))
            if ident is None:
                ident = record["key"] if not any(c.key == record["key"] for c in configs.values()) else f"{template}.{record['key']}"
                by_template_key[(template, record["key"])] = ident
                configs[ident] = MeasuredConfig(ident, record["key"], dict(record["config"]), template, str(run.path))
            for case in record.get("cases", []):
                median = (case.get("time") or {}).get("median_us")
                if median is None:
                    continue
                shape = run.shape(case["label"])
                if shape is None:
                    notes.append(f"{run.path.name}: case {case['label']!r} not understood; skipped")
                    continue
                counts.setdefault(shape, set()).add(ident)
                current = best.get(shape)
                if current is None or median < current.median_us:
                    sdpa = fastest_sdpa({case["label"]: run.baseline[case["label"]]}).get(case["label"]) if case["label"] in run.baseline else None
                    best[shape] = CaseWinner(case["label"], shape, ident, float(median), str(run.path), 0,
                                             *(sdpa if sdpa else (None, None)))
    for shape, winner in best.items():
        winner.candidates = len(counts[shape])
    fallback = _fallback(runs[0], by_template_key, configs)
    winners = sorted(best.values(), key=lambda w: (w.shape.dtype, w.shape.head_dim, w.shape.causal,
                                                   w.shape.batch * w.shape.heads, w.shape.seq_q, w.shape.seq_k, w.shape.heads_kv))
    used = {w.config for w in winners} | {fallback}
    return PerShape(runs, winners, {cid: c for cid, c in configs.items() if cid in used}, fallback, list(dict.fromkeys(notes)))


def _fallback(run: RunInfo, ids: dict[tuple[str, str], str], configs: dict[str, MeasuredConfig]) -> str:
    """The first run's geometric-mean winner: its leaderboard's rank 1, else its best record."""
    from .leaderboard import load_leaderboard

    entries = load_leaderboard(run.path)["entries"] if (run.path / "run.json").exists() else []
    key = entries[0]["key"] if entries else None
    if key is None:
        top = best_results(RunDir(run.path), 1)
        if not top:
            raise ExportError(f"{run.path}: no ok evaluation to export")
        key = top[0]["key"]
    ident = ids.get((run.space.template, key))
    if ident is None:  # a leaderboard entry whose record is gone: take it from the board
        entry = entries[0]
        configs[key] = MeasuredConfig(key, key, dict(entry["config"]), run.space.template, str(run.path))
        ident = key
    return ident


# -- text ----------------------------------------------------------------------------------

def short_config(config: dict) -> str:
    """``mma 64x128 w4 st2 s2 q``: the configuration's ``Config.short_label``, the one label
    every table uses."""
    return Config(config).short_label()


def per_shape_table(per_shape: PerShape) -> Any:
    """An 80-column table: case, winning configuration (id and short form), µs, the fastest
    SDPA backend's µs and the ratio."""
    from rich.table import Table

    multi_dtype = len({w.shape.dtype for w in per_shape.winners}) > 1
    table = Table(title=f"per-shape winners on {per_shape.gpu}", title_justify="left", box=None, pad_edge=False)
    table.add_column("case", no_wrap=True)
    table.add_column("id", no_wrap=True)
    table.add_column("config", overflow="fold")
    table.add_column("µs", justify="right", no_wrap=True)
    table.add_column("SDPA µs", justify="right", no_wrap=True)
    table.add_column("×SDPA", justify="right", no_wrap=True)
    for w in per_shape.winners:
        label = w.label if not multi_dtype or w.shape.dtype in w.label.split() else f"{w.label} {w.shape.dtype}"
        config = per_shape.configs[w.config]
        table.add_row(label, config.id[:6], short_config(config.config), f"{w.median_us:.1f}",
                      f"{w.sdpa_us:.1f}" if w.sdpa_us else "-", f"{w.speedup:.2f}" if w.speedup else "-")
    return table


def config_legend(per_shape: PerShape, width: int = 80) -> list[str]:
    """Per configuration: its id, the cases it wins, its short form, then its parameters."""
    import textwrap

    wins: dict[str, int] = {}
    for w in per_shape.winners:
        wins[w.config] = wins.get(w.config, 0) + 1
    lines = []
    for cid, config in per_shape.configs.items():
        tag = f"{wins.get(cid, 0)} case{'s' if wins.get(cid, 0) != 1 else ''}" + (", fallback" if cid == per_shape.fallback else "")
        lines.append(f"{cid} ({tag}): {short_config(config.config)}")
        lines += textwrap.wrap(config.label().replace(",", ", "), width - 4, initial_indent="    ", subsequent_indent="    ")
    return lines
