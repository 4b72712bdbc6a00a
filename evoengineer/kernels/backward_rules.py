"""The backward pass's configurations: the kept ones, launches and arguments.

A backward configuration is a ``Config`` of one of the backward's paths, ``mma`` or ``wgmma``, whose
parameters, validity and shared memory ``evoengineer.paths.mma_backward`` and ``wgmma_backward`` own
(``templates/flash_attention_bwd.cu.j2``, ``_attn_bwd_mma.cuh.j2`` and ``_attn_bwd_wgmma.cuh.j2``
honour them; the CPU tests check both agree). A configuration without PATH is an mma one. The forward
that feeds it is a forward with ``WRITE_LSE=1`` (``forward_lse_config``): an export's own wgmma
forward where it can write the LSE, else an mma one. Calls with a window, a soft cap or per-batch ranges
train through kernels built with those switches (``FEATURES``, which both paths hold: ``holds_features``)
and an LSE forward built with them too.
"""
from __future__ import annotations

import json
import math
from types import ModuleType
from typing import Sequence

from ..paths import mma_backward as rules
from ..paths import wgmma as wgmma_path
from ..paths import wgmma_backward
from ..runtime.backward_file import BackwardLaunchSpec as BackwardLaunch
from ..space import Config
from .render import Rendered, parameter_kinds

BACKWARD_TEMPLATE = rules.TEMPLATE
FORWARD_TEMPLATE = "flash_attention"
DQ_MODES = rules.DQ_MODES
HEAD_DIMS = rules.HEAD_DIMS
DKDV_LAYOUTS = rules.DKDV_LAYOUTS
FEATURES = rules.FEATURES
"""The features a backward can hold (seqlens, softcap, window): an export builds its feature kernels with all of them."""
TILES_WARPS = rules.TILES_WARPS
DEFAULTS: dict[str, int | str] = {"PATH": "mma", **rules.DEFAULTS}
"""What an mma backward configuration takes for a parameter it leaves out (and PATH: mma)."""
PATH_RULES: dict[str, ModuleType] = {"mma": rules, "wgmma": wgmma_backward}
"""Each backward path's rules module, by its PATH value."""
ROW_THREADS = 128
"""Threads of the per-row kernels (preprocess, dQ conversion): 16-byte chunks, one per thread."""


def backward_config(block_m: int, block_n: int, *, stages: int = 2, dq_mode: str = "atomic",
                    dq_block_m: int = 64, dq_block_n: int = 64, dkdv: str = "strips") -> Config:
    """A backward configuration with every parameter spelled out."""
    return Config(PATH="mma", DKDV=dkdv, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, DQ_MODE=dq_mode,
                  DQ_BLOCK_M=dq_block_m, DQ_BLOCK_N=dq_block_n)


def wgmma_config(block_m: int, block_n: int, *, stages: int = 2, producer: int = 0, load: str | None = None,
                 dq_mode: str = "atomic") -> Config:
    """A wgmma backward configuration with every parameter spelled out (64 keys per warpgroup); LOAD
    only where ``load`` is given (left out, the template's cpasync)."""
    return Config(PATH="wgmma", BLOCK_M=block_m, BLOCK_N=block_n, CONSUMER_WGS=block_n // 64, STAGES=stages,
                  DQ_MODE=dq_mode, PRODUCER=producer, **({"LOAD": load} if load is not None else {}))


def path_defaults(config: Config) -> dict[str, int | str]:
    """PATH and the parameters ``config``'s path takes where it leaves them out (mma without PATH)."""
    path = str(dict(config).get("PATH", "mma"))
    module = PATH_RULES.get(path)
    return {"PATH": path, **(module.DEFAULTS if module is not None else {})}


def _values(config: Config) -> dict[str, int | str]:
    return {**path_defaults(config), **dict(config)}


def warps(config: Config) -> int:
    """Warps of the dK/dV kernel: mma strips, one per 16 keys of its tile; mma tiles, 8; wgmma, 4 per warpgroup."""
    v = _values(config)
    return wgmma_backward.threads(v) // 32 if v["PATH"] == "wgmma" else rules.warps(v)


