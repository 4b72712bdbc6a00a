"""One self-contained HTML page about a run: the best so far over evaluations and over time,
every evaluation by path and status, parameter importances from the run's Optuna study, the
re-timed leaderboard against each SDPA backend, the fastest configuration per shape, and the
environment. Figures are PNGs embedded as data URIs: the file needs nothing else to open.
Needs matplotlib (``pip install evoengineer[plot]``)."""
from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

from ..gpu import STATUSES, fastest_sdpa
from ..search import RunDir
from ..space import Config
from .leaderboard import load_leaderboard
from .plot import PATH_COLOURS, draw_progress, pyplot, sdpa_lines
from .tables import Column, Grid, grid_html, leaderboard_grid

REPORT = "report.html"
SECTIONS = ("progress", "evaluations", "importance", "leaderboard", "shapes", "environment")
_COUNTED = set(STATUSES)


def write_report(run_path: Path, out: Path | None = None) -> Path:
    """Write the report of the run at ``run_path`` (default ``<run>/report.html``)."""
    run = RunDir(Path(run_path))
    out = Path(out) if out else run.path / REPORT
    meta = run.meta()
    results = run.results()
    baseline = run.read_json("baseline.json", {})
    env = run.read_json("env.json", {}) or meta.get("gpu") or {}
    study, study_note = open_run_study(run, meta)
    plt = pyplot()
    sections = [
        _progress_section(plt, run, results, baseline, study, study_note),
        _evaluations_section(plt, results),
        _importance_section(plt, study, study_note),
        _leaderboard_section(run),
        _shapes_section(results, baseline),
        _environment_section(meta, env),
    ]
    title = f"EvoEngineer run {run.path.name}"
    ok = [r for r in results if r["status"] == "ok"]
    summary = (f"space <b>{_e(meta.get('space'))}</b>, strategy <b>{_e(meta.get('strategy'))}</b> on "
               f"<b>{_e(env.get('gpu', '?'))}</b>: {len(results)} evaluations, {len(ok)} ok")
    for part in dict.fromkeys(r.get("partition") for r in ok):  # a search in partitions: each one's best
        best = min((r for r in ok if r.get("partition") == part), key=lambda r: r["objective_us"])
        summary += (f"; best{' of ' + _e(part) if part else ''} {best['objective_us']:.2f} µs "
                    f"({_e(Config(best['config']).short_label())})")
    summary += f". Started {_e(meta.get('started', '?'))}, " + (f"finished {_e(meta['finished'])}." if meta.get("finished") else "not finished.")
    page = _PAGE.format(title=_e(title), css=_CSS, summary=summary, sections="\n".join(sections))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


# -- the study -----------------------------------------------------------------------


