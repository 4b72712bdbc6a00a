"""The ranked finalists of a run, with SDPA's backends as reference rows."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from ..gpu import SDPA_BACKENDS
from ..search import RunDir, best_results, geomean
from ..space import Config

LEADERBOARD = "leaderboard.json"


def build_leaderboard(records: list[dict], retimed: dict | None, baseline: dict, case_flops: dict[str, float], gpu: str) -> dict:
    """Rank finalists by the geometric mean over cases of their (re-timed) median device time.

    ``records``: ok results of the finalists; ``retimed``: ``bench.retime`` output, or
    None to rank on the search's own timings; ``baseline``: label -> backend -> row.
    """
    sdpa: dict[str, dict[str, float]] = {}
    if retimed:
        for label, per in retimed["sdpa"].items():
            sdpa[label] = {b: row["median_us"] for b, row in per.items()}
    else:
        for label, per in baseline.items():
            sdpa[label] = {b: row["time"]["median_us"] for b, row in per.items() if row.get("status") == "ok"}
    entries = []
    for record in records:
        per_case = {c["label"]: c for c in record["cases"] if c.get("time")}
        cases = []
        for label, case in per_case.items():
            median = case["time"]["median_us"]
            # a replayed record has the median alone: no spread
            spread = ((case["time"]["p80_us"] - case["time"]["p20_us"]) / median
                      if "p80_us" in case["time"] and "p20_us" in case["time"] else None)
            if retimed:
                again = retimed["candidates"].get(record["key"], {}).get(label)
                if again is None:
                    break
                median = again["median_us"]
                spread = (again["max_us"] - again["min_us"]) / median
            cases.append({
                "label": label, "median_us": median, "spread": spread,
                "tflops": case_flops.get(label, 0) / (median * 1e-6) / 1e12,
                "max_abs_err": case.get("max_abs_err"), "rel_l2_err": case.get("rel_l2_err"),
            })
        else:
            entries.append({
                "config": record["config"], "key": record["key"], "resources": record.get("resources", {}),
                "cases": cases,
                "geomean_us": geomean([c["median_us"] for c in cases]) if cases else record["objective_us"],
                "spread": max((c["spread"] for c in cases), default=0.0)
                if all(c["spread"] is not None for c in cases) else None,
                "tflops": geomean([c["tflops"] for c in cases if c["tflops"] > 0]) if cases else 0.0,
                "max_abs_err": max((c["max_abs_err"] or 0.0 for c in cases), default=0.0)
                if all(c["max_abs_err"] is not None for c in cases) else None,
                "speedup": _speedups(cases, sdpa),
            })
    entries.sort(key=lambda e: e["geomean_us"])
    for rank, entry in enumerate(entries, 1):
        entry["rank"] = rank
    sdpa_rows = []
    labels = [c["label"] for c in entries[0]["cases"]] if entries else list(sdpa)
    for backend in SDPA_BACKENDS:
        times = [sdpa.get(label, {}).get(backend) for label in labels]
        if times and all(t is not None for t in times):
            rates = [case_flops[l] / (t * 1e-6) / 1e12 for l, t in zip(labels, times) if case_flops.get(l)]
            sdpa_rows.append({"backend": backend, "geomean_us": geomean(times), "tflops": geomean(rates) if rates else 0.0,
                              "cases": dict(zip(labels, times))})
    return {"gpu": gpu, "retimed": bool(retimed), "entries": entries, "sdpa": sdpa_rows}


def merge_boards(parts: list[tuple[str, list[str], dict]]) -> dict:
    """One leaderboard of a search in partitions (``search.partition``) from each partition's
    (name, case labels, board): its entries and SDPA rows in partition order, each tagged with
    its partition, ranked within it and numbered on across partitions (``--rank`` stays unique);
    ``partitions`` lists the parts with their cases."""
    entries, sdpa = [], []
    for name, _, board in parts:
        entries += [{**e, "partition": name, "rank": len(entries) + i} for i, e in enumerate(board["entries"], 1)]
        sdpa += [{**row, "partition": name} for row in board["sdpa"]]
    first = parts[0][2] if parts else {}
    return {"gpu": first.get("gpu", "?"), "retimed": bool(first.get("retimed")), "entries": entries, "sdpa": sdpa,
            "partitions": [{"name": name, "cases": labels} for name, labels, _ in parts]}


def _speedups(cases: list[dict], sdpa: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Per backend: geometric mean over cases of SDPA time / candidate time (> 1: faster)."""
    out: dict[str, float | None] = {}
    for backend in SDPA_BACKENDS:
        ratios = [sdpa[c["label"]][backend] / c["median_us"] for c in cases if backend in sdpa.get(c["label"], {})]
        out[backend] = geomean(ratios) if ratios and len(ratios) == len(cases) else None
    return out


