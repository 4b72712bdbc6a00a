"""Kernel Tuner cache files as recordings: other people's exhaustive measurements, replayed.

A Kernel Tuner cache (``.json`` or ``.json.gz``) is one JSON object::

    {"device_name": "NVIDIA GeForce RTX 3090", "kernel_name": "cn_pnpoly", "problem_size": ...,
     "tune_params_keys": ["between_method", "block_size_x", ...],
     "tune_params": {"between_method": [0, 1, 2, 3], ...}, "objective": "time",
     "cache": {"0,32,1,0": {"between_method": 0, ..., "time": 43.55, "times": [...], ...}, ...}}

An entry's objective (``time`` unless ``objective`` names another key) is a number in
milliseconds, or the name of Kernel Tuner's error: ``CompilationFailedConfig``,
``RuntimeFailedConfig``, ``InvalidConfig``. ``convert`` turns it into a recording (our
statuses, ``objective_us`` in microseconds) whose header carries a recorded space
(``problem.kind: recorded``): the parameters with their values (integers ordered unless
named ``categorical``), and no constraints: the recording's configurations are the space.
A cache of an objective that is maximised (GFLOP/s) is refused: a recording minimises.
"""
from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..space import Config

ERRORS = {"CompilationFailedConfig": "compile_failed", "RuntimeFailedConfig": "launch_failed", "InvalidConfig": "invalid"}
"""Kernel Tuner's error markers and our statuses for them."""
MAXIMISED = ("gflops", "gflop/s", "gb/s", "tflops", "tflop/s", "throughput", "bandwidth")


class CacheError(ValueError):
    """A cache file that cannot be converted; ``str()`` is one line naming the file and key."""

    def __init__(self, path: str | Path, key: str, message: str) -> None:
        super().__init__(f"{path}: {key}: {message}" if key else f"{path}: {message}")


