"""Every table the command line prints fits 80 columns without cutting a figure or a label;
``--wide`` (or a wide terminal) shows every column. Figures are H100 measurements from
docs/performance.md; the search tables come from a replayed search in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from h100_data import FINALISTS, FLOPS, H100, LABELS, PLAIN, SDPA_US, h100_baseline, h100_board, h100_cases
from rich.console import Console

from evoengineer.gpu import SDPA_BACKENDS
from evoengineer.results import baseline_grid, bench_grid, leaderboard_grid, print_grid, search_summary_grid
from evoengineer.search import geomean
from evoengineer.space import Config, load_space

DATA = Path(__file__).resolve().parent / "data"
REPO = DATA.parent.parent
def expected_leaderboard_figures(board: dict) -> list[list[str]]:
    """Per row: what a person reads, computed here from the board's numbers."""
    fastest = {l: min(SDPA_US[b][i] for b in SDPA_BACKENDS) * 1.01 for i, l in enumerate(LABELS)}
    rows = []
    for e in board["entries"]:
        ratio = geomean([fastest[c["label"]] / c["median_us"] for c in e["cases"]])
        rows.append([str(e["rank"]), Config(e["config"]).short_label(), f"{e['geomean_us']:.2f}", f"{ratio:.2f}",
                     f"{e['tflops']:.1f}", f"{e['max_abs_err']:.1e}"])
    for row in board["sdpa"]:
        ratio = geomean([fastest[l] / t for l, t in row["cases"].items()])
        rows.append([f"SDPA {row['backend']}", f"{row['geomean_us']:.2f}", f"{ratio:.2f}", f"{row['tflops']:.1f}"])
    return rows


def render(grid, width: int, wide: bool = False) -> str:
    console = Console(width=width, record=True, highlight=False, file=open(os.devnull, "w"))
    print_grid(console, grid, wide=wide)
    return console.export_text()


def assert_fits(text: str, rows: list[list[str]], width: int = 80) -> None:
    """Nothing cut or folded: no ellipsis, no line past ``width``, every row's figures on one line in order."""
    assert "…" not in text, text
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width, text
    for row in rows:
        hits = [line for line in lines if all(f" {cell} " in f" {line} " for cell in row)]
        assert hits, f"{row} not on one line of:\n{text}"
        line = f" {hits[0]} "
        positions = [line.index(f" {cell} ") for cell in row]
        assert positions == sorted(positions), (row, hits[0])


# -- labels --------------------------------------------------------------------


