"""Record a space exhaustively on a GPU, as a compact recording that strategies replay.

    python benchmarks/record.py run recordings/h100_mma_seed.yaml \\
        --out recordings/h100_mma_seed.jsonl --devices 0
    python benchmarks/record.py convert runs/rec-h100_mma_seed-gpu0 --out FILE.jsonl
    python benchmarks/record.py check recordings/h100_mma_seed.jsonl

``run`` is ``evoengineer search --strategy grid --trials <valid size>`` (every valid
configuration exactly once, in the space's order; no re-timing of finalists) in a run directory
of its own, then ``convert``. With ``--devices 0,1`` it starts one search per GPU on one shared
study (``--storage``/``--study``), so the GPUs split the configurations and never time one
twice. Killed, it resumes: run the same command again.

``convert`` reads the runs' ``results.jsonl`` and writes what ``ReplayEvaluator`` reads:
a header line (the space inline, GPU, driver, clocks, software versions, the command, the
dates, SDPA's fastest backend per case) and one line per configuration in enumeration order
with its status, a short reason, the objective (geometric mean of the per-case medians, µs)
and each case's median µs, rounded. A path ending in ``.gz`` is gzipped. It refuses to write
a recording that misses valid configurations unless ``--allow-missing`` is given.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from evoengineer.gpu import fastest_sdpa
from evoengineer.search import ReplayEvaluator
from evoengineer.space import Config, SpaceError, load_space

FORMAT = 1
REASON_CHARS = 160


class UsageError(Exception):
    """A mistake in the command line or the inputs: one line, exit code 2."""


# -- convert -----------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not JSON ({exc.msg})") from None


def _results(run: Path) -> Iterable[dict]:
    path = run / "results.jsonl"
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill


def _case_times(cases: list[dict]) -> dict[str, float]:
    out = {}
    for case in cases or []:
        timed = case.get("time") or {}
        if case.get("status") == "ok" and timed.get("median_us") is not None:
            out[case["label"]] = round(float(timed["median_us"]), 3)
    return out


def recording_rows(runs: list[Path]) -> tuple[dict, list[dict], dict]:
    """The header, the records (enumeration order) and a summary of the ``runs``."""
    if not runs:
        raise UsageError("give at least one run directory")
    spaces = []
    for run in runs:
        if not (run / "space.yaml").exists():
            raise UsageError(f"{run}: not a run directory (no space.yaml)")
        spaces.append((run / "space.yaml").read_text())
    if any(text != spaces[0] for text in spaces[1:]):
        raise UsageError(f"{runs[0]} and the other runs searched different spaces (space.yaml differs)")
    try:
        space = load_space(runs[0] / "space.yaml")
    except SpaceError as exc:
        raise UsageError(str(exc)) from None
    import yaml

    raw = yaml.safe_load(spaces[0])
    valid = list(space.valid_configs())
    valid_set = set(valid)

    found: dict[Config, dict] = {}
    duplicates = outside = 0
    for run in runs:
        for record in _results(run):
            config = Config(record["config"])
            if config not in valid_set:
                outside += 1
                continue
            if config in found:
                duplicates += 1
                if found[config]["status"] == "ok":
                    continue  # keep the first ok measurement
            found[config] = record

    rows = []
    for config in valid:
        record = found.get(config)
        if record is None:
            continue
        value = record.get("objective_us")
        ok = record["status"] == "ok" and value is not None
        rows.append({
            "config": config.to_dict(), "key": config.key(), "status": record["status"],
            "reason": (record.get("reason") or "")[:REASON_CHARS],
            "objective_us": round(float(value), 4) if ok else None,
            "cases": _case_times(record.get("cases") or []),
        })

    metas = [_read_json(run / "run.json") or {} for run in runs]
    env = _read_json(runs[0] / "env.json") or metas[0].get("gpu") or {}
    baseline = _read_json(runs[0] / "baseline.json") or {}
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    header = {
        "format": FORMAT,
        "space_inline": raw,
        "gpu": env.get("gpu"),
        "env": env,
        "command": None,
        "devices": None,
        "strategy": sorted({str(m.get("strategy")) for m in metas}),
        "started": min((m["started"] for m in metas if m.get("started")), default=None),
        "finished": max((m["finished"] for m in metas if m.get("finished")), default=None),
        "converted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": [run.name for run in runs],
        "valid_size": len(valid),
        "recorded": len(rows),
        "counts": counts,
        "sdpa_fastest_us": {label: {"backend": b, "us": round(us, 3)} for label, (b, us) in fastest_sdpa(baseline).items()},
    }
    summary = {"valid": len(valid), "recorded": len(rows), "missing": len(valid) - len(rows),
               "duplicates": duplicates, "outside_space": outside, "counts": counts}
    return header, rows, summary


def write_recording(path: Path, header: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"header": header}, sort_keys=True)] + [json.dumps(row, sort_keys=True) for row in rows]
    data = ("\n".join(lines) + "\n").encode()
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with gzip.GzipFile(tmp, "wb", mtime=0) as fh:
            fh.write(data)
    else:
        tmp.write_bytes(data)
    tmp.replace(path)


def convert(runs: list[Path], out: Path, allow_missing: bool = False, **extra: Any) -> dict:
    """Write the recording of ``runs`` to ``out``; ``extra`` goes into the header (command, devices)."""
    header, rows, summary = recording_rows(runs)
    header.update({k: v for k, v in extra.items() if v is not None})
    if summary["missing"] and not allow_missing:
        raise UsageError(f"{summary['missing']} of {summary['valid']} valid configurations are not in the runs' results; "
                         "run the recording again to resume it, or add --allow-missing")
    write_recording(out, header, rows)
    return summary


# -- check ------------------------------------------------------------------------------


def check(path: Path) -> dict:
    try:
        replay = ReplayEvaluator(path)
        space = replay.space()
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"{path}: {exc}") from None
    valid = list(space.valid_configs())
    recorded = sum(1 for c in valid if c in replay.records)
    ok = sorted(r.objective_us for r in replay.records.values() if r.ok)
    out: dict[str, Any] = {"recording": str(path), "space": space.name, "gpu": replay.header.get("gpu"),
                           "valid": len(valid), "recorded": recorded, "ok": len(ok)}
    if ok:
        best_config, best = replay.optimum()
        out.update(optimum_us=best, optimum=best_config.to_dict(), median_us=ok[len(ok) // 2],
                   within={f"{p}%": sum(v <= best * (1 + p / 100) for v in ok) for p in (1, 2, 5)})
    return out


# -- run --------------------------------------------------------------------------------


def run(space_path: str, out: Path, devices: list[int], root: Path, allow_missing: bool, replay: Path | None = None,
        replay_delay: float = 0.0) -> dict:
    """Time every valid configuration of the space, one search per device on a shared study, then convert."""
    try:
        space = load_space(space_path)
    except SpaceError as exc:
        raise UsageError(str(exc)) from None
    size = space.valid_size()
    base = root / f"rec-{space.name}"
    storage = f"sqlite:///{(base.with_name(base.name + '.db')).resolve()}"
    study = f"record-{space.name}"
    runs, procs = [], []
    root.mkdir(parents=True, exist_ok=True)
    for device in devices:
        run_dir = Path(f"{base}-gpu{device}")
        cmd = [sys.executable, "-m", "evoengineer", "search", "--space", space_path, "--strategy", "grid",
               "--trials", str(size), "--top-k", "1", "--retime-rounds", "0", "--device", str(device),
               "--run-dir", str(run_dir)]
        if len(devices) > 1:  # one shared study; progress bars of several searches would garble
            cmd += ["--storage", storage, "--study", study, "--quiet"]
        if replay is not None:
            cmd += ["--replay", str(replay), "--replay-delay", str(replay_delay)]
        if (run_dir / "run.json").exists():
            cmd.append("--resume")
        print("$", shlex.join(cmd), file=sys.stderr, flush=True)
        procs.append(subprocess.Popen(cmd, stdout=sys.stderr))  # stdout: only the summary
        runs.append(run_dir)
    codes = [p.wait() for p in procs]
    if any(code not in (0, 1) for code in codes):
        raise UsageError(f"a search exited with {codes}; run the same command again to resume")
    command = shlex.join(["python", *sys.argv])
    return convert(runs, out, allow_missing=allow_missing, command=command, devices=devices)


# -- the command line -------------------------------------------------------------------


def _devices(text: str) -> list[int]:
    try:
        devices = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices such as 0 or 0,1, got {text!r}") from None
    if not devices or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"expected distinct GPU indices such as 0 or 0,1, got {text!r}")
    return devices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="time every valid configuration of a space (GPU), then convert")
    p.add_argument("space", help="space YAML (benchmarks/spaces/*.yaml) or a built-in name")
    p.add_argument("--out", required=True, type=Path, help="recording to write (.jsonl or .jsonl.gz)")
    p.add_argument("--devices", type=_devices, default=[0], help="GPU indices, one search each on a shared study (default 0)")
    p.add_argument("--root", type=Path, default=Path("runs"), help="where the run directories go (default runs/)")
    p.add_argument("--allow-missing", action="store_true", help="write the recording even if configurations are missing")
    # answer from a recording (seconds per answer): tests the orchestration without a GPU
    p.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--replay-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p = sub.add_parser("convert", help="write a recording from the results of finished runs")
    p.add_argument("runs", nargs="+", type=Path, help="run directories of one space")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--allow-missing", action="store_true")
    p = sub.add_parser("check", help="summarise a recording: coverage, optimum, configurations near it")
    p.add_argument("recording", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            summary = run(args.space, args.out, args.devices, args.root, args.allow_missing, args.replay, args.replay_delay)
        elif args.command == "convert":
            summary = convert(args.runs, args.out, allow_missing=args.allow_missing)
        else:
            summary = check(args.recording)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    if args.command != "check":
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
