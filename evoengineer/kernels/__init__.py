"""One configuration to a kernel binary, without a GPU.

``render`` turns a ``Config`` and a ``Variant`` into CUDA source plus its launches,
``compile_source`` compiles it with NVRTC for a named arch (registers, shared memory,
spills, a disk cache), and ``build_config``/``build_many`` do both for every variant.
"""
from __future__ import annotations

from .compile import (
    DEFAULT_OPTIONS,
    CompileResult,
    KernelResources,
    arch_for_device,
    compile_many,
    compile_source,
    normalize_arch,
    nvrtc_version,
)
from .render import KERNEL_ARGS, Launch, Rendered, RenderError, TensorMapArg, from_source, render
from .static import StaticReport, VariantBuild, build_config, build_config_job, build_many

__all__ = [
    "DEFAULT_OPTIONS", "KERNEL_ARGS", "CompileResult", "KernelResources", "arch_for_device", "Launch", "RenderError", "Rendered",
    "StaticReport", "TensorMapArg", "VariantBuild", "build_config", "build_config_job", "build_many", "compile_many",
    "compile_source", "from_source", "normalize_arch", "nvrtc_version", "render",
]
