"""Render a configuration to CUDA source plus its launch geometry.

A template declares its own launches in comment lines of the rendered source::

    // LAUNCH {"kernel": "attn_fwd", "block": [128, 1, 1], "smem": 24576, "rows_per_cta": 64, "grid_z": 1}
    // WORKSPACE_FLOATS_PER_ROW 0
    // TENSOR_MAP {"arg": "tm_k", "tensor": "k", "box": [64, 128], "swizzle": 128}

Each launch runs over ``grid = (ceil(S_q / rows_per_cta), B * H, grid_z)``, or, with
``"persistent": true``, over one CTA per multiprocessor at most (``(min(tiles, SMs), 1, 1)``,
the kernel walks the ``ceil(S_q / rows_per_cta) * B * H`` work tiles itself), or, with
``"tile_counter": true`` (a persistent kernel whose CTAs take work tiles from a counter),
with ``WS`` pointing to a 32-bit counter the launcher zeroes before every call (with
``"split_tail": {"counter_words_per_cta": c, "floats_per_cta": f}``, where the work tiles
outnumber the CTAs, to ``1 + CTAs * c`` zeroed words followed, from the next 16-byte boundary,
by ``CTAs * f`` floats: the counters and partial results of tiles cut over several CTAs); with
``"pack_gqa": true``, over ``(ceil(S_q * H / H_kv / rows_per_cta), B * H_kv, grid_z)`` (the
rows of a CTA are the query heads that share a K/V head, position by position); with
``"auto_split": {"block_n": n, "kv_groups": g}``, over the call's K/V split count in z
(``runtime.grid.call_splits``, passed as the argument ``int kv_splits`` too) instead of grid_z,
and a launch with ``"split_combine": true`` runs only where that count is above 1, the
workspace then ``// WORKSPACE_FLOATS_PER_SPLIT_ROW`` floats per row and split on top of
``// WORKSPACE_FLOATS_PER_ROW``'s (``int kv_splits`` follows the features' arguments). Launches
run in order with the same arguments (a split-K/V kernel followed by its combine
step, say). Every kernel takes the same argument list, see ``KERNEL_ARGS``, followed by
one ``const __grid_constant__ CUtensorMap`` per ``// TENSOR_MAP`` line, in their order
(kernels that load by TMA): a 4-D map over the named tensor (``q``, ``k``, ``v``, ``out`` or,
in the backward, ``do``) as (head_dim, seq, heads, batch) with its strides, copied in boxes of
``box`` = (columns, rows), shared memory swizzled as ``swizzle`` bytes (0, 32, 64, 128).
A backward's dK/dV kernel takes its maps after the backward's argument list (``// BWD_ARGS``).

Templates see the configuration's parameters plus ``HEAD_DIM``, ``CAUSAL`` and ``DTYPE``
(``'fp16'`` or ``'bf16'``: the element type of Q, K, V and O, a compile-time choice) and, for a
path of ``evoengineer.paths``, what its rules derive: ``PATH_SMEM_BYTES`` (the main kernel's
dynamic shared memory at HEAD_DIM), ``PATH_THREADS``, ``PATH_ROWS_PER_CTA`` and the path's own
``template_values`` (``PATH_<NAME>``), so that a template restates none of its path's formulas.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2

from .. import paths
from ..resources import template_names, templates_dir
from ..runtime.grid import workspace_floats
from ..runtime.kernel_file import LaunchSpec, auto_split_json
from ..space import Config, Variant

KERNEL_ARGS = (
    "const half_t* Q, const half_t* K, const half_t* V, half_t* O, float* WS, "
    "int B, int H, int H_kv, int S_q, int S_k, "
    "long long q_sb, long long q_sh, long long q_ss, "
    "long long k_sb, long long k_sh, long long k_ss, "
    "long long v_sb, long long v_sh, long long v_ss, "
    "long long o_sb, long long o_sh, long long o_ss, float scale_log2"
)
"""The argument list every attention kernel takes. ``half_t`` is the 16-bit element (fp16 or
bf16 bits, per the variant's dtype). ``H`` counts query heads, ``H_kv`` K/V heads (it divides
``H``; grouped-query attention reads K/V head ``h / (H / H_kv)`` for query head ``h``). Strides
are in elements; the last dimension is contiguous. ``scale_log2`` is the softmax scale times
log2(e)."""
FEATURE_ARGS = {
    "seqlens": [("seqlens_k", "ptr"), ("leftpad_k", "ptr"), ("seqlens_q", "ptr")],
    "softcap": [("softcap", "f32")],
    "varlen": [("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")],
    "window": [("window_left", "i32"), ("window_right", "i32")],
}
"""Arguments a kernel with a compile-time feature takes after ``KERNEL_ARGS`` (per feature, in
sorted feature order): per-batch key ranges and query lengths (int32 pointers, null: none), the
soft cap, packed sequences' offsets (int32 pointers, batch + 1 each; null: the dense layout), the
window's sides (``runtime.features``)."""
SPLIT_ARGS = [("kv_splits", "i32")]
"""What a kernel whose K/V split count is chosen per call (an ``auto_split`` launch) takes after
its features' arguments: that count (``runtime.grid.call_splits``)."""