def problems(config: Config, head_dim: int) -> list[str]:
    """Why ``config`` cannot build for ``head_dim`` (one line each, the path's rule texts); empty when
    it can. Shared memory is not checked here (``fits``), nor the arch (wgmma: sm_90a, at the compile)."""
    v = _values(config)
    module = PATH_RULES.get(str(v["PATH"]))
    if module is None:
        return [f"PATH {v['PATH']!r}: the backward's paths are {', '.join(PATH_RULES)}"]
    missing = [name for name in module.PARAMS if v.get(name) is None]
    if missing:
        return [f"{name}: missing" for name in missing]
    unused = [name for name in v if name != "PATH" and name not in module.PARAMS]
    if unused:
        return [f"PATH {v['PATH']}: the {v['PATH']} path does not use {name}" for name in unused]
    scope = {**v, "HEAD_DIMS": (head_dim,), "MIN_HEAD_DIM": head_dim, "MAX_HEAD_DIM": head_dim, "SMEM_LIMIT": math.inf}
    out = []
    for rule in module.RULES:
        try:
            ok = rule(scope)
        except (TypeError, ValueError, ArithmeticError):
            ok = False
        if not ok:
            values = " ".join(f"{name} {v[name]}" for name in rule.needs) or f"HEAD_DIM {head_dim}"
            out.append(f"{values}: {rule.text}")
    return out


