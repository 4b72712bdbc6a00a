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
from rich.console import Console

from evoengineer.gpu import SDPA_BACKENDS
from evoengineer.results import (
    baseline_grid,
    bench_grid,
    build_leaderboard,
    leaderboard_grid,
    print_grid,
    search_summary_grid,
)
from evoengineer.search import geomean
from evoengineer.space import Config, load_space

DATA = Path(__file__).resolve().parent / "data"
REPO = DATA.parent.parent
H100 = load_space("h100")
FLOPS = {c.label(): c.flops() for c in H100.cases}
LABELS = [c.label() for c in H100.cases]  # B1 H8 S512 D64, ... causal, B4 H16 S2048 D64, ..., B4 H16 S2048 D128 causal

# SDPA's backends on the H100, µs per shape in LABELS' order: flash, cudnn, efficient, math
SDPA_US = {
    "flash": [10.7, 10.8, 234.8, 157.2, 408.4, 273.6],
    "cudnn": [10.0, 10.1, 153.4, 99.5, 219.5, 148.9],
    "efficient": [23.5, 23.6, 553.1, 339.9, 846.8, 541.3],
    "math": [70.4, 89.5, 4756.3, 5856.9, 6036.7, 7131.7],
}
MMA = dict(PATH="mma", VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=0, P_IN_REGS=0, SPLITS=1, KV_GROUPS=1)
PLAIN = dict(VEC=8, STAGES=1, SMEM_LAYOUT="swizzle", Q_IN_REGS=0, P_IN_REGS=0, SPLITS=1, KV_GROUPS=1)
FINALISTS = [  # (configuration, µs per shape, max abs error, registers, shared memory)
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 4, "P_IN_REGS": 1}, [15.4, 15.2, 234.4, 164.7, 394.8, 244.3], 1.1e-3, 255, 65536),
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 64, "WARPS": 4, "STAGES": 2, "P_IN_REGS": 1}, [11.2, 13.3, 220.2, 162.6, 403.7, 255.3], 1.2e-3, 255, 98304),
    ({**MMA, "BLOCK_M": 32, "BLOCK_N": 64, "WARPS": 8, "Q_IN_REGS": 1, "P_IN_REGS": 1, "KV_GROUPS": 4}, [6.4, 6.3, 294.8, 183.0, 578.4, 367.4], 8.3e-4, 136, 135168),
    ({**MMA, "BLOCK_M": 128, "BLOCK_N": 128, "WARPS": 8, "STAGES": 3, "SMEM_LAYOUT": "pad", "Q_IN_REGS": 1, "P_IN_REGS": 1,
      "SPLITS": 4, "KV_GROUPS": 4}, [9.0, 9.5, 300.0, 200.0, 600.0, 400.0], 1.4e-3, 255, 212992),
    ({**PLAIN, "PATH": "wmma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4}, [21.8, 21.0, 523.0, 346.9, 861.6, 551.4], 2.5e-4, 128, 52224),
    ({**PLAIN, "PATH": "scalar", "BLOCK_M": 32, "BLOCK_N": 32, "WARPS": 4, "VEC": 4}, [39.7, 40.9, 2572.4, 1447.2, 5093.8, 2963.9], 1.2e-4, 96, 30208),
]


def _time(median: float) -> dict:
    return {"median_us": median, "p20_us": round(median * 0.985, 2), "p80_us": round(median * 1.02, 2), "repetitions": 100}


def h100_baseline() -> dict:
    return {label: {b: {"status": "ok", "time": _time(SDPA_US[b][i]), "tflops": FLOPS[label] / (SDPA_US[b][i] * 1e-6) / 1e12}
                    for b in SDPA_BACKENDS} for i, label in enumerate(LABELS)}


def h100_cases(times: list[float], err: float) -> list[dict]:
    return [{"label": label, "status": "ok", "max_abs_err": err * (0.5 + 0.1 * i), "rel_l2_err": err / 7, "trials": 3,
             "time": _time(t), "tflops": FLOPS[label] / (t * 1e-6) / 1e12} for i, (label, t) in enumerate(zip(LABELS, times))]


def h100_board() -> dict:
    """A leaderboard as ``search`` writes it: finalists re-timed interleaved with SDPA."""
    records, retimed = [], {"candidates": {}, "failures": {}, "sdpa": {}}
    for config, times, err, regs, smem in FINALISTS:
        key = Config(config).key()
        records.append({"config": config, "key": key, "status": "ok", "objective_us": geomean(times),
                        "resources": {"registers": regs, "smem": smem, "spill_bytes": 0}, "cases": h100_cases(times, err)})
        retimed["candidates"][key] = {l: {"median_us": t * 1.01, "min_us": t, "max_us": t * 1.03, "rounds": 3} for l, t in zip(LABELS, times)}
    for i, label in enumerate(LABELS):
        retimed["sdpa"][label] = {b: {"median_us": SDPA_US[b][i] * 1.01, "min_us": SDPA_US[b][i], "max_us": SDPA_US[b][i] * 1.02,
                                      "rounds": 3} for b in SDPA_BACKENDS}
    board = build_leaderboard(records, retimed, h100_baseline(), FLOPS, "NVIDIA H100 80GB HBM3")
    board.update(space="h100", run="runs/20250301-101500-h100-3f9a1c")
    return board


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
        assert max(map(len, labels)) <= 32


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
                "--strategy", "random", "--trials", "40", "--top-k", "5", "--run-dir", str(run), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    board = json.loads((run / "leaderboard.json").read_text())
    assert len(board["entries"]) == 5
    rows = [[str(e["rank"]), Config(e["config"]).short_label(), f"{e['geomean_us']:.2f}"] for e in board["entries"]]
    table_part = done.stdout[done.stdout.index("search summary"):done.stdout.index("run directory:")]
    assert_fits(table_part, [["evaluations (this session)", "40"], ["ok", "40"], *rows])

    listed = _cli("runs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    best = min(json.loads(l)["objective_us"] for l in (run / "results.jsonl").read_text().splitlines())
    assert_fits(listed.stdout, [[f"runs/{run.name}", "random", "40", "40", f"{best:.2f}", "yes"]])

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

    compiled = _cli("check", "--space", "h100", "--limit", "3", "--seed", "5", "--json", cwd=tmp_path)
    assert compiled.returncode == 0, compiled.stderr
    configs = json.loads(compiled.stdout)["configs"]
    checked = _cli("check", "--space", "h100", "--limit", "3", "--seed", "5", "--quiet", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    table_part = checked.stdout[: checked.stdout.index("space h100:")]
    assert_fits(table_part, [[Config(c["config"]).short_label(), str(c["registers"]), str(c["smem"]), str(c["spill_bytes"])]
                             for c in configs])
    wide = _cli("check", "--space", "h100", "--limit", "3", "--seed", "5", "--quiet", "--wide", cwd=tmp_path)
    assert all(Config(c["config"]).label() in wide.stdout for c in configs) and "…" not in wide.stdout


@pytest.mark.parametrize("command", ["check", "spaces", "baseline", "bench", "search", "runs", "leaderboard"])
def test_every_table_command_takes_wide(command: str) -> None:
    from evoengineer.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert any("--wide" in a.option_strings for a in sub._actions)
