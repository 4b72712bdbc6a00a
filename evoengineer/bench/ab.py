"""A/B of two kernels in one process: a configuration against its neighbour in one parameter,
against another configuration, or against itself rendered from a git revision's templates.

Both sides are gated by the search's evaluator (fp32 SDPA on the cases and the edge shapes, in
a crash-isolating worker), then timed in interleaved rounds (A B, then B A) on every case;
per case the ratio B / A is the median of the rounds' own ratios, with a verdict against 1
within the rounds' noise (``verdicts.paired_verdict``).
"""
from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..kernels import StaticReport, build_config
from ..resources import templates_dir
from ..space import Config, Space
from ..space.model import Param
from .protocol import Summary, geomean, round_order
from .tables import TextColumn, text_table
from .verdicts import NOISE_FLOOR, paired_verdict


class AbError(ValueError):
    """Two sides that cannot be compared (a value the space refuses, an unknown revision)."""


@dataclass(frozen=True)
class Side:
    """One side of an A/B: its name in the table, its configuration, and the directory of
    templates it is rendered from (None: the package's own)."""

    name: str
    config: Config
    templates: Path | None = None


def _refusal(space: Space, config: Config) -> str:
    broken = space.violations(config) if set(config) == set(space.param_names) else []
    return f"{config.label()}: violates {broken[0]!r}" if broken else f"{config.label()}: not in space {space.name}"


def neighbour_value(space: Space, config: Config, name: str) -> Any:
    """The next value of parameter ``name`` in the space's list after ``config``'s that keeps the
    configuration in the space (searching forward, then backward); AbError where none does."""
    values = list(space.param(name).values)
    here = values.index(config[name]) if config[name] in values else -1
    for value in values[here + 1:] + values[:max(here, 0)][::-1]:
        if space.contains(config.replace(**{name: value})):
            return value
    raise AbError(f"--param {name}: no other value of {name} keeps {config.label()} in space {space.name}")


def param_sides(space: Space, config: Config, spec: str) -> tuple[Space, Side, Side]:
    """``NAME`` (the configuration against its neighbour in NAME), ``NAME=B`` (against NAME=B)
    or ``NAME=A,B``: the space (with any value it does not list added to NAME's values, its
    constraints judging as before) and the two sides."""
    name, _, text = spec.partition("=")
    name = name.strip()
    if name not in space.param_names:
        raise AbError(f"--param: unknown parameter {name!r}; {space.name} has {', '.join(space.param_names)}")
    try:
        values = [Config.parse(f"{name}={v}")[name] for v in text.split(",")] if text else []
    except ValueError as exc:
        raise AbError(f"--param: {exc}") from None
    if len(values) > 2:
        raise AbError(f"--param: expected NAME, NAME=B or NAME=A,B, got {spec!r}")
    listed = space.param(name).values
    extra = tuple(v for v in dict.fromkeys(values) if v not in listed)
    if extra:
        def widened(params: tuple[Param, ...]) -> tuple[Param, ...]:
            return tuple(Param(p.name, p.values + extra) if p.name == name else p for p in params)

        space = dataclasses.replace(space, params=widened(space.params),
                                    paths=tuple(dataclasses.replace(own, params=widened(own.params)) for own in space.paths))
    if len(values) == 2:
        a, b = config.replace(**{name: values[0]}), config.replace(**{name: values[1]})
    else:
        a = config
        b = config.replace(**{name: values[0] if values else neighbour_value(space, config, name)})
    for side in (a, b):
        if not space.contains(side):
            raise AbError(f"--param: {_refusal(space, side)}")
    return space, Side(f"{name}={a[name]}", a), Side(f"{name}={b[name]}", b)


def config_sides(space: Space, config: Config, other: Config) -> tuple[Side, Side]:
    """The configuration against another one (both in the space)."""
    for side in (config, other):
        if not space.contains(side):
            raise AbError(f"--against: {_refusal(space, side)}")
    return Side("A", config), Side("B", other)


def checkout_templates(revision: str, into: Path) -> Path:
    """The files of the package's templates directory at a git revision, written under ``into``."""
    if revision.startswith("-") or not revision.strip():
        raise AbError(f"--before: {revision!r} is not a git revision")
    here = templates_dir()
    found = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if found.returncode != 0:
        raise AbError(f"--before: {here} is not in a git checkout; give a directory of templates instead")
    root = Path(found.stdout.strip())
    where = here.resolve().relative_to(root.resolve()).as_posix()
    listed = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{revision}:{where}"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise AbError(f"--before: no {where}/ at git revision {revision!r}")
    for name in listed.stdout.split():
        blob = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{where}/{name}"], capture_output=True, check=True)
        (into / name).write_bytes(blob.stdout)
    return into


def revision_sides(config: Config, before: str, into: Path) -> tuple[Side, Side]:
    """The configuration rendered from ``before``'s templates (a git revision, or a directory of
    templates) against the package's own templates."""
    directory = Path(before) if Path(before).is_dir() else checkout_templates(before, into)
    return Side(f"before ({before})", config, directory), Side("after", config)