Launch = LaunchSpec
"""One launch of a rendered kernel, as its ``// LAUNCH`` line declares it: the runtime's
``kernel_file.LaunchSpec`` (grid, workspace words, threads), one class for both."""


TENSOR_MAP_PARAM = "const __grid_constant__ CUtensorMap"
"""The C type of a tensor-map kernel parameter (a 128-byte struct passed by value)."""


def parameter_kinds(params: str) -> list[tuple[str, str]]:
    """A kernel's parameter list (``const half_t* Q, int B, ...``) as (name, kind), kind one of
    ``ptr``, ``i32``, ``i64``, ``f32`` and ``tmap`` (a tensor map): what a launcher packs, by
    name. ValueError for a parameter of another type."""
    out = []
    for part in (p.strip() for p in params.split(",")):
        m = re.fullmatch(r"(.*?)\s*\b([A-Za-z_]\w*)", part)
        if m is None:
            raise ValueError(f"cannot read parameter {part!r}")
        ctype, name = " ".join(m.group(1).split()), m.group(2)
        if "*" in ctype:
            kind = "ptr"
        elif ctype in ("int", "const int", "int32_t"):
            kind = "i32"
        elif ctype in ("long long", "const long long", "int64_t"):
            kind = "i64"
        elif ctype in ("float", "const float"):
            kind = "f32"
        elif ctype == TENSOR_MAP_PARAM:
            kind = "tmap"
        else:
            raise ValueError(f"parameter {part!r} has a type a launcher cannot pack")
        out.append((name, kind))
    return out


TENSOR_MAP_TENSORS = ("q", "k", "v", "out", "do")
"""Tensors a map may name: the forward's q, k, v, out; the backward's output gradient (do)."""
TENSOR_MAP_SWIZZLES = (0, 32, 64, 128)


@dataclass(frozen=True)
class TensorMapArg:
    """A ``const __grid_constant__ CUtensorMap`` kernel argument: which tensor it maps and how."""

    arg: str
    tensor: str
    box: tuple[int, int]
    swizzle: int = 128

    def to_json(self) -> dict:
        return {"arg": self.arg, "tensor": self.tensor, "box": list(self.box), "swizzle": self.swizzle}


