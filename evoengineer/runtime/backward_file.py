"""The ``backward`` section of ``kernel.json``: what an export needs to train through its op.

An export that can train carries, per (dtype, head_dim, causal) it covers:

- an LSE forward: a forward kernel that also writes each query row's log-sum-exp (its ``WS``
  argument, one float per row; an mma kernel, or the export's own wgmma forward with its tensor
  maps); it runs instead of the inference kernels only when a gradient will be needed, so
  inference never writes the LSE;
- backward configurations chosen by the dispatch rule (``dispatch.RULE``) over the variant's
  measured backward cases, its fallback otherwise, and a deterministic one (dQ summed without
  atomics) that serves every call where determinism is asked for;
- each backward kernel's launches (over query rows ``q`` or key rows ``kv``), its argument list and
  its fp32 workspaces (floats per query row); a kernel set whose dK/dV kernel loads by TMA also its
  ``tensor_maps`` (over q, k, v, do, and the flat lse and dsum), whose ``tmap`` arguments follow the
  others: every launch gets the same argument block, and a kernel that takes fewer arguments reads
  only its own;
- kernels built with compile-time features (``features``: seqlens, softcap, window; their arguments
  after the others, as the forward's) and LSE forwards with the same switches, which serve the calls
  with a window, a soft cap or per-batch key ranges and query lengths (a padded batch: ``seqlens_k``,
  ``leftpad_k``, ``seqlens_q``, int32 pointers set per call) (``switches`` lists what both hold).

Nothing in it is evaluated; ``parse_backward`` checks every field the runtime uses and raises
``KernelFileError`` naming the file and the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .dispatch import MeasuredCase, Variant, VariantTable
from .features import POINTER_ARGS as FEATURE_POINTERS
from .features import SCALAR_ARGS as FEATURE_SCALARS
from .features import kernel_switches

POINTER_ARGS = ("Q", "K", "V", "O", "dO", "LSE", "dQ", "dK", "dV")
"""The backward's tensor pointers, filled per call."""
RANGE_ARGS = tuple(name for name in FEATURE_POINTERS if not name.startswith("cu_"))
"""The int32 pointers of a ``seqlens`` backward (per batch; null: none), set per call."""
WORKSPACE_ARGS = ("Dsum", "dQacc")
"""fp32 workspaces a backward may take (floats per query row given by its ``workspaces``)."""
TENSORS = ("q", "k", "v", "o", "do", "dq", "dk", "dv")
SCALAR_ARGS = ("B", "H", "H_kv", "S_q", "S_k", "scale", "scale_log2",
               *(f"{t}_s{d}" for t in TENSORS for d in "bhs"), *FEATURE_SCALARS)
"""The backward's scalar arguments: sizes, the tensors' strides (elements), the softmax scale, and
those of its features (window sides, soft cap)."""
GRIDS = ("q", "kv")
TENSOR_MAP_TENSORS = ("q", "k", "v", "do")
"""What a backward's tensor maps name, in the order of the pointers a call re-points them to
(``backward_launch.map_pointers``)."""


