"""A picture of a run: every evaluation's device time in order, the best so far, and
SDPA's backends as reference lines. Needs matplotlib (``pip install evoengineer[plot]``)."""
from __future__ import annotations

import json
from pathlib import Path

from ..search import RunDir

_COLOURS = {"scalar": "tab:blue", "wmma": "tab:orange", "mma": "tab:green"}


def plot_run(run_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = RunDir(Path(run_path))
    results = run.results()
    meta = run.meta()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    best, best_curve = float("inf"), []
    for i, r in enumerate(results, 1):
        if r["status"] == "ok":
            best = min(best, r["objective_us"])
            path = str(r["config"].get("PATH", "?"))
            ax.scatter(i, r["objective_us"], s=12, color=_COLOURS.get(path, "tab:gray"), alpha=0.7,
                       label=path if path not in ax.get_legend_handles_labels()[1] else None)
        else:
            ax.scatter(i, best if best < float("inf") else 1.0, s=14, marker="x", color="tab:red",
                       label="failed" if "failed" not in ax.get_legend_handles_labels()[1] else None)
        best_curve.append(best)
    ax.step(range(1, len(best_curve) + 1), best_curve, where="post", color="black", lw=1.5, label="best so far")
    baseline_path = run.path / "baseline.json"
    if baseline_path.exists():
        from ..search import geomean

        baseline = json.loads(baseline_path.read_text())
        for backend, style in (("flash", "--"), ("cudnn", ":")):
            times = [rows[backend]["time"]["median_us"] for rows in baseline.values() if rows.get(backend, {}).get("status") == "ok"]
            if times and len(times) == len(baseline):
                ax.axhline(geomean(times), ls=style, color="gray", label=f"SDPA {backend}")
    ax.set_yscale("log")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("device time, geometric mean over shapes (µs)")
    gpu = (meta.get("gpu") or {}).get("gpu", "?")
    ax.set_title(f"{meta.get('space')} · {meta.get('strategy')} · {gpu}")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
