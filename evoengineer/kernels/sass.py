"""The machine code of kernels rendered from two revisions of the templates, compared.

A revision's ``templates/`` is written out by ``git archive`` (``revision_templates``); each
configuration is rendered from it and from the other side (another revision, or the working
tree's templates), both sources are compiled by NVRTC for one arch and disassembled by
``nvdisasm`` (the pip wheel ``nvidia-cuda-nvdisasm``), and their SASS is compared
(``compare``). A configuration renders on the older side as it did when every path carried every
parameter of its space (``flat``: the parameters its path does not use at their neutral values,
``evoengineer.paths.NEUTRAL``).

Each comparison ends as one verdict: ``identical`` (the same source, or the same SASS),
``refused`` (both sides refuse it alike), ``different`` (both compile, to other SASS: its
registers, shared memory and instruction counts on both sides say by how much) or ``broken``
(one side alone refuses it, the launches differ, or a compile fails).
"""
from __future__ import annotations

import collections
import io
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..space import Config, Variant
from .compile import CompileResult, compile_many
from .render import Rendered, RenderError, render

VERDICTS = ("identical", "refused", "different", "broken")
"""Every verdict of a comparison, in the order tables show them."""

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
"""One SASS instruction line of nvdisasm (``/*0040*/  @!P0 BRA ...``): its opcode."""