@dataclass(frozen=True)
class BackwardLaunchSpec:
    """One launch of a backward: its grid is (ceil(S_q / rows), B * H) over ``q`` or
    (ceil(S_k / rows), B * H_kv) over ``kv``."""

    kernel: str
    block: tuple[int, int, int]
    smem: int
    rows_per_cta: int
    over: str

    def grid(self, batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int) -> tuple[int, int, int]:
        if self.over == "kv":
            return (-(-seq_k // self.rows_per_cta), batch * heads_kv, 1)
        return (-(-seq_q // self.rows_per_cta), batch * heads, 1)

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "block": list(self.block), "smem": self.smem, "rows_per_cta": self.rows_per_cta,
                "grid": self.over}


@dataclass(frozen=True)
class BackwardKernelSpec:
    """One backward kernel set (preprocess, dK/dV, dQ) of a configuration for one variant."""

    config: str
    dtype: str
    head_dim: int
    causal: bool
    source_file: str
    args: tuple[tuple[str, str], ...]
    launches: tuple[BackwardLaunchSpec, ...]
    workspaces: tuple[tuple[str, int], ...]
    """(argument, fp32 floats per query row) of each workspace, in argument order."""
    deterministic: bool
    source: str = field(default="", repr=False)
    tensor_maps: tuple[Any, ...] = ()
    """``kernel_file.TensorMapSpec`` of each ``tmap`` argument (LOAD tma), in argument order."""
    features: tuple[str, ...] = ()
    """Its compile-time features (``features.SWITCHES``: seqlens, softcap, window), sorted."""

    @property
    def key(self) -> tuple:
        """(dtype, head_dim, causal, config); a kernel with features adds them, as the forward's."""
        return (self.dtype, self.head_dim, self.causal, self.config, *((self.features,) if self.features else ()))

    def as_dict(self) -> dict[str, Any]:
        return {"launches": [launch.to_json() for launch in self.launches], "args": list(self.args),
                "workspaces": dict(self.workspaces), "deterministic": self.deterministic, "source": self.source,
                "source_file": self.source_file,
                **({"tensor_maps": [m.to_json() for m in self.tensor_maps]} if self.tensor_maps else {}),
                **({"features": list(self.features)} if self.features else {})}


@dataclass(frozen=True)
class BackwardVariant:
    """One (dtype, head_dim, causal): its LSE forward, its backward table and its deterministic backward."""

    forward: str
    table: VariantTable
    deterministic: str


@dataclass(frozen=True)
class BackwardData:
    """What the runtime reads of kernel.json's ``backward`` section."""

    configs: dict[str, Any]                                    # config id -> kernel_file.ConfigInfo
    forward_kernels: dict[tuple[str, int, bool, str], Any]     # key -> kernel_file.KernelSpec (WS: the LSE)
    kernels: dict[tuple[str, int, bool, str], BackwardKernelSpec]
    variants: dict[Variant, BackwardVariant]

    def covered(self) -> str:
        return ", ".join(f"{d} D{h}{' causal' if c else ''}" for d, h, c in sorted(self.variants))

    def switches(self, variant: Variant, deterministic: bool = False) -> set[str]:
        """The features the variant's calls with a gradient may ask: those an LSE forward and a
        backward kernel (``deterministic``: a deterministic one) of the variant both hold."""
        forward = {f for key, spec in self.forward_kernels.items() if key[:3] == variant for f in spec.switches}
        backward = {f for key, spec in self.kernels.items() if key[:3] == variant
                    and (spec.deterministic or not deterministic) for f in spec.features}
        return forward & backward


def parse_backward(top: Any, path: Path, read_kernel: Callable[[Any], Any], config_info: Callable[[Any], Any],
                   dtypes: tuple[str, ...], read_maps: Callable[[Any, list], list] | None = None) -> BackwardData | None:
    """The ``backward`` section of a kernel.json, or None when the export has none (an
    inference-only export). ``top``: the document's typed fields (``kernel_file``'s reader, whose
    ``fail`` names the file and the key); ``read_kernel``: the forward kernel reader (for the LSE
    forwards); ``config_info``: a configuration entry's reader; ``read_maps``: a kernel entry's
    ``tensor_maps`` reader (given its arguments)."""
    if top.doc.get("backward") is None:
        return None
    section = top.obj("backward")
    configs: dict[str, Any] = {}
    config_docs = section.obj("configs")
    for cid in config_docs.doc:
        configs[cid] = config_info(config_docs.obj(cid))
    forward: dict[tuple[str, int, bool, str], Any] = {}
    for i, item in enumerate(section.items("forward_kernels")):
        where = f"backward.forward_kernels[{i}]"
        spec = read_kernel(top.at(item, where))
        if spec.config not in configs:
            section.fail(f"{where}.config", f"{_show(spec.config)} is not one of backward.configs")
        if (spec.workspace_floats_per_row != 1 or len(spec.launches) != 1 or spec.launches[0].tile_counter
                or spec.launches[0].split_tail or spec.launches[0].auto_split is not None):
            section.fail(where, "an LSE forward has one launch, no tile counter, cut tail or split, and one workspace "
                                "float (the LSE) per row")
        forward[spec.key] = spec
    kernels: dict[tuple[str, int, bool, str], BackwardKernelSpec] = {}
    for i, item in enumerate(section.items("kernels")):
        entry = top.at(item, f"backward.kernels[{i}]")
        spec = _backward_kernel(entry, path.parent, dtypes, read_maps)
        if spec.config not in configs:
            entry.fail(entry.key("config"), f"{_show(spec.config)} is not one of backward.configs")
        if spec.key in kernels:
            entry.fail(entry.where, "a second kernel for the same configuration and variant")
        kernels[spec.key] = spec
    variants: dict[Variant, BackwardVariant] = {}
    for i, item in enumerate(section.items("variants")):
        entry = top.at(item, f"backward.variants[{i}]")
        variant = (entry.text("dtype", dtypes), entry.integer("head_dim", 1), entry.flag("causal"))
        if variant in variants:
            entry.fail(entry.where, "a second entry for the same (dtype, head_dim, causal)")
        cases = []
        for j, case_doc in enumerate(entry.items("cases")):
            case = top.at(case_doc, f"{entry.where}.cases[{j}]")
            cases.append(MeasuredCase(case.integer("batch", 1), case.integer("heads", 1), case.integer("heads_kv", 1),
                                      case.integer("seq_q", 1), case.integer("seq_k", 1), case.text("config")))
        chosen = BackwardVariant(entry.text("forward"), VariantTable(entry.text("fallback"), tuple(cases)),
                                 entry.text("deterministic"))
        label = f"{variant[0]} D{variant[1]}{' causal' if variant[2] else ''}"
        if (*variant, chosen.forward) not in forward:
            entry.fail(entry.key("forward"), f"{_show(chosen.forward)} has no LSE forward kernel for {label}")
        named = (("fallback", chosen.table.fallback), ("deterministic", chosen.deterministic),
                 *((f"cases[{j}].config", c.config) for j, c in enumerate(cases)))
        for what, cid in named:
            if (*variant, cid) not in kernels:
                entry.fail(entry.key(what), f"{_show(cid)} has no backward kernel for {label}")
        if not kernels[(*variant, chosen.deterministic)].deterministic:
            entry.fail(entry.key("deterministic"), f"{_show(chosen.deterministic)} is not a deterministic backward")
        variants[variant] = chosen
    return BackwardData(configs, forward, kernels, variants)


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _backward_kernel(entry: Any, directory: Path, dtypes: tuple[str, ...],
                     read_maps: Callable[[Any, list], list] | None = None) -> BackwardKernelSpec:
    args: list[tuple[str, str]] = []
    for j, arg in enumerate(entry.items("args")):
        if not isinstance(arg, list) or len(arg) != 2 or not all(isinstance(x, str) for x in arg):
            entry.fail(f"{entry.where}.args[{j}]", f"expected [name, kind], got {_show(arg)}")
        name, kind = arg
        if kind == "tmap":   # described by tensor_maps
            if not (name.isidentifier() and name.isascii()):
                entry.fail(f"{entry.where}.args[{j}]", f"{_show(name)} is not a tensor-map argument name")
            args.append((name, kind))
            continue
        if any(k == "tmap" for _, k in args):
            entry.fail(f"{entry.where}.args[{j}]", "tensor-map arguments (kind tmap) come after every other argument")
        known = (POINTER_ARGS + WORKSPACE_ARGS + RANGE_ARGS) if kind == "ptr" else SCALAR_ARGS if kind in ("i32", "i64", "f32") else ()
        if name not in known:
            entry.fail(f"{entry.where}.args[{j}]", f"{_show(name)} ({_show(kind)}) is not an argument the runtime fills")
        args.append((name, kind))
    names = [name for name, _ in args]
    if len(set(names)) != len(names) or any(p not in names for p in POINTER_ARGS):
        entry.fail(entry.key("args"), f"must name each of {', '.join(POINTER_ARGS)} once and no argument twice")
    workspaces_doc = entry.obj("workspaces")
    workspaces = []
    for name in workspaces_doc.doc:
        if name not in WORKSPACE_ARGS or name not in names:
            entry.fail(f"{entry.where}.workspaces", f"{_show(name)} is not a workspace argument of this kernel")
        workspaces.append((name, workspaces_doc.integer(name, 0)))
    missing = [n for n in names if n in WORKSPACE_ARGS and n not in dict(workspaces)]
    if missing:
        entry.fail(f"{entry.where}.workspaces", f"no size for {', '.join(missing)}")
    launches = []
    for j, item in enumerate(entry.items("launches")):
        launch = entry.at(item, f"{entry.where}.launches[{j}]")
        kernel = launch.text("kernel")
        if not (kernel.isidentifier() and kernel.isascii()):
            launch.fail(launch.key("kernel"), f"{_show(kernel)} is not a kernel name")
        block = launch.ints("block", 3)
        launches.append(BackwardLaunchSpec(kernel, (block[0], block[1], block[2]), launch.integer("smem"),
                                           launch.integer("rows_per_cta", 1), launch.text("grid", GRIDS)))
    if not launches:
        entry.fail(entry.key("launches"), "empty")
    maps: list = []
    if entry.doc.get("tensor_maps") is not None or any(kind == "tmap" for _, kind in args):
        if read_maps is None:
            entry.fail(entry.key("tensor_maps"), "this reader takes no tensor maps")
        maps = read_maps(entry, args)
        if any(m.tensor not in TENSOR_MAP_TENSORS for m in maps):
            entry.fail(entry.key("tensor_maps"), f"a backward maps only {', '.join(TENSOR_MAP_TENSORS)}")
    features: list = entry.items("features") if entry.doc.get("features") is not None else []
    if not all(isinstance(f, str) for f in features) or list(kernel_switches(features)) != sorted(features):
        entry.fail(entry.key("features"), "expected a sorted list of compile-time features (seqlens, softcap, window)")
    source_file, source = entry.source("source", directory)
    return BackwardKernelSpec(entry.text("config"), entry.text("dtype", dtypes), entry.integer("head_dim", 1),
                              entry.flag("causal"), source_file, tuple(args), tuple(launches), tuple(workspaces),
                              entry.flag("deterministic"), source, tuple(maps), tuple(features))
