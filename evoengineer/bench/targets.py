"""The targets of an exported module against SDPA as a user calls it, row by row (pure: no
torch). Figures are ``calls`` rows (device_us, eager_us, graph_us, overhead_us and spreads):

  (a) eager speedup >= 1 where the device speedup is >= 1 (other rows: n/a);
  (b) overhead ours <= SDPA's, where a difference within the noise counts as equal; noise =
      ours' and SDPA's eager spreads + their device spreads;
  (c) graph speedup within GRAPH_TOLERANCE of the device speedup, from each side's graph over
      the device samples taken beside it (a drift of the clock between the device and the
      graph columns of a round does not enter).
"""
from __future__ import annotations

import statistics
from typing import Any

from .calls import paired_speedup
from .verdicts import relation

GRAPH_TOLERANCE = 0.05   # target (c): |graph speedup / device speedup - 1| at most this


def row_label(shape: str, dtype: str, causal: bool) -> str:
    return f"{shape}{' causal' if causal else ''} {dtype}"


def overhead_noise_us(ours: dict, sdpa: dict) -> float:
    """The noise of ``overhead ours - overhead SDPA's``: each overhead is eager - device, so the sum
    of both eager spreads ((max - min) / 2 of the loops) and both device spreads ((p80 - p20) / 2)."""
    return sum(r.get("eager_spread_us", 0.0) + r.get("device_spread_us", 0.0) for r in (ours, sdpa))


def target_verdicts(ours: dict, sdpa: dict, tolerance: float = GRAPH_TOLERANCE) -> dict[str, dict]:
    """The three targets on one row, from the evo and sdpa measurements (dicts with device_us,
    eager_us, graph_us, overhead_us and the spreads; with "rounds", the speedups are the medians of
    the rounds' paired speedups and (c)'s deviation the median of the rounds' own):

    a: eager speedup >= 1 where the device speedup is >= 1 (``applies`` False and ``met`` None
       elsewhere);
    b: overhead ours <= SDPA's; a difference within ``overhead_noise_us`` counts as equal
       (verdict ``lower``, ``equal`` or ``higher``; met unless higher);
    c: |graph speedup / device speedup - 1| <= ``tolerance``. That deviation is SDPA's
       ``graph_per_device`` over ours, minus 1, where the rows have it (each side's graph samples
       over the device samples taken next to them: the same quotient, without the clock's drift
       between an implementation's device and graph measurements); else graph / device - 1.
    """
    device, eager, graph = (paired_speedup(ours, sdpa, c) for c in ("device_us", "eager_us", "graph_us"))
    applies = device >= 1.0
    noise = overhead_noise_us(ours, sdpa)
    difference = ours["overhead_us"] - sdpa["overhead_us"]
    verdict = relation(difference, noise)
    a_rounds, b_rounds = ours.get("rounds"), sdpa.get("rounds")
    if a_rounds and b_rounds and len(a_rounds) == len(b_rounds):
        deviation = statistics.median(s["graph_per_device"] / o["graph_per_device"] - 1
                                      for o, s in zip(a_rounds, b_rounds))
    elif "graph_per_device" in ours and "graph_per_device" in sdpa:
        deviation = sdpa["graph_per_device"] / ours["graph_per_device"] - 1
    else:
        deviation = graph / device - 1
    return {
        "a": {"device_speedup": device, "eager_speedup": eager, "applies": applies,
              "met": eager >= 1.0 if applies else None},
        "b": {"overhead_evo_us": ours["overhead_us"], "overhead_sdpa_us": sdpa["overhead_us"],
              "difference_us": difference, "noise_us": noise, "verdict": verdict, "met": verdict != "higher"},
        "c": {"graph_speedup": graph, "device_speedup": device, "deviation": deviation,
              "met": abs(deviation) <= tolerance + 1e-12},
    }