def load_leaderboard(run_path: Path, top: int | None = None) -> dict:
    """The run's leaderboard; a run that never reached its finalists gets one built from
    its recorded results (marked ``retimed: false``)."""
    run = RunDir(Path(run_path))
    path = run.path / LEADERBOARD
    if path.exists():
        board = run.read_json(LEADERBOARD)
        _check_board(board, path)
    else:
        baseline = run.read_json("baseline.json", {})
        meta = run.meta() if (run.path / "run.json").exists() else {}
        flops, gpu = meta.get("case_flops", {}), meta.get("gpu", {}).get("gpu", "?")
        parts = [p for p in meta.get("partitions") or [] if isinstance(p, dict) and isinstance(p.get("name"), str)]
        if parts:
            board = merge_boards([(p["name"], list(p.get("cases") or []), build_leaderboard(
                best_results(run, top or 10, p["name"]), None, baseline, flops, gpu)) for p in parts])
        else:
            board = build_leaderboard(best_results(run, top or 10), None, baseline, flops, gpu)
    if top:  # the first ``top`` of each partition
        kept: dict[str | None, int] = {}
        entries = []
        for entry in board["entries"]:
            part = entry.get("partition")
            if kept.get(part, 0) < top:
                kept[part] = kept.get(part, 0) + 1
                entries.append(entry)
        board["entries"] = entries
    return board


def _check_board(board: dict, path: Path) -> None:
    """Raise ``RunFileError`` unless ``board`` has the leaderboard's shape."""
    from ..search import RunFileError

    entries = board.get("entries")
    if not isinstance(entries, list) or not isinstance(board.get("sdpa", []), list):
        raise RunFileError(f"{path}: no list of 'entries'; not a leaderboard a search wrote")
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("rank"), int) and isinstance(entry.get("config"), dict)
                and isinstance(entry.get("key"), str) and isinstance(entry.get("geomean_us"), (int, float))):
            raise RunFileError(f"{path}: entries[{i}] lacks a rank, config, key or geomean_us")


def _short(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


def leaderboard_csv(board: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["rank", "config", "geomean_us", "spread", "tflops", *(f"speedup_{b}" for b in SDPA_BACKENDS),
                     "registers", "smem", "spill_bytes", "max_abs_err", "label"])
    for e in board["entries"]:
        r = e.get("resources", {})
        writer.writerow([e["rank"], _short(e["config"]), f"{e['geomean_us']:.4f}", f"{e['spread']:.4f}" if e["spread"] is not None else "", f"{e['tflops']:.2f}",
                         *(f"{e['speedup'][b]:.4f}" if e["speedup"].get(b) else "" for b in SDPA_BACKENDS),
                         r.get("registers", ""), r.get("smem", ""), r.get("spill_bytes", ""),
                         e["max_abs_err"] if e["max_abs_err"] is not None else "",
                         Config(e["config"]).short_label()])
    for row in board["sdpa"]:
        writer.writerow(["", f"SDPA {row['backend']}" + (f" ({row['partition']})" if row.get("partition") else ""), f"{row['geomean_us']:.4f}", "", f"{row['tflops']:.2f}", *([""] * len(SDPA_BACKENDS)), "", "", "", "", ""])
    return buf.getvalue()