@dataclass(frozen=True)
class Rendered:
    config: Config
    variant: Variant
    template: str
    source: str
    launches: tuple[Launch, ...]
    workspace_floats_per_row: int = 0
    tensor_maps: tuple[TensorMapArg, ...] = ()
    workspace_floats_per_split: int = 0
    """Floats per row and K/V split of a kernel whose split count is chosen per call (above 1)."""

    @cached_property
    def arguments(self) -> list[tuple[str, str]]:
        """(name, kind) of every kernel parameter: ``KERNEL_ARGS``, the arguments of its features
        (``FEATURE_ARGS``, in the order of ``runtime.features.SWITCHES``), the split count of a
        kernel that chooses it per call (``SPLIT_ARGS``), then one ``tmap`` per tensor map.
        Read once (a launcher reads it per launch)."""
        return (parameter_kinds(KERNEL_ARGS) + [a for name in self.features for a in FEATURE_ARGS[name]]
                + (SPLIT_ARGS if self.auto_split else []) + [(m.arg, "tmap") for m in self.tensor_maps])

    @cached_property
    def features(self) -> tuple[str, ...]:
        """The compile-time features its ``// FEATURES`` line declares that add arguments (sorted).
        Read once (a launcher reads it per launch)."""
        declared = {word for line in self.source.splitlines() if line.startswith("// FEATURES ")
                    for word in line.split()[2:]}
        return tuple(sorted(declared & set(FEATURE_ARGS)))

    @property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def max_smem(self) -> int:
        return max(launch.smem for launch in self.launches)

    @property
    def tile_counter(self) -> bool:
        """A launch takes its work tiles from a counter: WS points to 32 zeroed bits per call."""
        return any(launch.tile_counter for launch in self.launches)

    @property
    def auto_split(self) -> bool:
        """Its K/V split count is chosen per call (``runtime.grid.call_splits``)."""
        return any(launch.auto_split is not None for launch in self.launches)

    def workspace_floats(self, batch: int, heads: int, seq_q: int, splits: int = 1) -> int:
        """Floats of its workspace for a call with ``splits`` K/V splits (``runtime.grid.workspace_floats``)."""
        return workspace_floats(self.workspace_floats_per_row, self.workspace_floats_per_split, batch, heads, seq_q,
                                splits)

    def launch_metadata(self) -> dict:
        return {
            "template": self.template,
            "config": self.config.to_dict(),
            "variant": {"head_dim": self.variant.head_dim, "causal": self.variant.causal, "dtype": self.variant.dtype},
            "launches": [
                {"kernel": l.kernel, "block": list(l.block), "smem": l.smem, "rows_per_cta": l.rows_per_cta, "grid_z": l.grid_z,
                 **({"persistent": True} if l.persistent else {}), **({"pack_gqa": True} if l.pack_gqa else {}),
                 **({"tile_counter": True} if l.tile_counter else {}),
                 **({"split_tail": {"counter_words_per_cta": l.split_tail[0], "floats_per_cta": l.split_tail[1]}}
                    if l.split_tail else {}), **auto_split_json(l)}
                for l in self.launches
            ],
            "workspace_floats_per_row": self.workspace_floats_per_row,
            **({"workspace_floats_per_split": self.workspace_floats_per_split} if self.workspace_floats_per_split else {}),
            "kernel_args": KERNEL_ARGS + "".join(f", {TENSOR_MAP_PARAM} {m.arg}" for m in self.tensor_maps),
            "tensor_maps": [m.to_json() for m in self.tensor_maps],
        }


class RenderError(ValueError):
    """The template rejected the configuration or declared no launch."""


@lru_cache(maxsize=4)
def _environment(directory: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, config: Config, variant: Variant, directory: str | Path | None = None) -> Rendered:
    """Render ``templates/<template>.cu.j2`` (or ``directory``'s) for one configuration and variant."""
    where = Path(directory) if directory is not None else templates_dir()
    env = _environment(str(where))
    try:
        tmpl = env.get_template(f"{template}.cu.j2")
    except jinja2.TemplateNotFound as exc:
        raise RenderError(f"no template {template!r} in {where} (have: {', '.join(template_names(where))})") from exc
    dtype = "" if variant.dtype == "fp16" else f" DTYPE={variant.dtype}"
    switches = feature_switches(variant)
    dtype += "".join(f" {name}=1" for name in switches)
    header = f"// evoengineer: template={template} {config.label()} HEAD_DIM={variant.head_dim} CAUSAL={int(variant.causal)}{dtype}\n"
    try:
        body = tmpl.render(
            **{**config.to_dict(), **switches},
            HEAD_DIM=variant.head_dim,
            CAUSAL=variant.causal,
            DTYPE=variant.dtype,
            KERNEL_ARGS=KERNEL_ARGS,
            CONFIG_LABEL=config.label(),
            **derived(config, variant, template),
        )
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {template!r}: {exc.message}") from exc
    except jinja2.TemplateRuntimeError as exc:  # raised by {{ raise(...) }} style guards
        raise RenderError(f"template {template!r}: {exc}") from exc
    return from_source(template, config, variant, header + body)


