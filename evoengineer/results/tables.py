"""Every table the command line prints, built in one place.

A table is data first: a ``Grid`` (title, columns, rows of text), rendered for a terminal
by ``print_grid`` and for the run report by ``grid_html``. Each column belongs to both
forms, to the narrow form only or to the wide form only. The narrow form fits 80 columns
and keeps what a person reads first (rank, a short configuration label, µs, the ratio to
the fastest SDPA backend, TF/s, error); the wide form adds every other column. A terminal
wide enough for the wide form gets it; ``--wide`` asks for it at any width. No cell is ever
cut short: a figure or label that does not fit wraps onto another line.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..gpu import SDPA_BACKENDS, fastest_sdpa
from ..search import geomean
from ..space import Config

Cell = str | Text


@dataclass(frozen=True)
class Column:
    header: str
    left: bool = False  # labels left, figures right
    form: str = "both"  # "both", "narrow" (compact form only) or "wide" (wide form only)


@dataclass
class Grid:
    """A table as data: one cell per column (narrow- and wide-only columns alike) per row."""

    title: str
    columns: list[Column]
    rows: list[tuple[list[Cell], str]] = field(default_factory=list)
    caption: str = ""

    def add(self, *cells: Cell, style: str = "") -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append((list(cells), style))

    def shown(self, wide: bool) -> list[int]:
        """Indices of the columns of one form."""
        return [i for i, c in enumerate(self.columns) if c.form == "both" or c.form == ("wide" if wide else "narrow")]


def rich_table(grid: Grid, columns: Sequence[int]) -> Table:
    """The grid's ``columns`` (indices) as a rich table."""
    table = Table(title=grid.title, caption=grid.caption or None, caption_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True)
    for i in columns:
        col = grid.columns[i]
        table.add_column(Text(col.header), justify="left" if col.left else "right", overflow="fold")
    for cells, style in grid.rows:
        table.add_row(*(cells[i] if isinstance(cells[i], Text) else Text(cells[i]) for i in columns), style=style or None)
    return table


def _width(console: Console, table: Table) -> int:
    return console.measure(table, options=console.options.update_width(1 << 16)).maximum


def print_grid(console: Console, grid: Grid, wide: bool = False) -> None:
    """Print the wide form when asked for or when the console is wide enough for it; else the
    narrow form plus as many of the wide form's columns, in their order, as still fit.

    With ``wide``, a console narrower than the table is widened for it (a log keeps whole lines)."""
    columns = grid.shown(wide=True)
    needed = _width(console, rich_table(grid, columns))
    if not wide and needed > console.width:
        columns = grid.shown(wide=False)
        for i, col in enumerate(grid.columns):
            if col.form == "wide":
                if _width(console, rich_table(grid, sorted([*columns, i]))) > console.width:
                    break
                columns = sorted([*columns, i])
        console.print(rich_table(grid, columns))
        return
    saved = console.width
    console.width = max(saved, needed)
    try:
        console.print(rich_table(grid, columns))
    finally:
        console.width = saved


def grid_html(grid: Grid, css_class: str = "grid") -> str:
    """The wide form as an HTML table (for the report)."""
    shown = grid.shown(wide=True)
    out = [f'<div class="{css_class}-scroll"><table class="{css_class}">']
    if grid.title:
        out.append(f"<caption>{html.escape(grid.title)}</caption>")
    out.append("<thead><tr>" + "".join(f'<th class="{"l" if grid.columns[i].left else "r"}">{html.escape(grid.columns[i].header)}</th>'
                                        for i in shown) + "</tr></thead><tbody>")
    for cells, style in grid.rows:
        row_class = f' class="{html.escape(style)}"' if style else ""
        tds = []
        for i in shown:
            text = cells[i].plain if isinstance(cells[i], Text) else cells[i]
            tds.append(f'<td class="{"l" if grid.columns[i].left else "r"}">{html.escape(text).replace(chr(10), "<br>")}</td>')
        out.append(f"<tr{row_class}>" + "".join(tds) + "</tr>")
    out.append("</tbody></table></div>")
    if grid.caption:
        out.append(f'<p class="note">{html.escape(grid.caption)}</p>')
    return "\n".join(out)


# -- figures -------------------------------------------------------------------------

SPEEDUP_NOTE = "× SDPA: the fastest SDPA backend's time / this time, per shape (geomean); > 1 is faster"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def label(config: dict | Config) -> str:
    return Config(config).short_label() if not isinstance(config, Config) else config.short_label()


# -- leaderboard ---------------------------------------------------------------------


def fastest_per_case(board: dict) -> dict[str, float]:
    """Shape label -> the fastest SDPA backend's time on it, over the leaderboard's SDPA rows."""
    best: dict[str, float] = {}
    for row in board.get("sdpa", []):
        for case, t in row.get("cases", {}).items():
            if t and (case not in best or t < best[case]):
                best[case] = t
    return best


