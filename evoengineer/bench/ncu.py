"""Nsight Compute's per-instruction warp-stall samples (``ncu --page source --csv
--print-source sass``), summarized: instructions grouped by how often each was executed
(instructions run equally often belong to one level of the kernel's loops: the most executed
group is the K/V loop's body), then the opcodes with the most samples."""
from __future__ import annotations

import collections
import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of a profiled kernel with its warp-stall samples."""

    sass: str
    samples: int
    not_issued: int
    executed: int

    @property
    def opcode(self) -> str:
        """``HGMMA.64x128x16``, ``WARPGROUP.DEPBAR``, ``MUFU``: the mnemonic without its predicate,
        with the first modifier kept for the warpgroup, barrier and HGMMA instructions."""
        words = [w for w in self.sass.split() if not w.startswith("@")]
        parts = words[0].rstrip(",;").split(".") if words else ["?"]
        return ".".join(parts[:2]) if parts[0] in ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "DEPBAR") else parts[0]


def read_source_csv(text: str) -> dict[str, list[Instruction]]:
    """The kernels of ``ncu --page source --csv --print-source sass`` output, by name, in order."""
    kernels: dict[str, list[Instruction]] = {}
    for block in re.split(r'(?m)^"Kernel Name",', text)[1:]:
        head, _, rest = block.partition("\n")
        name = next(csv.reader([head]))[0]
        rows = csv.DictReader(io.StringIO(rest))
        kernels[name] = [Instruction(r["Source"].strip(), int(r[SAMPLES] or 0), int(r[NOT_ISSUED] or 0), int(r[EXECUTED] or 0))
                         for r in rows]
    return kernels


def by_execution_count(instructions: list[Instruction]) -> list[tuple[int, int, int]]:
    """(times executed, instructions, samples) per execution count, most samples first."""
    count: collections.Counter[int] = collections.Counter()
    samples: collections.Counter[int] = collections.Counter()
    for ins in instructions:
        count[ins.executed] += 1
        samples[ins.executed] += ins.samples
    return sorted(((e, count[e], samples[e]) for e in count), key=lambda x: (-x[2], -x[0]))


def by_opcode(instructions: list[Instruction]) -> list[tuple[str, int, int, int]]:
    """(opcode, samples, not-issued samples, times executed) per opcode, most samples first."""
    acc: dict[str, list[int]] = {}
    for ins in instructions:
        a = acc.setdefault(ins.opcode, [0, 0, 0])
        a[0] += ins.samples
        a[1] += ins.not_issued
        a[2] += ins.executed
    return sorted(((op, *a) for op, a in acc.items()), key=lambda x: -x[1])


def summarize(path: Path, kernel: str, rows: int) -> list[str]:
    """Lines of the summary of one CSV file's kernels whose name matches ``kernel``."""
    lines = []
    for name, instructions in read_source_csv(path.read_text()).items():
        if not re.search(kernel, name):
            continue
        total = sum(i.samples for i in instructions) or 1
        lines.append(f"{path.name}: {name[:60]}")
        lines.append(f"  {total} samples, {sum(i.not_issued for i in instructions)} not issued, "
                     f"{sum(i.executed for i in instructions)} warp instructions executed")
        lines.append(f"  {'executed':>10} {'instrs':>7} {'samples':>8} {'share':>6}")
        for executed, n, s in by_execution_count(instructions)[:rows]:
            lines.append(f"  {executed:>10} {n:>7} {s:>8} {100 * s / total:>5.1f}%")
        lines.append(f"  {'opcode':<20} {'samples':>8} {'share':>6} {'not iss.':>8} {'executed':>10}")
        for op, s, ni, executed in by_opcode(instructions)[:rows]:
            lines.append(f"  {op:<20} {s:>8} {100 * s / total:>5.1f}% {ni:>8} {executed:>10}")
    return lines