def derived(config: Config, variant: Variant, template: str = paths.FORWARD_TEMPLATE) -> dict[str, Any]:
    """What the configuration's path derives from it at the variant's head dim and features
    (``PATH_SMEM_BYTES``, ``PATH_THREADS``, ``PATH_ROWS_PER_CTA``, the path's ``template_values``)
    and the features it holds (``PATH_FEATURES``); empty for another PATH, only the features for a
    configuration the path's formulas cannot take (the template then rejects it by its own checks)."""
    rules = paths.of_template(template).get(str(config.get("PATH")))
    if rules is None:
        return {}
    scope = rules.scope(config, feature_switches(variant))
    try:
        extra = rules.template_values(scope, variant.head_dim) if rules.template_values else {}
        return {"PATH_SMEM_BYTES": rules.smem_bytes(scope, variant.head_dim), "PATH_THREADS": rules.threads(scope),
                "PATH_ROWS_PER_CTA": rules.rows_per_cta(scope), "PATH_FEATURES": rules.features,
                **{f"PATH_{name}": value for name, value in extra.items()}}
    except (KeyError, TypeError, ArithmeticError):
        return {"PATH_FEATURES": rules.features}


def feature_switches(variant: Variant) -> dict[str, int]:
    """The template's switch of each compile-time feature of ``variant`` (``VARLEN=1``, ...)."""
    return {name.upper(): 1 for name in getattr(variant, "features", ())}


def from_source(template: str, config: Config, variant: Variant, source: str) -> Rendered:
    """A ``Rendered`` from source text that carries its own ``// LAUNCH`` lines (a saved candidate)."""
    launches, workspace, maps, per_split = _parse_metadata(source)
    if not launches:
        raise RenderError(f"template {template!r} declared no '// LAUNCH' line")
    return Rendered(config, variant, template, source, tuple(launches), workspace, tuple(maps), per_split)


def tensor_map_arg(meta: dict) -> TensorMapArg:
    """A ``// TENSOR_MAP`` line's JSON as a ``TensorMapArg``; RenderError if it cannot be one."""
    try:
        arg = TensorMapArg(str(meta["arg"]), str(meta["tensor"]), (int(meta["box"][0]), int(meta["box"][1])),
                           int(meta.get("swizzle", 128)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RenderError(f"'// TENSOR_MAP {json.dumps(meta)}': expected arg, tensor, box [columns, rows] ({exc})") from exc
    if arg.tensor not in TENSOR_MAP_TENSORS or arg.swizzle not in TENSOR_MAP_SWIZZLES or not arg.arg.isidentifier():
        raise RenderError(f"'// TENSOR_MAP {json.dumps(meta)}': tensor one of {', '.join(TENSOR_MAP_TENSORS)}, "
                          f"swizzle one of {TENSOR_MAP_SWIZZLES}, arg an identifier")
    return arg


def declared_tensor_maps(source: str) -> list[TensorMapArg]:
    """The tensor maps a kernel source declares with ``// TENSOR_MAP`` lines, in order."""
    return _parse_metadata(source)[2]


def _auto_split(meta: dict | None) -> tuple[int, int] | None:
    if meta is None:
        return None
    return int(meta["block_n"]), int(meta["kv_groups"])


def _split_tail(meta: dict | None) -> tuple[int, int] | None:
    if meta is None:
        return None
    return int(meta["counter_words_per_cta"]), int(meta["floats_per_cta"])


def _parse_metadata(source: str) -> tuple[list[Launch], int, list[TensorMapArg], int]:
    launches: list[Launch] = []
    workspace = per_split = 0
    maps: list[TensorMapArg] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("// LAUNCH "):
            meta = json.loads(stripped[len("// LAUNCH ") :])
            launches.append(
                Launch(
                    kernel=meta["kernel"],
                    block=tuple(meta["block"]),  # type: ignore[arg-type]
                    smem=int(meta["smem"]),
                    rows_per_cta=int(meta["rows_per_cta"]),
                    grid_z=int(meta.get("grid_z", 1)),
                    persistent=bool(meta.get("persistent", False)),
                    pack_gqa=bool(meta.get("pack_gqa", False)),
                    tile_counter=bool(meta.get("tile_counter", False)),
                    split_tail=_split_tail(meta.get("split_tail")),
                    auto_split=_auto_split(meta.get("auto_split")),
                    split_combine=bool(meta.get("split_combine", False)),
                )
            )
        elif stripped.startswith("// WORKSPACE_FLOATS_PER_ROW "):
            workspace = int(stripped.split()[-1])
        elif stripped.startswith("// WORKSPACE_FLOATS_PER_SPLIT_ROW "):
            per_split = int(stripped.split()[-1])
        elif stripped.startswith("// TENSOR_MAP "):
            maps.append(tensor_map_arg(json.loads(stripped[len("// TENSOR_MAP ") :])))
    return launches, workspace, maps, per_split
