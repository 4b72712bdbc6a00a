"""``kernel.json``: everything an export holds besides code, read as plain JSON and checked.

An export directory holds this package (copied verbatim), ``kernel.json`` and the kernels'
CUDA sources. ``kernel.json`` carries the configurations, the dispatch table, each kernel's
launch metadata and argument list, the op namespace and the provenance of the search. Nothing
in it is ever evaluated: ``read_kernel_file`` checks every field the runtime uses and raises
``KernelFileError`` with one line naming the file and the key.
"""
from __future__ import annotations

import json
import keyword
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .backward_file import BackwardData, parse_backward
from .dispatch import MeasuredCase, Variant, VariantTable
from .features import POINTER_ARGS as FEATURE_POINTERS
from .features import SCALAR_ARGS as FEATURE_SCALARS
from .features import kernel_switches
from .grid import counter_words, grid

SCHEMA = "evoengineer-attention-export/2"
"""The ``schema`` of the kernel.json this runtime reads; an export writes it."""
DTYPES = ("fp16", "bf16")
ARG_KINDS = ("ptr", "i32", "i64", "f32", "tmap")
POINTER_ARGS = ("Q", "K", "V", "O", "WS")
"""The kernel's pointer arguments, in the roles the runtime fills per call."""
SCALAR_ARGS = ("B", "H", "H_kv", "S_q", "S_k", "q_sb", "q_sh", "q_ss", "k_sb", "k_sh", "k_ss",
               "v_sb", "v_sh", "v_ss", "o_sb", "o_sh", "o_ss", "scale_log2", "kv_splits")
"""The scalar arguments the runtime knows how to fill (``kv_splits``: the call's K/V split count,
``grid.call_splits``, of a kernel that takes it)."""
MAP_TENSORS = ("q", "k", "v", "out", "do")
MAP_SWIZZLES = (0, 32, 64, 128)
FEATURE_GQA = "gqa"
"""A kernel with this feature takes a K/V head count (``int H_kv``): grouped-query attention."""
FEATURE_ARGS = (*FEATURE_POINTERS, *FEATURE_SCALARS)
"""Arguments of kernels with compile-time features (``features.SWITCHES``): pointers
``seqlens_k``, ``leftpad_k``, ``cu_seqlens_q``, ``cu_seqlens_k``, scalars ``window_left``,
``window_right``, ``softcap``."""


class KernelFileError(ValueError):
    """kernel.json (or a source it names) cannot serve this runtime; ``str()`` is one line."""


def is_identifier(name: str) -> bool:
    """A Python identifier that is no keyword: a module name or a torch op namespace."""
    return isinstance(name, str) and name.isidentifier() and name.isascii() and not keyword.iskeyword(name)


@dataclass(frozen=True)
class TensorMapSpec:
    """A tensor-map kernel argument: which tensor it maps, the box copied per load, the swizzle."""

    arg: str
    tensor: str
    box: tuple[int, int]
    swizzle: int

    def to_json(self) -> dict[str, Any]:
        return {"arg": self.arg, "tensor": self.tensor, "box": list(self.box), "swizzle": self.swizzle}