def smem_bytes(config: Config, head_dim: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel (bytes), as the template declares it."""
    v = _values(config)
    return PATH_RULES[str(v["PATH"])].kernel_smem(v, head_dim)


def fits(config: Config, head_dim: int, smem_per_block: int) -> bool:
    """Valid for ``head_dim`` and within a device's shared memory per block."""
    return not problems(config, head_dim) and max(smem_bytes(config, head_dim).values()) <= smem_per_block


def holds_features(config: Config) -> bool:
    """Its path's template holds every one of ``FEATURES`` (the mma and wgmma paths do)."""
    return set(FEATURES) <= set(PATH_RULES[str(_values(config)["PATH"])].FEATURES)


def deterministic(config: Config) -> bool:
    """Bit-identical results run to run: dQ is not summed by atomics."""
    return _values(config)["DQ_MODE"] == "separate"


BACKWARD_CONFIGS: dict[int, dict[str, Config]] = {
    64: {
        "m64n64": backward_config(64, 64),
        "m64n128": backward_config(64, 128),
        "m32n128": backward_config(32, 128),
        "m64n64-st1": backward_config(64, 64, stages=1),
        "m64n64-sep": backward_config(64, 64, dq_mode="separate"),
        "m64n128-sep": backward_config(64, 128, dq_mode="separate"),
        "t64n128": backward_config(64, 128, dkdv="tiles"),
        "t128n128": backward_config(128, 128, dkdv="tiles"),
    },
    128: {
        "m32n64": backward_config(32, 64),
        "m32n128": backward_config(32, 128),
        "m16n64": backward_config(16, 64),
        "m32n64-sep": backward_config(32, 64, dq_mode="separate"),
        "m32n128-sep": backward_config(32, 128, dq_mode="separate", dq_block_n=32),
        "t64n128": backward_config(64, 128, dkdv="tiles"),
        "t64n128-sep": backward_config(64, 128, dkdv="tiles", dq_mode="separate"),
    },
}
"""The configurations kept per head dim: each builds for sm_80 and sm_90 without spills (CPU tests), but
for the spill bytes ``SPILLS_ALLOWED`` names."""

SPILLS_ALLOWED: dict[tuple[int, str], int] = {
    (128, "t64n128"): 256,
    (128, "t64n128-sep"): 256,
    (64, "t128n128"): 512,
    (64, "t64n128"): 64,
}
"""(head dim, name) -> the most spill bytes (stores + loads, per ptxas, any variant and arch) the CPU
tests accept: ``tiles`` configurations at 255 registers whose spills are a few loop-invariant addresses
(D128 t64n128: 9 loads per 320 mma.sync of an iteration); on an H200 they were the fastest anyway."""


WGMMA_CONFIGS: dict[int, dict[str, Config]] = {
    64: {
        "w64n64-pr": wgmma_config(64, 64, producer=1),
        "w64n128": wgmma_config(64, 128),
        "w128n128-st1": wgmma_config(128, 128, stages=1),
        "w128n128-pr": wgmma_config(128, 128, producer=1),
        "w64n128-tma": wgmma_config(64, 128, producer=1, load="tma"),
        "w128n128-tma": wgmma_config(128, 128, producer=1, load="tma"),
        "w64n128-bulk": wgmma_config(64, 128, producer=1, load="tma", dq_mode="bulk"),
        "w128n128-bulk": wgmma_config(128, 128, producer=1, load="tma", dq_mode="bulk"),
    },
    128: {
        "w64n64-st1": wgmma_config(64, 64, stages=1),
        "w64n128-st1": wgmma_config(64, 128, stages=1),
        "w64n128-pr": wgmma_config(64, 128, producer=1),
        "w64n128-tma": wgmma_config(64, 128, producer=1, load="tma"),
        "w64n128-bulk": wgmma_config(64, 128, producer=1, load="tma", dq_mode="bulk"),
    },
}
"""Named configurations of the wgmma path per head dim (sm_90a only): each compiles for sm_90a without
spills in both dtypes, full and causal (CPU tests). ``default_config(hopper=True)`` takes D64 w128n128-bulk and
D128 w64n128-bulk, the fastest on an H100 (docs/performance.md, Training)."""


def default_config(head_dim: int, *, deterministic_dq: bool = False, hopper: bool = False) -> Config:
    """The backward configuration used when none is given: with ``hopper`` (an export for sm_90a)
    the wgmma path's (its dQ by bulk reductions: a deterministic call takes the mma path's), else the
    mma path's."""
    if head_dim not in BACKWARD_CONFIGS:
        raise ValueError(f"head_dim {head_dim}: the backward supports {', '.join(map(str, HEAD_DIMS))}")
    if deterministic_dq:
        return BACKWARD_CONFIGS[head_dim][{64: "m64n64-sep", 128: "t64n128-sep"}[head_dim]]
    if hopper:
        return WGMMA_CONFIGS[head_dim][{64: "w128n128-bulk", 128: "w64n128-bulk"}[head_dim]]
    return BACKWARD_CONFIGS[head_dim][{64: "t128n128", 128: "t64n128"}[head_dim]]


def forward_lse_config(head_dim: int, candidates: Sequence[Config] = ()) -> Config:
    """The forward that also writes the row log-sum-exp (``WRITE_LSE=1``) for a backward: the first
    of ``candidates`` (an export's forward configurations of the variant, best first) on the wgmma
    path that can write it (``paths.wgmma.writes_lse``), else an mma forward of 128 x 64 tiles and
    8 warps (no spills for D64 and D128 on sm_80 and sm_90)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the backward supports {', '.join(map(str, HEAD_DIMS))}")
    for config in candidates:
        if wgmma_path.writes_lse(config):
            return config.replace(WRITE_LSE=1)
    return Config(PATH="mma", BLOCK_M=128, BLOCK_N=64, WARPS=8, VEC=8, STAGES=2, SMEM_LAYOUT="swizzle",
                  Q_IN_REGS=1, P_IN_REGS=1, SPLITS=1, KV_GROUPS=1, WRITE_LSE=1)


def backward_launches(rendered: Rendered) -> list[BackwardLaunch]:
    """The launches a rendered backward declares (``// LAUNCH`` lines with ``"grid": "q"`` or ``"kv"``)."""
    out = []
    for line in rendered.source.splitlines():
        stripped = line.strip()
        if stripped.startswith("// LAUNCH "):
            meta = json.loads(stripped[len("// LAUNCH "):])
            over = meta.get("grid")
            if over not in ("q", "kv"):
                raise ValueError(f"backward launch {meta.get('kernel')!r}: 'grid' must be 'q' or 'kv', got {over!r}")
            out.append(BackwardLaunch(str(meta["kernel"]), tuple(meta["block"]), int(meta["smem"]),  # type: ignore[arg-type]
                                      int(meta["rows_per_cta"]), over))
    return out


def backward_launch_arguments(rendered: Rendered) -> list[tuple[str, str]]:
    """What a launcher packs for every kernel of a rendered backward: ``backward_arguments``, then one
    ``tmap`` per ``// TENSOR_MAP`` line (the dK/dV kernel's with LOAD tma; the other kernels take
    the arguments before them and read only those)."""
    return backward_arguments(rendered) + [(m.arg, "tmap") for m in rendered.tensor_maps]


def backward_arguments(rendered: Rendered) -> list[tuple[str, str]]:
    """(name, kind) of every backward kernel parameter, from the source's ``// BWD_ARGS`` line."""
    for line in rendered.source.splitlines():
        stripped = line.strip()
        if stripped.startswith("// BWD_ARGS "):
            return parameter_kinds(stripped[len("// BWD_ARGS "):])
    raise ValueError("the backward source declares no '// BWD_ARGS' line")