def open_run_study(run: RunDir, meta: dict) -> tuple[Any, str]:
    """The run's Optuna study, or None and why not. A SQLite file that moved with the run
    directory is found there; a storage that does not exist is never created."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = str(meta.get("storage") or run.default_storage())
    name = meta.get("study_name") or run.path.name
    parts = [p.get("name") for p in meta.get("partitions") or [] if isinstance(p, dict)]
    if parts:
        return None, f"the search ran in {len(parts)} partitions ({', '.join(map(str, parts))}), each its own study"
    if storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///"):])
        if not path.exists():
            moved = run.path / path.name
            if not moved.exists():
                return None, f"the study's storage {storage} does not exist (nor {moved})"
            storage = f"sqlite:///{moved.resolve()}"
    try:
        return optuna.load_study(study_name=name, storage=storage), ""
    except Exception as exc:  # noqa: BLE001 - any storage failure is reported, not raised
        return None, f"could not open the study {name!r} in {storage}: {type(exc).__name__}: {exc}"


def _run_trials(study: Any, run: RunDir) -> list[Any]:
    """This run's finished trials (a shared study holds other searches' too), in completion order."""
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    trials = [t for t in study.get_trials(deepcopy=False, states=states)
              if t.user_attrs.get("run", run.path.name) == run.path.name and t.user_attrs.get("status") in _COUNTED
              and t.datetime_complete is not None]
    return sorted(trials, key=lambda t: t.datetime_complete)


# -- sections ------------------------------------------------------------------------


def _progress_section(plt: Any, run: RunDir, results: list[dict], baseline: dict, study: Any, study_note: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    draw_progress(ax, results, baseline)
    ax.set_title("every evaluation and the best so far")
    by_evaluation = _figure(plt, fig, "best so far over evaluations")

    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    trials = _run_trials(study, run) if study is not None else []
    if trials:
        start = min(t.datetime_start or t.datetime_complete for t in trials)
        xs = [(t.datetime_complete - start).total_seconds() for t in trials]
        values = [t.value if t.state.name == "COMPLETE" else None for t in trials]
        source = "each evaluation's completion time in the study"
    else:
        xs, elapsed = [], 0.0
        for r in results:
            elapsed += float(r.get("eval_s") or 0.0)
            xs.append(elapsed)
        values = [r["objective_us"] if r["status"] == "ok" else None for r in results]
        source = "the evaluations' own durations added up (the study holds no times: " + (study_note or "no trials") + ")"
    minutes = bool(xs) and xs[-1] > 120
    scale = 60.0 if minutes else 1.0
    best, curve_x, curve_y = float("inf"), [], []
    for x, value in zip(xs, values):
        if value is not None and value < best:
            best = value
        if best < float("inf"):
            curve_x.append(x / scale)
            curve_y.append(best)
    if curve_x:
        ax.step(curve_x, curve_y, where="post", color="black", lw=1.5, label="best so far")
        ax.scatter(curve_x, curve_y, s=6, color="black")
        ax.set_yscale("log")
    for backend, time_us in sdpa_lines(baseline).items():
        ax.axhline(time_us, ls="--" if backend == "flash" else ":", color="gray", label=f"SDPA {backend}")
    ax.set_xlabel("minutes since the search started" if minutes else "seconds since the search started")
    ax.set_ylabel("best device time so far (µs)")
    ax.set_title("best so far over time")
    ax.grid(True, which="both", alpha=0.3)
    if curve_x:
        ax.legend(loc="upper right", fontsize=8)
    by_time = _figure(plt, fig, "best so far over time")
    return _section("progress", "Best so far", by_evaluation + by_time + _note(f"Time axis: {source}."))


def _evaluations_section(plt: Any, results: list[dict]) -> str:
    if not results:
        return _section("evaluations", "Every evaluation", _note("The run has no recorded evaluation yet."))
    paths = sorted({str(r["config"].get("PATH", "?")) for r in results})
    statuses = [s for s in STATUSES if any(r["status"] == s for r in results)]
    statuses = list(dict.fromkeys(statuses + sorted({r["status"] for r in results} - set(statuses))))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    for path in paths:
        colour = PATH_COLOURS.get(path, "tab:gray")
        ok = [(i, r["objective_us"]) for i, r in enumerate(results, 1) if r["status"] == "ok" and str(r["config"].get("PATH", "?")) == path]
        if ok:
            top.scatter(*zip(*ok), s=12, color=colour, alpha=0.75, label=path)
        rows = [(i, statuses.index(r["status"])) for i, r in enumerate(results, 1) if str(r["config"].get("PATH", "?")) == path]
        bottom.scatter(*zip(*rows), s=14, marker="s", color=colour, alpha=0.75)
    if any(r["status"] == "ok" for r in results):
        top.set_yscale("log")
        top.legend(loc="upper right", fontsize=8, title="PATH")
    top.set_ylabel("device time (µs)")
    top.set_title("every evaluation by path (ok: its time) and status")
    top.grid(True, which="both", alpha=0.3)
    bottom.set_yticks(range(len(statuses)), statuses)
    bottom.set_ylim(-0.6, len(statuses) - 0.4)
    bottom.set_xlabel("evaluation")
    bottom.grid(True, axis="x", alpha=0.3)
    body = _figure(plt, fig, "every evaluation by path and status")

    counts = Counter((str(r["config"].get("PATH", "?")), r["status"]) for r in results)
    grid = Grid("evaluations per path and status", [Column("PATH", left=True), *(Column(s) for s in statuses), Column("all")])
    for path in paths:
        grid.add(path, *(str(counts[(path, s)]) for s in statuses), str(sum(counts[(path, s)] for s in statuses)))
    grid.add("all", *(str(sum(counts[(p, s)] for p in paths)) for s in statuses), str(len(results)))
    body += grid_html(grid)

    listing = Grid(f"all {len(results)} evaluations in order",
                   [Column("#"), Column("config", left=True), Column("status", left=True), Column("µs"), Column("reason", left=True)])
    for i, r in enumerate(results, 1):
        listing.add(str(i), Config(r["config"]).short_label(), r["status"],
                    f"{r['objective_us']:.2f}" if r.get("objective_us") is not None else "-", str(r.get("reason") or "")[:160])
    body += f"<details><summary>every evaluation ({len(results)})</summary>\n{grid_html(listing)}\n</details>"
    return _section("evaluations", "Every evaluation", body)


def param_importances(study: Any) -> tuple[dict[str, float] | None, str]:
    """``optuna.importance.get_param_importances`` on the study, or None and why not; the
    second value also says which evaluator answered."""
    import warnings

    import optuna

    how = "optuna.importance.get_param_importances, its default evaluator"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            try:
                importances = optuna.importance.get_param_importances(study)
            except ImportError as exc:  # fANOVA, the default before optuna 5, needs scikit-learn
                evaluator = getattr(optuna.importance, "PedAnovaImportanceEvaluator", None)
                if evaluator is None:
                    raise
                importances = optuna.importance.get_param_importances(study, evaluator=evaluator())
                how = f"PED-ANOVA (the default evaluator needs what is missing here: {exc})"
        except (ValueError, RuntimeError, ImportError, ZeroDivisionError) as exc:
            return None, f"Optuna could not compute importances for this study: {exc}"
    equal = [w for w in caught if "equal" in str(w.message)]
    if equal:
        return None, f"Optuna could not compute importances for this study: {equal[0].message}"
    if not importances:
        return None, "Optuna could not compute importances for this study: it has no completed trial with parameters."
    return importances, how


def _importance_section(plt: Any, study: Any, study_note: str) -> str:
    title = "Parameter importances"
    if study is None:
        return _section("importance", title, _note(f"No importances: {study_note}."))
    importances, how = param_importances(study)
    if importances is None:
        return _section("importance", title, _note(how))
    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.2), dpi=110)
    ax.barh(names, [importances[n] for n in names], color="tab:blue")
    ax.set_xlabel("importance (normalised to sum to 1)")
    ax.set_title("parameter importances")
    ax.grid(True, axis="x", alpha=0.3)
    body = _figure(plt, fig, "parameter importances")
    grid = Grid("", [Column("parameter", left=True), Column("importance")])
    for name, value in importances.items():
        grid.add(name, f"{value:.3f}")
    completed = sum(1 for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE")
    body += grid_html(grid) + _note(f"From {how}, over the study's {completed} completed trials (failed ones carry no value).")
    return _section("importance", title, body)


def _leaderboard_section(run: RunDir) -> str:
    board = load_leaderboard(run.path)
    if not board["entries"]:
        return _section("leaderboard", "Leaderboard against SDPA", _note("No configuration of this run passed the gate."))
    note = ("The finalists were re-timed interleaved with SDPA's backends in the same process."
            if board.get("retimed") else "Not re-timed: the ranking uses the search's own timings.")
    if not board.get("sdpa"):
        note += " This run holds no SDPA timings (a replay, or a run stopped before its baseline), so no ratios."
    return _section("leaderboard", "Leaderboard against SDPA", grid_html(leaderboard_grid(board)) + _note(note))


def shape_winners(results: list[dict]) -> dict[str, dict]:
    """Shape label -> the fastest ok configuration on that shape: {config, median_us, tflops, max_abs_err}."""
    best: dict[str, dict] = {}
    for r in results:
        if r["status"] != "ok":
            continue
        for case in r.get("cases", []):
            t = case.get("time")
            if not t or case.get("status", "ok") != "ok":
                continue
            if case["label"] not in best or t["median_us"] < best[case["label"]]["median_us"]:
                best[case["label"]] = {"config": r["config"], "median_us": t["median_us"], "tflops": case.get("tflops"),
                                       "max_abs_err": case.get("max_abs_err")}
    return best


def _shapes_section(results: list[dict], baseline: dict) -> str:
    title = "Per-shape winners"
    winners = shape_winners(results)
    if not winners:
        why = ("The run's records carry no per-shape timings (a replayed search records one objective per configuration)"
               if any(r["status"] == "ok" for r in results) else "No evaluation of this run passed the gate")
        return _section("shapes", title, _note(f"{why}, so there is no winner per shape."))
    sdpa = fastest_sdpa(baseline)
    grid = Grid("the fastest ok configuration on each shape, from every evaluation of the run",
                [Column("shape", left=True), Column("config", left=True), Column("µs"), Column("TF/s"), Column("max err"),
                 Column("fastest SDPA", left=True), Column("SDPA µs"), Column("× SDPA"), Column("--config", left=True)])
    for label, w in winners.items():
        backend, sdpa_us = sdpa.get(label, ("-", None))
        grid.add(label, Config(w["config"]).short_label(), f"{w['median_us']:.2f}",
                 f"{w['tflops']:.1f}" if w.get("tflops") else "-",
                 f"{w['max_abs_err']:.1e}" if w.get("max_abs_err") is not None else "-", backend,
                 f"{sdpa_us:.2f}" if sdpa_us else "-", f"{sdpa_us / w['median_us']:.2f}" if sdpa_us else "-",
                 Config(w["config"]).label())
    return _section("shapes", title, grid_html(grid) + _note(
        "Times as recorded during the search (not re-timed); × SDPA: the fastest SDPA backend's time / this time, > 1 is faster."))


def _environment_section(meta: dict, env: dict) -> str:
    grid = Grid("env.json: the machine the run measured on", [Column("", left=True), Column("", left=True)])
    for key, value in env.items():
        grid.add(str(key), value if isinstance(value, str) else json.dumps(value))
    settings = Grid("run.json: the search's settings", [Column("", left=True), Column("", left=True)])
    for key in ("space", "space_path", "strategy", "seed", "trials", "time_s", "top_k", "shapes", "storage", "study_name",
                "replay", "arch", "started", "finished"):
        if key in meta:
            value = meta[key]
            settings.add(key, value if isinstance(value, str) else json.dumps(value))
    return _section("environment", "Environment", grid_html(grid) + grid_html(settings))


# -- HTML ----------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value))


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}">\n<h2>{_e(title)}</h2>\n{body}\n</section>'


def _figure(plt: Any, fig: Any, alt: str) -> str:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{data}"><figcaption>{_e(alt)}</figcaption></figure>'


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
div.grid-scroll { overflow-x: auto; } table.grid { border-collapse: collapse; margin: .8em 0; font-size: 13px; }
table.grid caption { text-align: left; font-weight: 600; padding-bottom: .3em; }
table.grid th, table.grid td { padding: .2em .7em; border-bottom: 1px solid #eee; white-space: nowrap; }
table.grid td.l, table.grid th.l { text-align: left; } table.grid td.r, table.grid th.r { text-align: right; }
table.grid tr.dim td { color: #777; }
figure { margin: 1em 0; } figure img { max-width: 100%; } figcaption { color: #666; font-size: 12px; }
p.note { color: #555; font-size: 13px; } details { margin: .8em 0; } nav a { margin-right: 1em; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<h1>{title}</h1>
<p>{summary}</p>
<nav><a href="#progress">best so far</a><a href="#evaluations">evaluations</a><a href="#importance">importances</a><a href="#leaderboard">leaderboard</a><a href="#shapes">per shape</a><a href="#environment">environment</a></nav>
{sections}
</body>
</html>
"""

__all__ = ["REPORT", "SECTIONS", "open_run_study", "param_importances", "shape_winners", "write_report"]