@dataclass(frozen=True)
class LaunchSpec:
    """One launch of a kernel: its function, block, dynamic shared memory and grid shape."""

    kernel: str
    block: tuple[int, int, int]
    smem: int
    rows_per_cta: int
    grid_z: int = 1
    persistent: bool = False
    pack_gqa: bool = False
    tile_counter: bool = False
    split_tail: tuple[int, int] | None = None
    """(counter words, floats) per CTA of a tile-counter kernel that cuts its last tiles over
    every CTA, else None."""
    auto_split: tuple[int, int] | None = None
    """(BLOCK_N, KV_GROUPS) of a launch whose K/V split count is chosen per call (its grid's z:
    ``grid.call_splits``), else None (``grid_z`` fixed)."""
    split_combine: bool = False
    """A combine step that runs only where the call's K/V range is split (``grid.runs``)."""

    def counter_words(self, batch: int, heads: int, seq_q: int, sms: int) -> tuple[int, int]:
        """(32-bit words of WS, how many of them are zeroed first) for a tile-counter launch on
        ``sms`` multiprocessors (``grid.counter_words``)."""
        return counter_words(self, batch, heads, seq_q, sms)

    def grid(self, batch: int, heads: int, seq_q: int, sms: int | None = None,
             heads_kv: int | None = None, splits: int = 1) -> tuple[int, int, int]:
        """The launch grid (``grid.grid``); a persistent kernel gets at most ``sms`` CTAs (every
        work tile its own CTA when ``sms`` is None: correct, only not persistent); a packed one a
        grid row per (batch, K/V head) (``heads_kv``: K/V heads, ``heads`` when None); one whose
        split count is the call's (``auto_split``) ``splits`` in z."""
        return grid(self, batch, heads, heads_kv or heads, seq_q, sms, splits)

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kernel": self.kernel, "block": list(self.block), "smem": self.smem,
                               "rows_per_cta": self.rows_per_cta, "grid_z": self.grid_z, "persistent": self.persistent,
                               "pack_gqa": self.pack_gqa, "tile_counter": self.tile_counter}
        if self.split_tail is not None:
            out["split_tail"] = {"counter_words_per_cta": self.split_tail[0], "floats_per_cta": self.split_tail[1]}
        out.update(auto_split_json(self))
        return out


def auto_split_json(launch: "LaunchSpec") -> dict[str, Any]:
    """The keys of a launch's per-call split in kernel.json and ``// LAUNCH`` lines (none without one)."""
    out: dict[str, Any] = {}
    if launch.auto_split is not None:
        out["auto_split"] = {"block_n": launch.auto_split[0], "kv_groups": launch.auto_split[1]}
    if launch.split_combine:
        out["split_combine"] = True
    return out


@dataclass(frozen=True)
class KernelSpec:
    """One compiled unit: a configuration for one (dtype, head_dim, causal)."""

    config: str
    dtype: str
    head_dim: int
    causal: bool
    source_file: str
    args: tuple[tuple[str, str], ...]
    launches: tuple[LaunchSpec, ...]
    workspace_floats_per_row: int = 0
    features: tuple[str, ...] = ()
    tensor_maps: tuple[TensorMapSpec, ...] = ()
    source: str = field(default="", repr=False)
    workspace_floats_per_split: int = 0
    """Workspace floats per output row and K/V split where the call's split count is chosen per
    call and above 1 (``grid.workspace_floats``)."""

    @property
    def key(self) -> tuple:
        """(dtype, head_dim, causal, config); a kernel with compile-time features (window,
        softcap, seqlens) adds them: (dtype, head_dim, causal, config, switches)."""
        switches = self.switches
        return (self.dtype, self.head_dim, self.causal, self.config, *((switches,) if switches else ()))

    @property
    def switches(self) -> tuple[str, ...]:
        """Its compile-time features (``features.SWITCHES``), sorted."""
        return kernel_switches(self.features)

    @property
    def variant(self) -> Variant:
        return (self.dtype, self.head_dim, self.causal)

    @property
    def gqa(self) -> bool:
        return FEATURE_GQA in self.features

    def as_dict(self) -> dict[str, Any]:
        """The kernel as plain values (the ``KERNELS`` entries of an exported module)."""
        return {"launches": [launch.to_json() for launch in self.launches],
                "workspace_floats_per_row": self.workspace_floats_per_row,
                **({"workspace_floats_per_split": self.workspace_floats_per_split}
                   if self.workspace_floats_per_split else {}), "args": list(self.args),
                "features": list(self.features), "tensor_maps": [m.to_json() for m in self.tensor_maps],
                "source": self.source, "source_file": self.source_file}


@dataclass(frozen=True)
class ConfigInfo:
    """A configuration of the export: its label, short form and parameters."""

    label: str
    short: str
    params: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "short": self.short, "config": dict(self.params)}