def test_short_labels_are_compact_documented_and_tell_configurations_apart() -> None:
    assert Config(FINALISTS[1][0]).short_label() == "mma 128x64 w4 st2 p"
    assert Config(FINALISTS[3][0]).short_label() == "mma 128x128 w8 st3 pad q p s4 g4"
    assert Config(FINALISTS[5][0]).short_label() == "scalar 32x32 w4 v4"
    assert Config({**PLAIN, "PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "SCHED": "col"}).short_label() == "wmma 64x64 w4 SCHED=col"
    for space in (H100, load_space("l4")):
        labels = [c.short_label() for c in space.valid_configs()]
        assert len(set(labels)) == len(labels) == space.valid_size()  # one label per configuration
        assert max(map(len, labels)) <= 33


# -- every table at 80 columns --------------------------------------------------


def test_leaderboard_fits_80_columns_with_every_figure() -> None:
    board = h100_board()
    text = render(leaderboard_grid(board), 80)
    assert_fits(text, expected_leaderboard_figures(board))
    assert "× SDPA" in text and "max err" in text


def test_wide_shows_every_column_and_a_wide_terminal_gets_them_unasked() -> None:
    board = h100_board()
    headers = ["spread", *(f"× {b}" for b in SDPA_BACKENDS), "regs", "smem B", "spills B", "--config"]
    forced = render(leaderboard_grid(board), 80, wide=True)
    assert "…" not in forced and max(map(len, forced.splitlines())) > 80
    assert all(h in forced for h in headers)
    for e in board["entries"]:  # the full configuration, as --config takes it, on the row of its rank
        assert any(Config(e["config"]).label() in line and f"{e['geomean_us']:.2f}" in line for line in forced.splitlines())
    assert render(leaderboard_grid(board), 400) == render(leaderboard_grid(board), 400, wide=True)
    # in between, the narrow table plus the wide columns that fit, in order
    middle = render(leaderboard_grid(board), 110)
    assert "× flash" in middle and "--config" not in middle and max(map(len, middle.splitlines())) <= 110
    narrow = render(leaderboard_grid(board), 80)
    assert "--config" not in narrow and "regs" not in narrow


def test_baseline_and_bench_fit_80_columns() -> None:
    baseline = h100_baseline()
    text = render(baseline_grid("h100", "NVIDIA H100 80GB HBM3", baseline), 80)
    rows = []
    for i, label in enumerate(LABELS):
        best = min(SDPA_BACKENDS, key=lambda b: SDPA_US[b][i])
        rows.append([label, *(f"{SDPA_US[b][i]:.1f}" for b in SDPA_BACKENDS), best, f"{FLOPS[label] / SDPA_US[best][i] / 1e6:.0f}"])
    assert_fits(text, rows)
    wide = render(baseline_grid("h100", "NVIDIA H100 80GB HBM3", baseline), 80, wide=True)
    assert "…" not in wide and "[10.5-10.9]" in wide  # p20-p80 of flash on the first shape

    config, times, err, _, _ = FINALISTS[2]
    cases = h100_cases(times, err)
    text = render(bench_grid(cases, baseline), 80)
    rows = [[c["label"], "ok", f"{t:.2f}", f"{min(SDPA_US[b][i] for b in SDPA_BACKENDS) / t:.2f}", f"{c['tflops']:.1f}",
             f"{c['max_abs_err']:.1e}"] for i, (c, t) in enumerate(zip(cases, times))]
    assert_fits(text, rows)
    wide = render(bench_grid(cases, baseline), 80, wide=True)
    assert all(f"× {b}" in wide for b in SDPA_BACKENDS) and "rel L2 err" in wide and "…" not in wide


def test_search_summary_fits_80_columns() -> None:
    summary = {"evaluated": 200, "evaluations_per_minute": 93.4, "gpu_busy_share": 0.8,
               "counts": {"ok": 181, "invalid": 0, "compile_failed": 3, "incorrect": 14, "crashed": 1, "timeout": 1}}
    text = render(search_summary_grid(summary), 80)
    assert_fits(text, [["evaluations (this session)", "200"], ["evaluations per minute", "93.4"], ["GPU-busy share", "80%"],
                       ["ok", "181"], ["incorrect", "14"], ["timeout", "1"]])


def _cli(*args: str, cwd: Path, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    env.pop("LINES", None)
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def test_search_runs_and_leaderboard_commands_fit_80_columns(tmp_path: Path) -> None:
    """A replayed search on the recorded H100 space, as a log sees it (rich falls back to 80 columns)."""
    run = tmp_path / "runs" / "20250301-101500-replay_small-3f9a1c"
    done = _cli("search", "--space", str(DATA / "replay_small_space.yaml"), "--replay", str(DATA / "replay_small_h100.jsonl"),
                "--strategy", "random", "--trials", "20", "--top-k", "5", "--run-dir", str(run), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    board = json.loads((run / "leaderboard.json").read_text())
    assert len(board["entries"]) == 5
    rows = [[str(e["rank"]), Config(e["config"]).short_label(), f"{e['geomean_us']:.2f}"] for e in board["entries"]]
    table_part = done.stdout[done.stdout.index("search summary"):done.stdout.index("run directory:")]
    assert_fits(table_part, [["evaluations (this session)", "20"], ["ok", "20"], *rows])

    listed = _cli("runs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    best = min(json.loads(l)["objective_us"] for l in (run / "results.jsonl").read_text().splitlines())
    assert_fits(listed.stdout, [[f"runs/{run.name}", "random", "20", "20", f"{best:.2f}", "yes"]])

    # the same run with a real H100 leaderboard in it: `leaderboard` as a log sees it, then --wide
    (run / "leaderboard.json").write_text(json.dumps(h100_board()))
    shown = _cli("leaderboard", str(run), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert_fits(shown.stdout, expected_leaderboard_figures(h100_board()))
    wide = _cli("leaderboard", str(run), "--wide", cwd=tmp_path)
    assert "…" not in wide.stdout and "--config" in wide.stdout and "× efficient" in wide.stdout
    top = _cli("leaderboard", str(run), "--top", "2", cwd=tmp_path, columns=300)
    assert "× efficient" in top.stdout and Config(FINALISTS[1][0]).label() in top.stdout  # a wide terminal gets every column


def test_spaces_and_check_fit_80_columns(tmp_path: Path) -> None:
    spaces = _cli("spaces", cwd=tmp_path)
    assert spaces.returncode == 0, spaces.stderr
    rows = [[s, load_space(s).target.name, load_space(s).target.arch, str(load_space(s).total_size()), str(load_space(s).valid_size())]
            for s in ("h100", "l4")]
    assert_fits(spaces.stdout, rows)

    compiled = _cli("check", "--space", "h100", "--limit", "2", "--seed", "5", "--json", cwd=tmp_path)
    assert compiled.returncode == 0, compiled.stderr
    configs = json.loads(compiled.stdout)["configs"]
    checked = _cli("check", "--space", "h100", "--limit", "2", "--seed", "5", "--quiet", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    table_part = checked.stdout[: checked.stdout.index("space h100:")]
    assert_fits(table_part, [[Config(c["config"]).short_label(), str(c["registers"]), str(c["smem"]), str(c["spill_bytes"])]
                             for c in configs])
    wide = _cli("check", "--space", "h100", "--limit", "2", "--seed", "5", "--quiet", "--wide", cwd=tmp_path)
    assert all(Config(c["config"]).label() in wide.stdout for c in configs) and "…" not in wide.stdout


@pytest.mark.parametrize("command", ["check", "spaces", "baseline", "bench", "search", "runs", "leaderboard"])
def test_every_table_command_takes_wide(command: str) -> None:
    from evoengineer.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert any("--wide" in a.option_strings for a in sub._actions)


def test_sdpa_rows_skip_cases_without_flops_rather_than_fail() -> None:
    """A finalist timed on a case the partition's FLOP table lacks (a record from before a resume
    narrowed the search) leaves that case out of the SDPA rows' TF/s instead of taking log(0)."""
    from evoengineer.results import build_leaderboard

    config, times, err, regs, smem = FINALISTS[0]
    record = {"config": config, "key": Config(config).key(), "status": "ok", "objective_us": 1.0,
              "resources": {"registers": regs}, "cases": h100_cases(times, err)}
    partial = {label: FLOPS[label] for label in LABELS[:2]}
    board = build_leaderboard([record], None, h100_baseline(), partial, "NVIDIA H100 80GB HBM3")
    cudnn = next(row for row in board["sdpa"] if row["backend"] == "cudnn")
    assert cudnn["tflops"] > 0 and len(cudnn["cases"]) == len(LABELS)
    empty = build_leaderboard([record], None, h100_baseline(), {}, "NVIDIA H100 80GB HBM3")
    assert all(row["tflops"] == 0.0 for row in empty["sdpa"])