@dataclass(frozen=True)
class Converted:
    """A recording converted from a cache: its space (a YAML-able dict) and its records."""

    space: dict[str, Any]
    records: list[dict[str, Any]]
    header: dict[str, Any]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def write(self, recording: Path, space_path: Path | None = None) -> None:
        """The recording (gzip-compressed if ``recording`` ends in .gz) and, if asked, the space YAML."""
        lines = [json.dumps({"header": {**self.header, "space_inline": self.space}})]
        lines += [json.dumps(r, separators=(",", ":")) for r in self.records]
        text = "\n".join(lines) + "\n"
        recording.parent.mkdir(parents=True, exist_ok=True)
        if recording.suffix == ".gz":
            with recording.open("wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as fh:
                fh.write(text.encode())  # no name, no time: the same cache gives the same bytes
        else:
            recording.write_text(text)
        if space_path is not None:
            import yaml

            comment = (f"# Converted from a Kernel Tuner cache by `evoengineer import-cache` ({self.header['source']}).\n"
                       f"# Replay it: evoengineer search --space {space_path.name} --replay {recording.name}\n")
            space_path.write_text(comment + yaml.safe_dump(self.space, sort_keys=False, default_flow_style=None, width=100))


def read_cache(path: Path) -> dict[str, Any]:
    """The cache's JSON object (gzip-compressed or not)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CacheError(path, "", f"cannot read: {exc.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise CacheError(path, "", f"not a readable gzip file: {exc}") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheError(path, "", f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CacheError(path, "", "expected a JSON object (a Kernel Tuner cache file)")
    if "Results" in doc and "Metadata" in doc:
        raise CacheError(path, "", "a Kernel Tuning Toolkit (KTT) output file, not a Kernel Tuner cache")
    return doc


def convert(path: Path, *, name: str | None = None, categorical: Sequence[str] = ()) -> Converted:
    """The recording of Kernel Tuner cache ``path``; ``categorical``: parameters whose integers name choices."""
    doc = read_cache(path)
    for key in ("tune_params_keys", "tune_params", "cache"):
        if key not in doc:
            raise CacheError(path, key, "required key is missing (not a Kernel Tuner cache file?)")
    names, tune_params, cache = doc["tune_params_keys"], doc["tune_params"], doc["cache"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise CacheError(path, "tune_params_keys", "expected a non-empty list of parameter names")
    if not isinstance(tune_params, dict) or not isinstance(cache, dict):
        raise CacheError(path, "tune_params", "expected an object of parameter -> values (and cache an object)")
    objective = str(doc.get("objective") or "time")
    if objective.lower() in MAXIMISED:
        raise CacheError(path, "objective", f"{objective!r} is maximised; a recording minimises a time")
    unknown = sorted(set(categorical) - set(names))
    if unknown:
        raise CacheError(path, "tune_params_keys", f"no parameter {unknown[0]!r} to make categorical (it has {', '.join(names)})")
    params: dict[str, Any] = {}
    for n in names:
        values = tune_params.get(n)
        if not isinstance(values, list) or not values:
            raise CacheError(path, f"tune_params.{n}", "expected a non-empty list of values")
        values = [_value(v, path, f"tune_params.{n}") for v in values]
        if len(set(values)) != len(values):
            raise CacheError(path, f"tune_params.{n}", f"values repeat: {values!r}")
        if len({type(v) for v in values}) > 1:  # mixed: all as strings
            values = [str(v) for v in values]
        params[n] = {"values": values, "categorical": True} if n in categorical else values
    records = []
    for key, entry in cache.items():
        where = f"cache[{key!r}]"
        if not isinstance(entry, dict):
            raise CacheError(path, where, "expected an object")
        config = {}
        for n in names:
            if n not in entry:
                raise CacheError(path, f"{where}.{n}", "the entry lacks this parameter")
            value = _value(entry[n], path, f"{where}.{n}")
            allowed = params[n]["values"] if isinstance(params[n], dict) else params[n]
            if value not in allowed and str(value) in allowed:
                value = str(value)
            if value not in allowed:
                raise CacheError(path, f"{where}.{n}", f"{value!r} is not one of tune_params.{n}")
            config[n] = value
        records.append(_record(config, entry.get(objective), objective, path, where))
    if not any(r["status"] == "ok" for r in records):
        raise CacheError(path, "cache", "no entry with a measured objective")
    stem = path.name.split(".")[0]
    kernel = str(doc.get("kernel_name") or stem)
    device = str(doc.get("device_name") or "unknown device")
    space_name = name or _slug(f"{kernel}_{stem}")
    space = {
        "name": space_name,
        "description": f"{kernel} on {device}, recorded by Kernel Tuner (problem size {doc.get('problem_size')}); "
                       f"objective {objective} in microseconds",
        "target": {"name": device},
        "problem": {"kind": "recorded"},
        "params": params,
    }
    header = {"space": space_name, "gpu": device, "source": path.name, "kernel": kernel,
              "problem_size": doc.get("problem_size"), "objective": objective, "converted_by": "evoengineer import-cache"}
    return Converted(space, records, header)


def _value(raw: Any, path: Path, key: str) -> int | str | bool:
    """A parameter value as a space holds it: an integer, a string or a boolean (a float that is
    an integer becomes one; other floats become strings)."""
    if isinstance(raw, bool) or isinstance(raw, (int, str)):
        return raw
    if isinstance(raw, float):
        return int(raw) if raw.is_integer() else repr(raw)
    raise CacheError(path, key, f"expected a number or a string, got {raw!r}")


def _record(config: dict[str, Any], value: Any, objective: str, path: Path, where: str) -> dict[str, Any]:
    key = Config(config).key()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return {"config": config, "key": key, "status": "ok", "reason": "", "objective_us": round(float(value) * 1000.0, 4)}
    if isinstance(value, str) and value in ERRORS:
        return {"config": config, "key": key, "status": ERRORS[value], "reason": value, "objective_us": None}
    if value is None:
        raise CacheError(path, f"{where}.{objective}", "the entry has no objective")
    return {"config": config, "key": key, "status": "invalid", "reason": f"{objective}: {value!r}"[:200], "objective_us": None}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_").lower() or "recording"