@dataclass(frozen=True)
class ExportData:
    """What the runtime reads of kernel.json."""

    path: Path
    module: str
    op_namespace: str
    arch: str
    gpu: str
    rule: str
    fallback: str
    configs: dict[str, ConfigInfo]
    kernels: dict[tuple[str, int, bool, str], KernelSpec]
    dispatch: dict[Variant, VariantTable]
    backward: BackwardData | None = None
    """The kernels a gradient needs (``backward_file``); None: an inference-only export."""

    @property
    def dtypes(self) -> list[str]:
        return sorted({key[0] for key in self.kernels})

    @property
    def head_dims(self) -> list[int]:
        return sorted({key[1] for key in self.kernels})

    def variant_gqa(self) -> dict[Variant, bool]:
        """Per (dtype, head_dim, causal): whether every kernel of it takes a K/V head count."""
        out: dict[Variant, bool] = {}
        for spec in self.kernels.values():
            out[spec.variant] = out.get(spec.variant, True) and spec.gqa
        return out


# -- reading ----------------------------------------------------------------------------------


class _Fields:
    """Typed access to one JSON object; every failure names the file and the key."""

    def __init__(self, doc: Any, where: str, file: Path) -> None:
        self.file, self.where = file, where
        if not isinstance(doc, dict):
            self.fail(where, f"expected an object, got {_kind(doc)}")
        self.doc: dict[str, Any] = doc

    def fail(self, key: str, what: str) -> NoReturn:
        raise KernelFileError(f"{self.file}: {key}: {what}; re-export with `evoengineer export`")

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str) -> Any:
        if name not in self.doc:
            self.fail(self.key(name), "missing")
        return self.doc[name]

    def text(self, name: str, choices: tuple[str, ...] | None = None) -> str:
        value = self.get(name)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            self.fail(self.key(name), f"expected {' or '.join(choices) if choices else 'a string'}, got {_show(value)}")
        return value

    def integer(self, name: str, minimum: int = 0, default: int | None = None) -> int:
        value = self.doc.get(name, default) if default is not None else self.get(name)
        if not _is_int(value) or value < minimum:
            self.fail(self.key(name), f"expected an integer >= {minimum}, got {_show(value)}")
        return int(value)

    def flag(self, name: str, default: bool | None = None) -> bool:
        value = self.doc.get(name, default) if default is not None else self.get(name)
        if not isinstance(value, bool):
            self.fail(self.key(name), f"expected true or false, got {_show(value)}")
        return value

    def items(self, name: str) -> list[Any]:
        value = self.get(name)
        if not isinstance(value, list):
            self.fail(self.key(name), f"expected a list, got {_kind(value)}")
        return value

    def obj(self, name: str) -> "_Fields":
        return _Fields(self.get(name), self.key(name), self.file)

    def at(self, doc: Any, where: str) -> "_Fields":
        """Another object of the same file, named ``where`` in errors."""
        return _Fields(doc, where, self.file)

    def source(self, name: str, directory: Path) -> tuple[str, str]:
        """(file name, text) of the CUDA source this entry names: a ``.cu`` file beside kernel.json."""
        source_file = self.text(name)
        if Path(source_file).name != source_file or source_file.startswith(".") or not source_file.endswith(".cu"):
            self.fail(self.key(name), f"{_show(source_file)} is not a .cu file name beside kernel.json")
        try:
            return source_file, (directory / source_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KernelFileError(f"{directory / source_file}: cannot read the kernel source ({exc}); "
                                  "re-export with `evoengineer export`") from None

    def ints(self, name: str, count: int, minimum: int = 1) -> tuple[int, ...]:
        value = self.get(name)
        if not isinstance(value, list) or len(value) != count or not all(_is_int(x) and x >= minimum for x in value):
            self.fail(self.key(name), f"expected {count} integers >= {minimum}, got {_show(value)}")
        return tuple(int(x) for x in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _kind(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_kernel_file(path: Path) -> ExportData:
    """Read and check ``kernel.json`` at ``path`` and the CUDA sources it names (beside it)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise KernelFileError(f"{path}: cannot read ({exc.strerror or exc}); re-export with `evoengineer export`") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise KernelFileError(f"{path}: not JSON ({str(exc).splitlines()[0]}); re-export with `evoengineer export`") from None
    return parse_kernel_file(doc, path)


def parse_kernel_file(doc: Any, path: Path) -> ExportData:
    """``read_kernel_file`` on a document already read (sources are read beside ``path``)."""
    top = _Fields(doc, "", path)
    schema = doc.get("schema")
    if schema != SCHEMA:
        found = f"schema {_show(schema)}" if schema is not None else "no schema (an export of an earlier EvoEngineer)"
        raise KernelFileError(f"{path}: {found}; this runtime reads {SCHEMA}: re-export with `evoengineer export`")
    module = top.text("module")
    namespace = top.text("op_namespace")
    for key, name in (("module", module), ("op_namespace", namespace)):
        if not is_identifier(name):
            top.fail(key, f"{_show(name)} is not a Python identifier")
    configs: dict[str, ConfigInfo] = {}
    config_docs = top.obj("configs")
    for cid in config_docs.doc:
        configs[cid] = _config_info(config_docs.obj(cid))
    kernels: dict[tuple[str, int, bool, str], KernelSpec] = {}
    for i, item in enumerate(top.items("kernels")):
        spec = _kernel(_Fields(item, f"kernels[{i}]", path), path.parent)
        if spec.config not in configs:
            top.fail(f"kernels[{i}].config", f"{_show(spec.config)} is not one of configs")
        if spec.key in kernels:
            top.fail(f"kernels[{i}]", "a second kernel for the same configuration and variant")
        kernels[spec.key] = spec
    dispatch_doc = top.obj("dispatch")
    fallback = dispatch_doc.text("fallback")
    if fallback not in configs:
        dispatch_doc.fail("dispatch.fallback", f"{_show(fallback)} is not one of configs")
    tables: dict[Variant, VariantTable] = {}
    for i, item in enumerate(dispatch_doc.items("variants")):
        entry = _Fields(item, f"dispatch.variants[{i}]", path)
        variant = (entry.text("dtype", DTYPES), entry.integer("head_dim", 1), entry.flag("causal"))
        if variant in tables:
            entry.fail(entry.where, "a second entry for the same (dtype, head_dim, causal)")
        cases = []
        for j, case_doc in enumerate(entry.items("cases")):
            case = _Fields(case_doc, f"{entry.where}.cases[{j}]", path)
            cases.append(MeasuredCase(case.integer("batch", 1), case.integer("heads", 1), case.integer("heads_kv", 1),
                                      case.integer("seq_q", 1), case.integer("seq_k", 1), case.text("config"),
                                      case.flag("varlen", default=False), case.flag("padded", default=False)))
        table = VariantTable(entry.text("fallback"), tuple(cases))
        for what, cid in (("fallback", table.fallback), *((f"cases[{j}].config", c.config) for j, c in enumerate(cases))):
            if (*variant, cid) not in kernels:
                entry.fail(entry.key(what), f"{_show(cid)} has no kernel for {variant[0]} D{variant[1]}"
                                            f"{' causal' if variant[2] else ''}")
        tables[variant] = table
    if not tables:
        dispatch_doc.fail("dispatch.variants", "empty: the export serves nothing")
    backward = parse_backward(top, path, lambda entry: _kernel(entry, path.parent), _config_info, DTYPES, _tensor_maps)
    return ExportData(path, module, namespace, top.text("arch"), top.text("gpu"), dispatch_doc.text("rule"), fallback,
                      configs, kernels, tables, backward)


def _config_info(entry: _Fields) -> ConfigInfo:
    return ConfigInfo(entry.text("label"), entry.text("short"), dict(entry.obj("config").doc))


def _tensor_maps(entry: _Fields, args: list[tuple[str, str]]) -> list[TensorMapSpec]:
    """A kernel entry's ``tensor_maps``, one for each of its ``tmap`` arguments."""
    maps = []
    for j, item in enumerate(entry.items("tensor_maps")):
        m = _Fields(item, f"{entry.where}.tensor_maps[{j}]", entry.file)
        box = m.ints("box", 2)
        swizzle = m.get("swizzle")
        if swizzle not in MAP_SWIZZLES or isinstance(swizzle, bool):
            m.fail(m.key("swizzle"), f"expected one of {MAP_SWIZZLES}, got {_show(swizzle)}")
        maps.append(TensorMapSpec(m.text("arg"), m.text("tensor", MAP_TENSORS), (box[0], box[1]), int(swizzle)))
    if sorted(m.arg for m in maps) != sorted(name for name, kind in args if kind == "tmap"):
        entry.fail(entry.key("tensor_maps"), "must describe each tensor-map argument (kind tmap) once")
    return maps


def _kernel(entry: _Fields, directory: Path) -> KernelSpec:
    args: list[tuple[str, str]] = []
    for j, arg in enumerate(entry.items("args")):
        if (not isinstance(arg, list) or len(arg) != 2 or not all(isinstance(x, str) for x in arg)
                or arg[1] not in ARG_KINDS):
            entry.fail(f"{entry.where}.args[{j}]", f"expected [name, kind] with kind one of {', '.join(ARG_KINDS)}, "
                                                   f"got {_show(arg)}")
        name, kind = arg
        known = (POINTER_ARGS + FEATURE_POINTERS if kind == "ptr" else SCALAR_ARGS + FEATURE_SCALARS
                 if kind != "tmap" else None)
        if (known is not None and name not in known) or not is_identifier(name):
            entry.fail(f"{entry.where}.args[{j}]", f"{_show(name)} is not an argument the runtime fills")
        args.append((name, kind))
    names = [name for name, _ in args]
    missing = [p for p in POINTER_ARGS if p not in names]
    if missing or len(set(names)) != len(names):
        entry.fail(entry.key("args"), f"must name each of {', '.join(POINTER_ARGS)} once and no argument twice")
    maps = _tensor_maps(entry, args)
    launches = []
    for j, item in enumerate(entry.items("launches")):
        launch = _Fields(item, f"{entry.where}.launches[{j}]", entry.file)
        kernel = launch.text("kernel")
        if not is_identifier(kernel):
            launch.fail(launch.key("kernel"), f"{_show(kernel)} is not a kernel name")
        split = None
        if launch.doc.get("split_tail") is not None:
            st = launch.obj("split_tail")
            split = (st.integer("counter_words_per_cta"), st.integer("floats_per_cta"))
        auto = None
        if launch.doc.get("auto_split") is not None:
            at = launch.obj("auto_split")
            auto = (at.integer("block_n", 1), at.integer("kv_groups", 1))
        block = launch.ints("block", 3)
        launches.append(LaunchSpec(kernel, (block[0], block[1], block[2]), launch.integer("smem"), launch.integer("rows_per_cta", 1),
                                   launch.integer("grid_z", 1, default=1), launch.flag("persistent", False),
                                   launch.flag("pack_gqa", False), launch.flag("tile_counter", False), split, auto,
                                   launch.flag("split_combine", False)))
    if not launches:
        entry.fail(entry.key("launches"), "empty")
    if any(launch.split_combine for launch in launches) and ("kv_splits" not in names
                                                             or not entry.doc.get("workspace_floats_per_split")):
        entry.fail(entry.key("launches"), "a split_combine launch needs the argument kv_splits and "
                                          "workspace_floats_per_split")
    features = entry.items("features")
    if not all(isinstance(f, str) for f in features):
        entry.fail(entry.key("features"), "expected a list of strings")
    source_file, source = entry.source("source", directory)
    return KernelSpec(entry.text("config"), entry.text("dtype", DTYPES), entry.integer("head_dim", 1), entry.flag("causal"),
                      source_file, tuple(args), tuple(launches), entry.integer("workspace_floats_per_row"),
                      tuple(features), tuple(maps), source, entry.integer("workspace_floats_per_split", default=0))