def evaluate_targets(results: list[dict]) -> list[dict]:
    """One entry per row (shape, dtype, causal) in the order measured: its label and the three
    verdicts, or ``missing`` where evo or sdpa has no measurement on it."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["shape"], r["dtype"], r["causal"]), []).append(r)
    out = []
    for (shape, dtype, causal), rows in groups.items():
        entry: dict[str, Any] = {"row": row_label(shape, dtype, causal), "shape": shape, "dtype": dtype,
                                 "causal": causal}
        ours, sdpa = ({r["impl"]: r for r in rows if r.get("status") == "ok"}.get(k) for k in ("evo", "sdpa"))
        if ours is None or sdpa is None:
            entry["missing"] = "no evo measurement" if ours is None else "no sdpa measurement"
        else:
            entry.update(target_verdicts(ours, sdpa))
        out.append(entry)
    return out


def summarize_targets(entries: list[dict]) -> dict[str, dict]:
    """Per target: rows it applies to, rows that meet it, the labels of those that do not."""
    out = {}
    for key in "abc":
        rows = [e for e in entries if key in e and e[key]["met"] is not None]
        out[key] = {"rows": len(rows), "met": sum(1 for e in rows if e[key]["met"]),
                    "not_met": [e["row"] for e in rows if not e[key]["met"]]}
    out["b"]["equal"] = sum(1 for e in entries if "b" in e and e["b"]["verdict"] == "equal")
    out["missing"] = {"rows": len([e for e in entries if "missing" in e]),
                      "labels": [e["row"] for e in entries if "missing" in e]}
    return out


TARGET_NAMES = {
    "a": "eager ×sdpa >= 1 where device ×sdpa >= 1",
    "b": "overhead <= sdpa's, or equal within noise",
    "c": "graph ×sdpa within 5% of device ×sdpa",
}


def target_lines(entries: list[dict]) -> list[str]:
    """The summary as printed (plain text, at most 80 columns): a line per row with the figures
    and verdicts, then per target how many rows meet it and the rows that do not."""
    if not entries:
        return []
    mark = {True: "ok", False: "NO", None: "-"}
    width = max(len(e["row"]) for e in entries)  # the numbers right-aligned after it bring a space
    lines = ["targets, evo against sdpa (×: SDPA's time / ours)",
             "  a: eager ×sdpa >= 1 where device ×sdpa >= 1 (-: device < 1)",
             "  b: overhead µs, ours and sdpa's; noise: the sum of both eager and",
             "     device spreads; <, =, >: lower, equal within noise, higher",
             "  c: |graph ×sdpa / device ×sdpa - 1| <= 5%, from each side's graph over",
             "     the device samples taken beside it (×gr: the graph medians' ratio)",
             f"  {'row':<{width}}{'×dev':>5}{'×eag':>5}{'a':>3}{'ovh':>7}{'sdpa':>7}{'noise':>6}{'b':>2}"
             f"{'×gr':>5}{'c':>3}"]
    sign = {"lower": "<", "equal": "=", "higher": ">"}
    for e in entries:
        if "missing" in e:
            lines.append(f"  {e['row']:<{width}}{e['missing']}")
            continue
        a, b, c = e["a"], e["b"], e["c"]
        lines.append(f"  {e['row']:<{width}}{a['device_speedup']:>5.2f}{a['eager_speedup']:>5.2f}{mark[a['met']]:>3}"
                     f"{b['overhead_evo_us']:>7.1f}{b['overhead_sdpa_us']:>7.1f}{b['noise_us']:>6.1f}"
                     f"{sign[b['verdict']]:>2}{c['graph_speedup']:>5.2f}{mark[c['met']]:>3}")
    summary = summarize_targets(entries)
    for key in "abc":
        s = summary[key]
        extra = f" ({s['equal']} of them equal)" if key == "b" and s["equal"] else ""
        lines.append(f"({key}) {TARGET_NAMES[key]}: {s['met']} of {s['rows']} rows{extra}")
        for e in entries:
            if "missing" in e or e[key]["met"] is not False:
                continue
            t = e[key]
            if key == "a":
                detail = f"device {t['device_speedup']:.3f}, eager {t['eager_speedup']:.3f}"
            elif key == "b":
                detail = (f"{t['overhead_evo_us']:.1f} vs {t['overhead_sdpa_us']:.1f} µs, "
                          f"+{t['difference_us']:.1f} > noise {t['noise_us']:.1f}")
            else:
                detail = f"graph {t['graph_speedup']:.2f}, device {t['device_speedup']:.2f} ({t['deviation']:+.1%})"
            lines.append(f"    not met: {e['row']}: {detail}")
    if summary["missing"]["rows"]:
        n = summary["missing"]["rows"]
        lines.append(f"not evaluated: {n} row{'s' if n > 1 else ''} without an evo or sdpa measurement")
    return lines
