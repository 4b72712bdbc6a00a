"""Compile CUDA source with NVRTC, with or without a GPU.

NVRTC ships as a pip wheel and needs no GPU, so the same source that later runs
through CuPy is compiled here for a named arch (``sm_89``, ``sm_90``...) to a
cubin. ptxas' verbose report gives registers, shared memory, stack and spills
before any GPU time is spent. Results are cached on disk under a key that hashes
everything that changes the binary: source, options, arch and NVRTC version.

The templates include no CUDA headers (fp16 conversions and tensor-core
instructions are inline PTX), so no CUDA include directory is needed.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17", "-Xptxas=-v", "-DNDEBUG")

_ARCH_RE = re.compile(r"^sm_(\d{2,3})a?$")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one ``__global__`` function."""

    registers: int = 0
    static_smem: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class CompileResult:
    """Outcome of one compile; a failure is a value (``ok`` False, ``error`` set)."""

    ok: bool
    arch: str
    key: str
    kernels: dict[str, KernelResources] = field(default_factory=dict)
    cubin_path: str | None = None
    log: str = ""
    error: str = ""
    compile_ms: float = 0.0
    cached: bool = False

    @property
    def registers(self) -> int:
        return max((k.registers for k in self.kernels.values()), default=0)

    @property
    def static_smem(self) -> int:
        return max((k.static_smem for k in self.kernels.values()), default=0)

    @property
    def spill_bytes(self) -> int:
        return sum(k.spills for k in self.kernels.values())

    @property
    def wgmma_serialized(self) -> bool:
        """ptxas made the kernel's wgmma synchronous (its log's "Potential Performance Loss"):
        each waits for the one before, so nothing overlaps the tensor cores' work."""
        return "wgmma.mma_async instructions are serialized" in self.log

    @property
    def stack_bytes(self) -> int:
        return max((k.stack_bytes for k in self.kernels.values()), default=0)

    def cubin(self) -> bytes:
        if not self.cubin_path:
            raise ValueError("compile failed; no cubin")
        return Path(self.cubin_path).read_bytes()

    def to_json(self) -> dict:
        d = asdict(self)
        d["registers"] = self.registers
        d["spill_bytes"] = self.spill_bytes
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CompileResult":
        kernels = {name: KernelResources(**k) for name, k in d.get("kernels", {}).items()}
        fields = {k: d[k] for k in ("ok", "arch", "key", "cubin_path", "log", "error", "compile_ms", "cached") if k in d}
        return cls(kernels=kernels, **fields)


def normalize_arch(arch: str | int) -> str:
    """``'sm_90'``, ``'90'``, ``90``, ``'compute_90'`` -> ``'sm_90'``."""
    text = str(arch).strip().lower().replace("compute_", "sm_")
    if text.isdigit():
        text = f"sm_{text}"
    if not _ARCH_RE.match(text):
        raise ValueError(f"not a CUDA arch: {arch!r} (expected e.g. sm_89 or sm_90)")
    return text


def arch_for_device(device_arch: str, target_arch: str) -> str:
    """The arch to compile for on a device: the target's arch-specific variant where the device
    is that chip (``sm_90a`` on an ``sm_90`` GPU, for wgmma and setmaxnreg), else the device's own."""
    device, target = normalize_arch(device_arch), normalize_arch(target_arch)
    return target if target.rstrip("a") == device.rstrip("a") else device


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())  # type: ignore[return-value]


def cache_dir() -> Path:
    root = os.environ.get("EVOENGINEER_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "evoengineer"
    path = base / "cubin"
    path.mkdir(parents=True, exist_ok=True)
    return path


CACHE_FORMAT = "2"


def compile_key(source: str, arch: str, options: Sequence[str] = DEFAULT_OPTIONS) -> str:
    h = hashlib.sha256()
    # CACHE_FORMAT changes when what a cache entry holds changes (2: complete ELF images).
    for part in (source, normalize_arch(arch), "\0".join(options), ".".join(map(str, nvrtc_version())), CACHE_FORMAT):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per-kernel resources from ptxas ``-v`` output."""
    found: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            current = m.group(1) or m.group(2)
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        entry = found[current]
        if m := _STACK_RE.search(line):
            entry["stack_bytes"], entry["spill_stores"], entry["spill_loads"] = map(int, m.groups())
        if m := _REGS_RE.search(line):
            entry["registers"] = int(m.group(1))
            if s := _SMEM_RE.search(line):
                entry["static_smem"] = int(s.group(1))
    return {name: KernelResources(**vals) for name, vals in found.items()}


def complete_elf(image: bytes) -> bytes:
    """``image`` zero-padded to the length its ELF64 header declares.

    CuPy's ``getCUBIN`` drops the image's last byte (it strips a trailing NUL as for PTX);
    the driver loads the short image, but ``cuobjdump`` and ``nvdisasm`` reject it.
    """
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2:
        return image
    ph_off, sh_off = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_num, sh_size, sh_num = struct.unpack_from("<HHHH", image, 0x36)
    declared = max(ph_off + ph_size * ph_num, sh_off + sh_size * sh_num)
    return image + b"\0" * (declared - len(image)) if declared > len(image) else image


def compile_source(
    source: str,
    arch: str,
    options: Sequence[str] = DEFAULT_OPTIONS,
    *,
    name: str = "kernel.cu",
    use_cache: bool = True,
) -> CompileResult:
    """Compile ``source`` for ``arch`` to a cubin; never raises for a bad kernel."""
    arch = normalize_arch(arch)
    key = compile_key(source, arch, options)
    directory = cache_dir()
    meta_path, cubin_path = directory / f"{key}.json", directory / f"{key}.cubin"
    if use_cache and meta_path.exists():
        try:
            result = CompileResult.from_json(json.loads(meta_path.read_text()))
            if not result.ok or (result.cubin_path and Path(result.cubin_path).exists()):
                return CompileResult(**{**result.__dict__, "cached": True})
        except (ValueError, TypeError, KeyError):
            pass  # a damaged cache entry is recompiled

    from cupy.cuda import nvrtc

    start = time.perf_counter()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
            ok, error = True, ""
        except nvrtc.NVRTCError as exc:
            ok, error = False, str(exc)
        log = nvrtc.getProgramLog(prog)
        cubin = complete_elf(nvrtc.getCUBIN(prog)) if ok else b""
    finally:
        nvrtc.destroyProgram(prog)
    elapsed = (time.perf_counter() - start) * 1e3

    if ok:
        tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(cubin_path)
    else:
        error = _first_error(log) or error
    result = CompileResult(
        ok=ok,
        arch=arch,
        key=key,
        kernels=parse_ptxas_log(log) if ok else {},
        cubin_path=str(cubin_path) if ok else None,
        log=log,
        error=error,
        compile_ms=elapsed,
    )
    if use_cache:
        tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_json()))
        tmp.replace(meta_path)
    return result


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()
    return ""


def _compile_job(job: tuple[str, str, tuple[str, ...]]) -> CompileResult:
    source, arch, options = job
    return compile_source(source, arch, options)


def compile_many(
    sources: Iterable[str],
    arch: str,
    options: Sequence[str] = DEFAULT_OPTIONS,
    *,
    workers: int | None = None,
) -> Iterator[CompileResult]:
    """Compile in parallel processes; yields results in input order."""
    jobs = [(src, arch, tuple(options)) for src in sources]
    workers = workers or max(1, os.cpu_count() or 1)
    if workers == 1 or len(jobs) <= 1:
        yield from map(_compile_job, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(_compile_job, jobs)
