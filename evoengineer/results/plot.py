"""Pictures of a run: every evaluation's device time in order, the best so far, and SDPA's
backends as reference lines. Needs matplotlib (``pip install evoengineer[plot]``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..search import RunDir, geomean

PATH_COLOURS = {"scalar": "tab:blue", "wmma": "tab:orange", "mma": "tab:green"}
SDPA_LINE_STYLES = {"flash": "--", "cudnn": ":"}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sdpa_lines(baseline: dict) -> dict[str, float]:
    """Backend -> geomean over the shapes of its time, for the backends timed on every shape."""
    lines = {}
    for backend in SDPA_LINE_STYLES:
        times = [rows[backend]["time"]["median_us"] for rows in baseline.values() if rows.get(backend, {}).get("status") == "ok"]
        if times and len(times) == len(baseline):
            lines[backend] = geomean(times)
    return lines


def draw_progress(ax: Any, results: list[dict], baseline: dict) -> None:
    """Each evaluation (coloured by path, failures as red crosses), the best so far, SDPA lines."""
    best, best_curve = float("inf"), []
    for i, r in enumerate(results, 1):
        if r["status"] == "ok":
            best = min(best, r["objective_us"])
            path = str(r["config"].get("PATH", "?"))
            ax.scatter(i, r["objective_us"], s=12, color=PATH_COLOURS.get(path, "tab:gray"), alpha=0.7,
                       label=path if path not in ax.get_legend_handles_labels()[1] else None)
        else:
            ax.scatter(i, best if best < float("inf") else 1.0, s=14, marker="x", color="tab:red",
                       label="failed" if "failed" not in ax.get_legend_handles_labels()[1] else None)
        best_curve.append(best)
    ax.step(range(1, len(best_curve) + 1), best_curve, where="post", color="black", lw=1.5, label="best so far")
    for backend, time_us in sdpa_lines(baseline).items():
        ax.axhline(time_us, ls=SDPA_LINE_STYLES[backend], color="gray", label=f"SDPA {backend}")
    ax.set_yscale("log")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("device time, geometric mean over shapes (µs)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)


def plot_run(run_path: Path, out: Path) -> Path:
    plt = pyplot()
    run = RunDir(Path(run_path))
    meta = run.meta()
    baseline = run.read_json("baseline.json", {})
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    draw_progress(ax, run.results(), baseline)
    gpu = (meta.get("gpu") or {}).get("gpu", "?")
    ax.set_title(f"{meta.get('space')} · {meta.get('strategy')} · {gpu}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