def build_side(space: Space, side: Side, arch: str) -> StaticReport:
    """Render and compile one side for every variant of the space."""
    return build_config(space.template, side.config, space.variants, arch, space.target.smem_per_block,
                        templates=side.templates)


def round_timing(timing: dict, repetitions: int | None) -> dict:
    """The rounds' timing protocol: every repetition taken (no early stop, no racing)."""
    return {**{k: v for k, v in timing.items() if k != "give_up_above_us"}, "precision": 0.0, "race": 0,
            "repetitions": repetitions or timing["repetitions"]}


def run_ab(evaluator: Any, sides: tuple[Side, Side], rounds: int, repetitions: int | None = None,
           say: Callable[[str], None] | None = None, build: Callable[[Space, Side, str], Any] = build_side) -> dict:
    """Gate both sides and time them in interleaved rounds on every case of the evaluator's space
    (each side's kernels from ``build``, ``build_side`` unless given).

    Returns ``{"sides": [...], "cases": {label: {name: [µs per round]}}}``; a side whose build,
    gate or timing fails carries its status and reason and is not timed again."""
    space = evaluator.space
    timing = round_timing(evaluator.timing, repetitions)
    reports: dict[str, StaticReport] = {}
    out_sides: list[dict] = []
    for side in sides:
        report = build(space, side, evaluator.arch)
        result = evaluator.evaluate(side.config, report)
        out_sides.append({"name": side.name, "config": side.config.to_dict(), "label": side.config.short_label(),
                          "templates": str(side.templates) if side.templates else None, "status": result.status,
                          "reason": result.reason, "resources": result.resources,
                          "max_abs_err": max((c.get("max_abs_err") or 0.0 for c in result.cases), default=None)})
        if say:
            say(f"{side.name}: {result.status} {result.reason}".rstrip())
        if result.ok:
            reports[side.name] = report
    cases: dict[str, dict[str, list[float]]] = {c.label(): {s.name: [] for s in sides} for c in space.cases}
    failed: set[str] = set()
    for r in range(rounds):
        for case in space.cases:
            for name in round_order([s.name for s in sides], r):
                if name not in reports or name in failed:
                    continue
                answer = evaluator.time_case(reports[name], case, timing)
                if answer.get("status") != "ok":
                    failed.add(name)
                    entry = next(s for s in out_sides if s["name"] == name)
                    entry.update(status=answer.get("status", "failed"), reason=answer.get("reason", ""))
                    continue
                cases[case.label()][name].append(answer["time"]["median_us"])
        if say:
            say(f"round {r + 1} of {rounds} done")
    return {"sides": out_sides, "cases": cases}


def ab_rows(measured: dict, floor: float = NOISE_FLOOR) -> list[dict]:
    """Per case: each side's ``Summary`` over the rounds and the verdict on B / A (time ratio)."""
    a, b = (s["name"] for s in measured["sides"])
    rows = []
    for label, per in measured["cases"].items():
        row: dict[str, Any] = {"case": label}
        for key, name in (("a", a), ("b", b)):
            row[key] = Summary.of(per[name]).to_json() if per[name] else None
        if per[a] and per[b]:
            row["b_over_a"] = paired_verdict(per[b], per[a], 1.0, floor).to_json()
        rows.append(row)
    return rows


VERDICT_WORDS = {"lower": "B faster", "equal": "same", "higher": "B slower"}


def ab_lines(measured: dict, rows: Sequence[dict]) -> list[str]:
    """The A/B as printed (80 columns): a line per side, the table, the geomean of B / A."""
    sides = measured["sides"]
    lines = [f"{key}: {s['name']}  {s['label']}  ({s['status']}{', ' + s['reason'][:60] if s['reason'] else ''})"
             for key, s in zip("AB", sides)]
    columns = [TextColumn("case", left=True), TextColumn("A µs"), TextColumn("B µs"), TextColumn("B/A"),
               TextColumn("±"), TextColumn("rounds"), TextColumn("verdict", left=True)]
    cells = []
    for row in rows:
        a, b, v = row["a"], row["b"], row.get("b_over_a")
        cells.append([row["case"], f"{a['median_us']:.1f}" if a else "-", f"{b['median_us']:.1f}" if b else "-",
                      f"{v['ratio']:.3f}" if v else "-", f"{v['noise']:.3f}" if v else "-",
                      str(v["rounds"]) if v else "-", VERDICT_WORDS[v["relation"]] if v else "not timed"])
    lines += text_table(columns, cells)
    ratios = [row["b_over_a"]["ratio"] for row in rows if row.get("b_over_a")]
    if ratios:
        lines.append("B/A: time, the median of the rounds' own ratios (< 1: B faster); ±: their noise")
        lines.append(f"geomean B/A over {len(ratios)} cases: {geomean(ratios):.3f} "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return lines


def ab_templates_dir() -> Any:
    """A temporary directory for a revision's templates (a context manager)."""
    return tempfile.TemporaryDirectory(prefix="evoengineer-ab-")