def speedup_vs_fastest(times: dict[str, float], fastest: dict[str, float]) -> float | None:
    """Geomean over the shapes of fastest SDPA time / this time; None unless every shape has both."""
    if not times or any(case not in fastest for case in times):
        return None
    return geomean([fastest[case] / t for case, t in times.items()])


def leaderboard_grid(board: dict, title: str = "") -> Grid:
    fastest = fastest_per_case(board)
    grid = Grid(
        title or f"leaderboard on {board['gpu']}" + ("" if board.get("retimed") else " (not re-timed)"),
        [Column("rank"), Column("config", left=True), Column("µs"), Column("spread", form="wide"), Column("× SDPA"),
         *(Column(f"× {b}", form="wide") for b in SDPA_BACKENDS), Column("TF/s"), Column("regs", form="wide"),
         Column("smem B", form="wide"), Column("spills B", form="wide"), Column("max err"),
         Column("--config", left=True, form="wide")],
        caption="µs: the median device time, geomean over the shapes; " + SPEEDUP_NOTE
        + "; × backend: that backend's time / this time",
    )
    parts = board.get("partitions") or [{"name": None}]
    if board.get("partitions"):
        grid.caption = grid.caption.replace("geomean over the shapes", "geomean over the partition's shapes")
    for part in parts:
        name = part["name"]
        if board.get("partitions"):  # a search in partitions: a heading row, then its entries and SDPA rows
            cases = len(part.get("cases") or [])
            grid.add("", Text(f"{name}: {cases} case{'s' if cases != 1 else ''}", style="bold"),
                     *("" for _ in grid.columns[2:]))
        for e in board["entries"]:
            if e.get("partition") != name:
                continue
            r = e.get("resources", {})
            times = {c["label"]: c["median_us"] for c in e.get("cases", [])}
            measured = bool(times)  # a run replayed from a recording without per-case times has none
            spread = e.get("spread") if measured else None
            grid.add(
                str(e["rank"]), label(e["config"]), f"{e['geomean_us']:.2f}", f"{spread * 100:.1f}%" if spread is not None else "-",
                _num(speedup_vs_fastest(times, fastest), ".2f"),
                *(_num(e.get("speedup", {}).get(b), ".2f") for b in SDPA_BACKENDS),
                _num(e.get("tflops") or None, ".1f"), str(r.get("registers", "-")), str(r.get("smem", "-")),
                str(r.get("spill_bytes", "-")), _err(e.get("max_abs_err") if measured else None), Config(e["config"]).label(),
            )
        for row in board.get("sdpa", []):
            if row.get("partition") != name:
                continue
            grid.add("", f"SDPA {row['backend']}", f"{row['geomean_us']:.2f}", "",
                     _num(speedup_vs_fastest(row.get("cases", {}), fastest), ".2f"),
                     *("" for _ in SDPA_BACKENDS), _num(row.get("tflops"), ".1f"), "", "", "", "", "", style="dim")
    return grid


# -- search, runs --------------------------------------------------------------------


def search_summary_grid(summary: dict) -> Grid:
    grid = Grid("search summary", [Column("", left=True), Column("")])
    grid.add("evaluations (this session)", str(summary["evaluated"]))
    grid.add("evaluations per minute", str(summary["evaluations_per_minute"]))
    share = summary.get("gpu_busy_share")
    grid.add("GPU-busy share", f"{share * 100:.0f}%" if share is not None else "-")
    if summary.get("devices", 1) > 1:
        grid.add("per device", " ".join(f"{d}:{n}" for d, n in summary["per_device"].items()))
    for status, count in summary["counts"].items():
        if count:
            grid.add(f"  {status}", str(count))
    phases = {name: row for name, row in summary.get("phases", {}).items() if row["total_s"]}
    if phases:
        grid.add("ms per evaluation", "")
        for name, row in phases.items():
            grid.add(f"  {name}", f"{row['mean_ms']:.1f}")
    return grid


def profile_grid(summary: dict) -> Grid:
    """Where the time went: per phase of an evaluation, the total, the mean per evaluation
    and the share of the wall time (of the devices' time for a device's phases)."""
    grid = Grid(f"where the time went ({summary['evaluated']} evaluations, {summary['elapsed_s']} s)",
                [Column("phase", left=True), Column("total s"), Column("mean ms"), Column("share")])
    for name, row in summary.get("phases", {}).items():
        grid.add(name, f"{row['total_s']:.2f}", f"{row['mean_ms']:.1f}", f"{row['share'] * 100:.1f}%")
    return grid


