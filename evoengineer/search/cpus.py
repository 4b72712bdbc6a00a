"""Which CPUs a search's compile processes may use.

The GPU workers and the search's own threads (the loop, the lanes, the proposer) do little
work, but a GPU waits whenever they wait for a core. Compiles at a lower priority do not
stop that on a core shared through hyper-threading (its sibling runs the compile at full
speed) nor while the scheduler moves a woken worker. So on a host with cores to spare the
compile processes keep off the first physical cores: one per GPU index up to the highest of
the search's, one for the search's own threads. The workers and the search are not pinned
to them (one CPU for a worker's and the CUDA driver's threads made its evaluations slower).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

SYSFS = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers of a kernel CPU list such as ``0,32`` or ``0-3,8-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _sysfs_siblings(cpu: int) -> set[int]:
    try:
        return parse_cpu_list((SYSFS / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
    except (OSError, ValueError):
        return {cpu}


def physical_cores(cpus: Iterable[int], siblings: Callable[[int], set[int]] = _sysfs_siblings) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (hyper-thread siblings together), in CPU order."""
    allowed = set(cpus)
    cores: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        cores[tuple(sorted((siblings(cpu) & allowed) | {cpu}))] = None
    return sorted(cores, key=min)


def keeping() -> bool:
    """Whether searches keep cores for their workers (``EVOENGINEER_KEEP_CORES=0``: not)."""
    return os.environ.get("EVOENGINEER_KEEP_CORES") != "0"


def cores_to_keep(devices: Sequence[int]) -> int:
    """How many physical cores a search on ``devices`` keeps: ``EVOENGINEER_KEEP_CORES`` where
    it is a number, else one per GPU index up to the highest and one more."""
    value = os.environ.get("EVOENGINEER_KEEP_CORES", "").strip()
    return int(value) if value.isdigit() else max(devices, default=0) + 2


def kept_cores(devices: Sequence[int], cpus: Iterable[int] | None = None,
               siblings: Callable[[int], set[int]] = _sysfs_siblings) -> list[tuple[int, ...]]:
    """The physical cores a search on ``devices`` (GPU indices) keeps free of compiles: the
    first ``cores_to_keep(devices)`` of ``cpus`` (default: those this process may run on); none
    where fewer than twice as many cores are there, or ``keeping()`` is off."""
    allowed = set(os.sched_getaffinity(0) if cpus is None else cpus)
    cores = physical_cores(allowed, siblings)
    kept = cores_to_keep(devices)
    return cores[:kept] if keeping() and kept and len(cores) >= 2 * kept else []


def compile_cpus(devices: Sequence[int], cpus: Iterable[int] | None = None,
                 siblings: Callable[[int], set[int]] = _sysfs_siblings) -> set[int]:
    """The CPUs for the compile processes of a search on ``devices``: all of ``cpus`` but the
    kept cores."""
    allowed = set(os.sched_getaffinity(0) if cpus is None else cpus)
    return allowed - {cpu for core in kept_cores(devices, allowed, siblings) for cpu in core}


def compile_plan(devices: Sequence[int], cpus: Iterable[int] | None = None) -> tuple[set[int] | None, int]:
    """Where a search's compile processes run and how many by default: (``compile_cpus``, one per
    CPU there) where cores are kept, else (None: anywhere, one per CPU but one)."""
    allowed = set(os.sched_getaffinity(0) if cpus is None else cpus)
    mine = compile_cpus(devices, allowed)
    return (mine, len(mine)) if mine != allowed else (None, max(1, len(allowed) - 1))


def restrict_to(cpus: set[int] | None) -> None:
    """This process onto ``cpus`` (nothing where None or not permitted)."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, AttributeError):
            pass
