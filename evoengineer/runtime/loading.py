"""Kernel loading: each kernel's CUDA source compiled by NVRTC (``cupy.RawModule``) for the GPU
present, at its first use on a device, once per process."""
from __future__ import annotations

import threading
from typing import Any

from .kernel_file import ExportData

DEFAULT_SMEM_LIMIT = 48 * 1024
"""Dynamic shared memory a kernel gets without opting in."""

Functions = tuple[tuple[Any, int], ...]
"""Per launch of a kernel: (cupy.RawKernel, its CUfunction handle)."""


def import_cupy() -> Any:
    """cupy, or a RuntimeError saying how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"attention: needs cupy (pip install cupy-cuda13x, or cupy-cuda12x on a CUDA 12 "
                           f"driver): {exc}") from None
    return cupy


def resident_ctas(handle: int, threads: int, smem: int) -> int:
    """CTAs of a kernel (its CUfunction ``handle``) that one multiprocessor holds at once, in blocks
    of ``threads`` with ``smem`` bytes of dynamic shared memory: the driver's occupancy calculator
    (registers, shared memory, threads), with the kernel's device current; at least 1. Times the
    multiprocessors, the CTAs of one wave (``grid.decode_splits``' ``slots``)."""
    cupy = import_cupy()
    return max(1, int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(handle, threads, smem)))


def required_arch(source: str) -> str | None:
    """``sm_90a`` where the kernel declares ``// REQUIRES_ARCH sm_90a``, else None."""
    for line in source.splitlines():
        if line.startswith("// REQUIRES_ARCH "):
            parts = line.split()
            return parts[2] if len(parts) > 2 else None
    return None


def compile_options(source: str) -> tuple[str, ...]:
    """NVRTC options of a kernel: C++17, and the arch-specific target it declares (wgmma: that chip only)."""
    required = required_arch(source)
    return ("--std=c++17", *((f"-arch={required}",) if required else ()))


def describe(data: ExportData, spec: Any) -> str:
    """``mma 128x64 w4 (3f2a1b) fp16 D64 causal``: a kernel (forward, LSE forward or backward) as errors name it."""
    info = data.configs.get(spec.config) or (data.backward.configs.get(spec.config) if data.backward else None)
    short = info.short if info is not None else "kernel"
    return f"{short} ({spec.config[:6]}) {spec.dtype} D{spec.head_dim}{' causal' if spec.causal else ''}"


def build(data: ExportData, spec: Any, device: int) -> tuple[Any, Functions]:
    """Compile ``spec`` (a forward ``KernelSpec`` or a ``BackwardKernelSpec``: a source and its
    launches) for ``device`` and load its launches' functions; RuntimeError in one line
    naming the kernel and the GPU where the GPU cannot run it or NVRTC refuses it."""
    cupy = import_cupy()
    what = describe(data, spec)
    with cupy.cuda.Device(device):
        props = cupy.cuda.runtime.getDeviceProperties(device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        arch = f"sm_{props['major']}{props['minor']}"
        gpu = f"cuda:{device} ({name}, {arch})"
        limit = props.get("sharedMemPerBlockOptin", 0) or DEFAULT_SMEM_LIMIT
        need = max(launch.smem for launch in spec.launches)
        if need > limit:
            raise RuntimeError(f"attention: kernel {what} needs {need} bytes of shared memory per block; {gpu} allows "
                               f"{limit}: this export cannot run on this GPU")
        required = required_arch(spec.source)
        if required and arch != required.rstrip("a"):
            raise RuntimeError(f"attention: kernel {what} uses {required}-only instructions; {gpu} cannot run it")
        try:
            module = cupy.RawModule(code=spec.source, options=compile_options(spec.source))
            functions = []
            for launch in spec.launches:
                fn = module.get_function(launch.kernel)  # a cupy.RawKernel; .kernel compiles for this device
                if launch.smem > DEFAULT_SMEM_LIMIT:
                    fn.max_dynamic_shared_size_bytes = launch.smem
                functions.append((fn, int(fn.kernel.ptr)))
        except Exception as exc:  # noqa: BLE001 - one line naming the kernel and the GPU
            text = str(exc).strip()
            first = next((line.strip() for line in text.splitlines() if "error" in line.lower()),
                         text.splitlines()[0] if text else type(exc).__name__)
            raise RuntimeError(f"attention: cannot build kernel {what} for {gpu}: {first}") from None
    return module, tuple(functions)


class KernelCache:
    """Built kernels by (kernel key, device), each built once even when threads race for it."""

    def __init__(self, data: ExportData) -> None:
        self._data = data
        self._built: dict[tuple[str, int], tuple[Any, Functions]] = {}
        self._lock = threading.Lock()

    def functions(self, key: tuple[str, int, bool, str], device: int, spec: Any = None) -> Functions:
        """The loaded functions of the forward kernel ``key``, or of ``spec`` (an LSE forward or a
        backward kernel of the export), on ``device``."""
        spec = self._data.kernels[key] if spec is None else spec
        slot = (spec.source_file, device)   # each kernel of an export has a source file of its own
        found = self._built.get(slot)
        if found is None:
            with self._lock:
                found = self._built.get(slot)
                if found is None:
                    found = self._built[slot] = build(self._data, spec, device)
        return found[1]

    def compile_all(self, device: int) -> int:
        """Build every kernel of the export on ``device`` (the LSE forwards and backward kernels
        too); the number of kernels."""
        specs = list(self._data.kernels.values())
        if self._data.backward is not None:
            specs += [*self._data.backward.forward_kernels.values(), *self._data.backward.kernels.values()]
        for spec in specs:
            self.functions(spec.key, device, spec)
        return len(specs)