def runs_grid(root: str, rows: Sequence[dict]) -> Grid:
    grid = Grid(f"runs under {root}/",
                [Column("run", left=True), Column("space", left=True, form="wide"), Column("strategy", left=True),
                 Column("gpu", left=True, form="wide"), Column("evals"), Column("ok"), Column("best µs"), Column("done")])
    for r in rows:
        grid.add(_shorter_path(r["run"]), str(r["space"]), str(r["strategy"]), str(r["gpu"]), str(r["evaluations"]), str(r["ok"]),
                 _num(r["best_us"], ".2f"), "yes" if r["finished"] else "no")
    return grid


def _shorter_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


# -- spaces, check -------------------------------------------------------------------


def spaces_grid(rows: Sequence[dict]) -> Grid:
    grid = Grid("built-in search spaces", [Column(c, left=c in ("name", "target", "arch")) for c in ("name", "target", "arch", "cases", "total", "valid")])
    for r in rows:
        grid.add(*(str(r[c]) for c in ("name", "target", "arch", "cases", "total", "valid")))
    return grid


def check_grid(title: str, reports: Iterable[Any]) -> Grid:
    """``reports``: ``StaticReport``s (config, registers, smem, spill_bytes, compile_ms, status, error)."""
    grid = Grid(title, [Column("config", left=True), Column("regs"), Column("smem B"), Column("spills B"), Column("compile ms"),
                        Column("status", left=True), Column("--config", left=True, form="wide")])
    for r in reports:
        if r.status != "compiled":
            status = Text(r.error[:80], style="red")
        else:
            status = Text("spills", style="yellow") if r.spilling else Text("ok")
        grid.add(r.config.short_label(), str(r.registers), str(r.smem), str(r.spill_bytes), f"{r.compile_ms:.0f}", status,
                 r.config.label())
    return grid


# -- GPU: baseline, bench ------------------------------------------------------------


def baseline_grid(space_name: str, gpu: str, baseline: dict[str, dict]) -> Grid:
    best = fastest_sdpa(baseline)
    grid = Grid(f"PyTorch SDPA on {gpu} ({space_name}): median device time, µs",
                [Column("shape", left=True),
                 *(Column(b, form="narrow") for b in SDPA_BACKENDS),
                 *(Column(f"{b} µs [p20-p80], TF/s", form="wide") for b in SDPA_BACKENDS),
                 Column("fastest", left=True), Column("TF/s")])
    for case, rows in baseline.items():
        narrow, wide = [], []
        for b in SDPA_BACKENDS:
            r = rows.get(b, {})
            if r.get("status") == "ok":
                t = r["time"]
                narrow.append(f"{t['median_us']:.1f}")
                wide.append(f"{t['median_us']:.1f} [{t['p20_us']:.1f}-{t['p80_us']:.1f}]\n{r['tflops']:.0f} TF/s")
            else:
                narrow.append(Text(r.get("status", "-"), style="dim"))
                wide.append(Text(r.get("status", "-"), style="dim"))
        name = best.get(case, ("-",))[0]
        tflops = rows.get(name, {}).get("tflops") if case in best else None
        grid.add(case, *narrow, *wide, name, _num(tflops, ".0f"))
    return grid


def bench_grid(cases: Sequence[dict], baseline: dict[str, dict]) -> Grid:
    """``cases``: an ``EvalResult``'s per-shape records; ``baseline``: SDPA's rows per shape."""
    best = fastest_sdpa(baseline)
    grid = Grid("gate and device time",
                [Column("shape", left=True), Column("gate", left=True), Column("µs"), Column("p20-p80", form="wide"),
                 Column("reps", form="wide"), Column("× SDPA"), *(Column(f"× {b}", form="wide") for b in SDPA_BACKENDS),
                 Column("TF/s"), Column("max err"), Column("rel L2 err", form="wide"), Column("trials", form="wide")],
                caption=SPEEDUP_NOTE.replace(" (geomean)", "") + "; × backend: that backend's time / this time")
    for c in cases:
        t = c.get("time")
        median = t["median_us"] if t else None
        rows = baseline.get(c["label"], {})

        def speedup(sdpa_us: float | None) -> str:
            return f"{sdpa_us / median:.2f}" if median and sdpa_us else "-"

        grid.add(
            c["label"], c["status"], _num(median, ".2f"), f"{t['p20_us']:.2f}-{t['p80_us']:.2f}" if t else "-",
            str(t["repetitions"]) if t else "-", speedup(best[c["label"]][1] if c["label"] in best else None),
            *(speedup(rows[b]["time"]["median_us"] if rows.get(b, {}).get("status") == "ok" else None) for b in SDPA_BACKENDS),
            _num(c.get("tflops") or None, ".1f"), _err(c.get("max_abs_err")), _err(c.get("rel_l2_err")), str(c.get("trials", "-")),
        )
    return grid