def nvdisasm() -> str | None:
    """The ``nvdisasm`` binary: on PATH, else the one of an ``nvidia-cuda-nvdisasm`` wheel (None: neither)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(c) for root in map(Path, nvidia.__path__) for c in sorted(root.glob("*/bin/nvdisasm"))), None)


def revision_templates(revision: str, into: Path, repo: Path) -> Path | None:
    """``revision``'s ``templates/`` of the git repository ``repo``, written under ``into``
    (by ``git archive``); the directory written, or None without git or that revision."""
    try:
        archived = subprocess.run(["git", "archive", "--format=tar", revision, "templates"], cwd=repo,
                                  capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if archived.returncode != 0 or not archived.stdout:
        return None
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archived.stdout)) as tar:
        tar.extractall(into, filter="data")
    written = into / "templates"
    return written if written.is_dir() else None


def flat(config: Config) -> Config:
    """``config`` with the parameters its path does not use at their neutral values: what a
    template of a revision before per-path spaces took."""
    return Config(config.canonical())


def render_or_refusal(config: Config, variant: Variant, directory: Path | None,
                      template: str = "flash_attention") -> Rendered | str:
    """The kernel ``directory``'s templates (None: the working tree's) render, or why they refuse it."""
    try:
        return render(template, config, variant, directory=directory)
    except RenderError as exc:
        return str(exc).split(": ", 1)[-1]


def body(source: str) -> str:
    """A rendered source without its first line (the ``// evoengineer:`` header naming the
    configuration's label, which a flat configuration spells longer)."""
    return source.split("\n", 1)[-1] if source.startswith("// evoengineer:") else source


def disassemble(cubin_path: str, tool: str) -> str:
    """``nvdisasm``'s SASS of a cubin, normalised (``normalise``)."""
    done = subprocess.run([tool, cubin_path], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm {cubin_path}: {done.stderr.strip()[:200]}")
    return normalise(done.stdout)


def normalise(sass: str) -> str:
    """SASS with trailing blanks and empty lines dropped (nothing else: names and order stay)."""
    return "\n".join(line.rstrip() for line in sass.splitlines() if line.strip())


def opcodes(sass: str) -> collections.Counter[str]:
    """How many instructions of each opcode (predicates left out) the SASS holds."""
    return collections.Counter(m.group(1) for m in _INSTRUCTION.finditer(sass))


@dataclass(frozen=True)
class Side:
    """One side's compiled kernel: max registers of its kernels, max shared memory (static plus
    the launch's dynamic) of a kernel, SASS instructions over all kernels."""

    registers: int
    smem: int
    instructions: int


@dataclass(frozen=True)
class Comparison:
    """One configuration at one variant, before and after."""

    config: Config
    variant: Variant
    verdict: str
    why: str = ""
    before: Side | None = None
    after: Side | None = None

    @property
    def label(self) -> str:
        return f"{self.config.short_label()} {self.variant.label()}"

    def delta(self, field: str) -> int | None:
        """``field`` of ``Side`` after minus before (None unless both compiled)."""
        if self.before is None or self.after is None:
            return None
        return getattr(self.after, field) - getattr(self.before, field)

    def to_json(self) -> dict:
        return {"path": self.config.get("PATH"), "short_label": self.config.short_label(), "variant": self.variant.label(),
                "config": self.config.label(), "verdict": self.verdict, "why": self.why,
                "before": self.before.__dict__ if self.before else None, "after": self.after.__dict__ if self.after else None}


def difference(old_sass: str, new_sass: str, old: Side, new: Side) -> str:
    """What differs between two kernels' SASS, in a line: registers, instructions, opcodes."""
    a, b = opcodes(old_sass), opcodes(new_sass)
    moved = {op: b[op] - a[op] for op in set(a) | set(b) if a[op] != b[op]}
    parts = [f"registers {old.registers} -> {new.registers}" if old.registers != new.registers else f"registers {new.registers}",
             f"shared memory {old.smem} -> {new.smem}" if old.smem != new.smem else f"shared memory {new.smem}",
             f"instructions {old.instructions} -> {new.instructions}"]
    if moved:
        parts.append("opcodes " + ", ".join(f"{op} {n:+d}" for op, n in sorted(moved.items())[:12]))
    else:
        parts.append("same opcodes, another order or other operands")
    return "; ".join(parts)


def _side(rendered: Rendered, compiled: CompileResult, sass: str) -> Side:
    smem = max((compiled.kernels[l.kernel].static_smem if l.kernel in compiled.kernels else 0) + l.smem
               for l in rendered.launches)
    return Side(compiled.registers, smem, sum(opcodes(sass).values()))


def compare(cases: Iterable[tuple[Config, Variant]], before: Path, after: Path | None, arch: str, tool: str, *,
            workers: int = 2, flat_before: bool = True, template: str = "flash_attention") -> list[Comparison]:
    """Each (configuration, variant) rendered from ``before``'s templates (its configuration
    ``flat`` unless told otherwise) and ``after``'s (None: the working tree's), compiled for
    ``arch`` by ``workers`` processes where the sources differ, and compared; in input order."""
    results: list[Comparison | None] = []
    pending: list[tuple[int, Config, Variant, Rendered, Rendered]] = []
    for index, (config, variant) in enumerate(cases):
        old = render_or_refusal(flat(config) if flat_before else config, variant, before, template)
        new = render_or_refusal(config, variant, after, template)
        if isinstance(old, str) or isinstance(new, str):
            if isinstance(old, str) and isinstance(new, str):
                results.append(Comparison(config, variant, "refused", f"before: {old}; after: {new}"))
            else:
                results.append(Comparison(config, variant, "broken", f"render: before {old if isinstance(old, str) else 'ok'}, "
                                                                     f"after {new if isinstance(new, str) else 'ok'}"))
            continue
        if (old.launches, old.tensor_maps, old.workspace_floats_per_row) != (new.launches, new.tensor_maps, new.workspace_floats_per_row):
            results.append(Comparison(config, variant, "broken", f"launch: before {old.launches} {old.tensor_maps}, "
                                                                 f"after {new.launches} {new.tensor_maps}"))
            continue
        if body(old.source) == body(new.source):
            results.append(Comparison(config, variant, "identical", "same source"))
            continue
        results.append(None)
        pending.append((index, config, variant, old, new))
    sources = list(dict.fromkeys(s for *_, old, new in pending for s in (old.source, new.source)))
    compiled = dict(zip(sources, compile_many(sources, arch, workers=workers)))
    sass: dict[str, str] = {}

    def disassembled(source: str) -> str:
        if source not in sass:
            sass[source] = disassemble(compiled[source].cubin_path or "", tool)
        return sass[source]

    for index, config, variant, old, new in pending:
        a, b = compiled[old.source], compiled[new.source]
        if not (a.ok and b.ok):
            results[index] = Comparison(config, variant, "broken", f"compile: before {a.error[:200] or 'ok'}; after {b.error[:200] or 'ok'}")
            continue
        old_sass, new_sass = disassembled(old.source), disassembled(new.source)
        old_side, new_side = _side(old, a, old_sass), _side(new, b, new_sass)
        if old_sass == new_sass:
            results[index] = Comparison(config, variant, "identical", "same SASS", old_side, new_side)
        else:
            results[index] = Comparison(config, variant, "different", difference(old_sass, new_sass, old_side, new_side),
                                        old_side, new_side)
    return [r for r in results if r is not None]


def variants_cycled(configs: Sequence[Config], variants: Sequence[Variant]) -> list[tuple[Config, Variant]]:
    """Each configuration with the variant of its index, cycling through ``variants``."""
    return [(config, variants[i % len(variants)]) for i, config in enumerate(configs)]


__all__ = ["Comparison", "Side", "VERDICTS", "body", "compare", "difference", "disassemble", "flat", "normalise",
           "nvdisasm", "opcodes", "render_or_refusal", "revision_templates", "variants_cycled"]
