"""Render and compile configurations without a GPU: resources before any GPU time.

One configuration is compiled once per problem variant (head dim x causal) of the
space; its report aggregates them: the most registers and shared memory any
variant needs, the spills of all of them, the total compile time.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..space import Config, Variant
from .compile import DEFAULT_OPTIONS, CompileResult, compile_source
from .render import Rendered, RenderError, render


@dataclass(frozen=True)
class VariantBuild:
    variant: Variant
    rendered: Rendered | None
    compiled: CompileResult | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.compiled is not None and self.compiled.ok


@dataclass(frozen=True)
class StaticReport:
    """Everything known about a configuration before it runs."""

    config: Config
    arch: str
    builds: tuple[VariantBuild, ...] = field(default_factory=tuple)

    @property
    def status(self) -> str:
        return "compiled" if all(b.ok for b in self.builds) else "compile_failed"

    @property
    def error(self) -> str:
        for b in self.builds:
            if not b.ok:
                return f"{b.variant.label()}: {b.error or (b.compiled.error if b.compiled else 'not compiled')}"
        return ""

    @property
    def registers(self) -> int:
        return max((b.compiled.registers for b in self.builds if b.compiled), default=0)

    @property
    def smem(self) -> int:
        """Shared memory per block: dynamic (declared by the template) plus static."""
        return max(
            ((b.rendered.max_smem if b.rendered else 0) + (b.compiled.static_smem if b.compiled else 0) for b in self.builds),
            default=0,
        )

    @property
    def spill_bytes(self) -> int:
        return sum(b.compiled.spill_bytes for b in self.builds if b.compiled)

    @property
    def spilling(self) -> bool:
        return self.spill_bytes > 0

    @property
    def wgmma_serialized(self) -> bool:
        """ptxas made some variant's wgmma synchronous (nothing overlaps the tensor cores' work)."""
        return any(b.compiled.wgmma_serialized for b in self.builds if b.compiled)

    @property
    def compile_ms(self) -> float:
        return sum(b.compiled.compile_ms for b in self.builds if b.compiled and not b.compiled.cached)

    def build(self, variant: Variant) -> VariantBuild:
        for b in self.builds:
            if b.variant == variant:
                return b
        raise KeyError(variant)

    def to_json(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "key": self.config.key(),
            "arch": self.arch,
            "status": self.status,
            "error": self.error,
            "registers": self.registers,
            "smem": self.smem,
            "spill_bytes": self.spill_bytes,
            "spilling": self.spilling,
            "wgmma_serialized": self.wgmma_serialized,
            "compile_ms": round(self.compile_ms, 1),
        }


def build_config(
    template: str,
    config: Config,
    variants: Sequence[Variant],
    arch: str,
    smem_limit: int | None = None,
    options: Sequence[str] = DEFAULT_OPTIONS,
    templates: str | Path | None = None,
) -> StaticReport:
    """Render (from ``templates``, a directory, where given) and compile one configuration for
    every variant; failures are values."""
    builds = []
    for variant in variants:
        try:
            rendered = render(template, config, variant, templates)
        except RenderError as exc:
            builds.append(VariantBuild(variant, None, None, f"render failed: {exc}"))
            continue
        if smem_limit is not None and rendered.max_smem > smem_limit:
            builds.append(VariantBuild(variant, rendered, None, f"needs {rendered.max_smem} B of shared memory, limit {smem_limit} B"))
            continue
        compiled = compile_source(rendered.source, arch, options, name=f"{template}_{config.key()}.cu")
        builds.append(VariantBuild(variant, rendered, compiled, "" if compiled.ok else compiled.error))
    return StaticReport(config, arch, tuple(builds))


def build_config_job(args: tuple) -> StaticReport:
    """``build_config(*args)``: a picklable job for a process pool."""
    return build_config(*args)


def build_many(
    template: str,
    configs: Iterable[Config],
    variants: Sequence[Variant],
    arch: str,
    smem_limit: int | None = None,
    *,
    workers: int | None = None,
) -> Iterator[StaticReport]:
    """Build configurations in parallel processes (one per core); yields in input order."""
    jobs = [(template, c, tuple(variants), arch, smem_limit) for c in configs]
    workers = workers or max(1, os.cpu_count() or 1)
    if workers == 1 or len(jobs) <= 1:
        yield from map(build_config_job, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(build_config_job, jobs, chunksize=1)
