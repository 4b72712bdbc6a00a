"""Export searched kernels as a drop-in Python package.

``export_runs`` combines the measurements of one or more runs: for every measured case
the fastest configuration (``per_shape``), one kernel per distinct (configuration,
dtype, head dim, causal), and a dispatch table that picks a configuration per call.
``export_entry`` exports a single leaderboard entry (``--rank N``). Both write
``<out>/<module>/`` (the runtime package ``evoengineer.runtime``, copied verbatim; needs only
torch and cupy), the CUDA sources and ``kernel.json`` (configurations, kernels' launch
metadata, the dispatch table, the op namespace, provenance), which the package reads as
plain JSON at import. Nothing is generated as code.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from .. import runtime
from ..space import Config, Variant
from .export_backward import BackwardChoice, backward_kernel_entry, feature_configs, short_backward
from .per_shape import (
    DISPATCH_RULE,
    ExportError,
    MeasuredConfig,
    PerShape,
    RunInfo,
    Shape,
    nearest,
    per_shape_winners,
    short_config,
    variant_dtype,
)

MODULE_NAME = "evo_attention"

from ..runtime.features import POINTER_ARGS as FEATURE_POINTERS
from ..runtime.features import SCALAR_ARGS as FEATURE_SCALARS
from ..runtime.kernel_file import POINTER_ARGS, auto_split_json
from ..runtime.kernel_file import SCALAR_ARGS as KNOWN_SCALARS

RUNTIME_DIR = Path(runtime.__file__).resolve().parent
"""The runtime package, copied verbatim into every export."""
RUNTIME_MARK = '"""The runtime of an exported attention module'
"""How the runtime's ``__init__.py`` begins: an earlier export's package, which a new export replaces."""
OLD_MODULE_MARK = '"""FlashAttention forward found by EvoEngineer'
"""How the single-file module of exports before the runtime package began."""
RESERVED_NAMES = frozenset({"torch", "cupy", "numpy", "transformers", "evoengineer", "triton"})


@dataclass
class KernelSpec:
    config_id: str
    dtype: str
    variant: Variant
    rendered: Any  # kernels.Rendered
    args: list[tuple[str, str]]

    @property
    def key(self) -> tuple:
        features = tuple(getattr(self.variant, "features", ()))
        return (self.dtype, self.variant.head_dim, self.variant.causal, self.config_id, *((features,) if features else ()))

    @property
    def features(self) -> list[str]:
        """``gqa`` where the kernel takes ``int H_kv``, plus what its ``// FEATURES`` line declares."""
        declared = _declared_features(self.rendered.source)
        if any(name == "H_kv" for name, _ in self.args):
            declared.add("gqa")
        return sorted(declared)

    @property
    def filename_stem(self) -> str:
        return f"{self.config_id[:12]}-{self.dtype}-{self.variant.label()}"


# -- the kernel's signature ------------------------------------------------------------------


_SIGNATURE = r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?{name}\s*\(([^)]*)\)"


def kernel_args(source: str, kernel: str) -> list[tuple[str, str]]:
    """The parameter list of ``kernel`` in ``source`` as (name, kind), kind one of
    ``ptr``, ``i32``, ``i64``, ``f32`` and ``tmap`` (a tensor map the source declares with a
    ``// TENSOR_MAP`` line): what the module packs, by name."""
    from ..kernels.render import RenderError, declared_tensor_maps, parameter_kinds

    match = re.search(_SIGNATURE.format(name=re.escape(kernel)), source)
    if match is None:
        raise ExportError(f"kernel {kernel!r}: no __global__ definition found in its source")
    try:
        args = parameter_kinds(match.group(1))
        declared = {m.arg for m in declared_tensor_maps(source)}
    except (ValueError, RenderError) as exc:
        raise ExportError(f"kernel {kernel!r}: {exc}") from None
    for name, kind in args:
        if kind == "tmap":
            if name not in declared:
                raise ExportError(f"kernel {kernel!r}: tensor map parameter {name!r} has no '// TENSOR_MAP' line")
            continue
        known = POINTER_ARGS + FEATURE_POINTERS if kind == "ptr" else KNOWN_SCALARS + FEATURE_SCALARS
        if name not in known:
            raise ExportError(f"kernel {kernel!r}: parameter {name!r} is not one the module knows how to fill "
                              f"(pointers {', '.join(POINTER_ARGS)}; scalars {', '.join(KNOWN_SCALARS)})")
    missing = declared - {name for name, kind in args if kind == "tmap"}
    if missing:
        raise ExportError(f"kernel {kernel!r}: '// TENSOR_MAP' declares {', '.join(sorted(missing))}, which it does not take")
    return args


def _declared_features(source: str) -> set[str]:
    """Features a template declares with a ``// FEATURES a b`` line (e.g. ``gqa``)."""
    found: set[str] = set()
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("// FEATURES "):
            found.update(stripped[len("// FEATURES "):].split())
    return found


def _spec(run: RunInfo, config: MeasuredConfig, variant: Variant) -> KernelSpec:
    from ..kernels import from_source, render

    measured = run.path / "sources" / f"{config.key}-{variant.label()}.cu"
    cfg = Config(config.config)
    # the source that was measured, where the run kept it; otherwise rendered now
    rendered = (from_source(config.template, cfg, variant, measured.read_text()) if measured.exists()
                else render(config.template, cfg, variant))
    signatures = [kernel_args(rendered.source, launch.kernel) for launch in rendered.launches]
    if any(s != signatures[0] for s in signatures):
        raise ExportError(f"{config.id} {variant.label()}: its launches take different argument lists")
    if "gqa" in _declared_features(rendered.source) and not any(n == "H_kv" for n, _ in signatures[0]):
        raise ExportError(f"{config.id} {variant.label()}: declares '// FEATURES gqa' but its kernels take no 'int H_kv'")
    return KernelSpec(config.id, variant_dtype(variant, run.space), variant, rendered, signatures[0])


def _variant_like(template: Variant, dtype: str, head_dim: int, causal: bool) -> Variant:
    changes: dict[str, Any] = {"head_dim": head_dim, "causal": causal}
    if hasattr(template, "dtype"):
        changes["dtype"] = dtype
    return replace(template, **changes)


# -- exports ----------------------------------------------------------------------------------


def export_runs(runs: Sequence[Path], out: Path, module_name: str = MODULE_NAME,
                backward: BackwardChoice | None = None) -> list[Path]:
    """One module holding the per-case winners of ``runs`` (and their fallback), choosing a
    configuration per call by the nearest measured case; with backward kernels for training
    (``backward``: which; default: each head dim's default configuration)."""
    from ..kernels import RenderError

    check_module_name(module_name)
    per = per_shape_winners([Path(r) for r in runs])
    run_of = {str(r.path): r for r in per.runs}
    all_variants: dict[tuple[str, int, bool], Variant] = {}
    for run in per.runs:
        for variant in run.variants():
            all_variants.setdefault((variant_dtype(variant, run.space), variant.head_dim, variant.causal), variant)
    wanted: dict[str, set[tuple[str, int, bool, tuple[str, ...]]]] = {}
    for winner in per.winners:  # a case with features: its winner with them (and without, for the dispatch table)
        wanted.setdefault(winner.config, set()).update({(*winner.shape.variant_key, ()),
                                                        (*winner.shape.variant_key, winner.shape.features)})
    wanted.setdefault(per.fallback, set()).update((*key, ()) for key in all_variants)
    specs: list[KernelSpec] = []
    notes = list(per.notes)
    for cid, keys in wanted.items():
        config = per.configs[cid]
        run = run_of[config.run]
        for dtype, head_dim, causal, features in sorted(keys):
            base = all_variants.get((dtype, head_dim, causal)) or next(iter(run.variants()))
            variant = _variant_like(base, dtype, head_dim, causal)
            if features:
                variant = replace(variant, features=features)
            won_here = any(w.config == cid and w.shape.variant_key == (dtype, head_dim, causal) for w in per.winners)
            broken = [] if won_here else run.space.violations(config.config, head_dim=head_dim)
            if broken:   # the fallback where its path's rules refuse it (e.g. its tiles overflow shared memory)
                notes.append(f"fallback {cid} is not valid at {dtype} D{head_dim}{' causal' if causal else ''}: {broken[0]}")
                continue
            try:
                specs.append(_spec(run, config, variant))
            except RenderError as exc:
                if cid != per.fallback or won_here:
                    raise ExportError(f"{cid}: {exc}") from None
                notes.append(f"fallback {cid} does not render for {dtype} D{head_dim}{' causal' if causal else ''}: {exc}")
    order = [per.fallback, *sorted(c for c in per.configs if c != per.fallback)]
    specs += _every_feature_specs([(per.configs[c], run_of[per.configs[c].run]) for c in order],
                                  list(all_variants.values()), specs, notes)
    return _write(out, module_name, per, specs, mode="per-shape", notes=notes, measured=None, backward=backward)


def _every_feature_specs(candidates: list[tuple[MeasuredConfig, RunInfo]], variants: list[Variant],
                         specs: list[KernelSpec], notes: list[str]) -> list[KernelSpec]:
    """Per plain variant without one yet, a kernel with every feature (per-batch key ranges,
    soft-capping, a window: padding and sliding windows from ``hf_attention``; packed sequences),
    of the first candidate configuration that renders it (the mma and wgmma paths hold all four),
    so that calls with features find a kernel in any export; where the first candidates' path
    holds only some of them, a kernel with those, and the rest from a later candidate; a note for
    features no candidate holds."""
    from ..kernels import RenderError
    from ..paths import of_template
    from ..runtime.features import SWITCHES

    have = {(s.dtype, s.variant.head_dim, s.variant.causal) for s in specs
            if set(getattr(s.variant, "features", ())) >= set(SWITCHES)}
    plain = {(s.dtype, s.variant.head_dim, s.variant.causal) for s in specs if not getattr(s.variant, "features", ())}
    out: list[KernelSpec] = []
    for base in variants:
        if not hasattr(base, "features"):
            continue
        covered: set[str] = set()
        for config, run in candidates:
            if (variant_dtype(base, run.space), base.head_dim, base.causal) in have:
                covered = set(SWITCHES)
                break
            path = of_template(config.template).get(str(config.config.get("PATH")))
            held = tuple(f for f in SWITCHES if path is not None and f in path.features)
            if set(held) <= covered or run.space.violations(config.config, head_dim=base.head_dim):
                continue
            try:
                out.append(_spec(run, config, replace(base, features=held)))
            except (RenderError, ExportError):
                continue
            key = (out[-1].dtype, base.head_dim, base.causal)
            if not covered and key not in plain:   # no configuration has a plain kernel of the variant: this one's serves it
                out.append(_spec(run, config, base))
                plain.add(key)
            covered |= set(held)
            if covered == set(SWITCHES):
                break
        missing = [f for f in SWITCHES if f not in covered]
        if missing:
            notes.append(f"no configuration renders {base.label()} with {', '.join(missing)}: calls with these features "
                         "run the fallback, if asked")
    return out


def export_entry(run_path: Path, entry: dict, board: dict, out: Path, module_name: str = MODULE_NAME,
                 backward: BackwardChoice | None = None) -> list[Path]:
    """One configuration (a leaderboard entry) for every variant of the run's space."""
    check_module_name(module_name)
    run = RunInfo.load(Path(run_path))
    config = MeasuredConfig(entry["key"], entry["key"], dict(entry["config"]), run.space.template, str(run.path))
    winners = []
    from .per_shape import CaseWinner

    for case in entry.get("cases", []):
        shape = run.shape(case["label"])
        if shape is not None:
            winners.append(CaseWinner(case["label"], shape, config.id, float(case["median_us"]), str(run.path), 1))
    per = PerShape([run], winners, {config.id: config}, config.id)
    specs = [_spec(run, config, variant) for variant in run.variants()]
    notes: list[str] = []
    specs += _every_feature_specs([(config, run)], run.variants(), specs, notes)
    measured = {"rank": entry["rank"], "cases": entry["cases"], "geomean_us": entry["geomean_us"],
                "speedup_vs_sdpa": entry["speedup"], "retimed": board.get("retimed"), "resources": entry.get("resources", {})}
    return _write(out, module_name, per, specs, mode="rank", notes=notes, measured=measured, backward=backward)


def check_module_name(name: str) -> None:
    """ExportError unless ``name`` can be the export's package: an identifier that shadows no
    standard or required module."""
    if not runtime.is_identifier(name):
        raise ExportError(f"module name {name!r}: not a Python identifier (letters, digits and _, not first a digit)")
    if name in RESERVED_NAMES or name in getattr(sys, "stdlib_module_names", ()):
        raise ExportError(f"module name {name!r}: would shadow the module of that name; choose another")


def _clear_earlier_export(out: Path, module_name: str) -> None:
    """Remove what an earlier export of ``module_name`` left in ``out`` (its package, or the single
    file of exports before the runtime package); ExportError where something else has that name."""
    package, single = out / module_name, out / f"{module_name}.py"
    if package.exists():
        init = package / "__init__.py"
        if not package.is_dir() or not init.is_file() or not init.read_text(errors="replace").startswith(RUNTIME_MARK):
            raise ExportError(f"{package}: exists and is not an exported runtime package; choose another --out or --module")
        shutil.rmtree(package)
    if single.exists():
        if not single.read_text(errors="replace").startswith(OLD_MODULE_MARK):
            raise ExportError(f"{single}: exists and is not an exported module; choose another --out or --module")
        single.unlink()


def _copy_runtime(package: Path) -> None:
    package.mkdir()
    for source in sorted(RUNTIME_DIR.glob("*.py")):
        shutil.copyfile(source, package / source.name)


def _write(out: Path, module_name: str, per: PerShape, specs: list[KernelSpec], *, mode: str, notes: list[str],
           measured: dict | None, backward: BackwardChoice | None = None) -> list[Path]:
    check_module_name(module_name)
    out.mkdir(parents=True, exist_ok=True)
    _clear_earlier_export(out, module_name)
    written: list[Path] = []
    for spec in specs:
        path = out / f"{module_name}_{spec.filename_stem}.cu"
        path.write_text(spec.rendered.source)
        written.append(path)
    have: dict[tuple[str, int, bool], set[str]] = {(s.dtype, s.variant.head_dim, s.variant.causal): set() for s in specs}
    for s in specs:
        if not getattr(s.variant, "features", ()):  # the dispatch table names configurations with a plain kernel
            have[(s.dtype, s.variant.head_dim, s.variant.causal)].add(s.config_id)
    dispatch: dict[tuple[str, int, bool], tuple[str, list[Any]]] = {}
    for vkey, ids in sorted(have.items()):
        cases = [w for w in per.winners if w.shape.variant_key == vkey and w.config in ids]
        fallback = per.fallback if per.fallback in ids else (cases[0].config if cases else sorted(ids)[0])
        dispatch[vkey] = (fallback, cases)
    hopper = bool(per.runs) and all(run.space.target.arch == "sm_90a" for run in per.runs)
    forwards = {vkey: [Config(per.configs[cid].config) for cid in _largest_first(fallback, cases)]
                for vkey, (fallback, cases) in dispatch.items()} if hopper else {}
    backward_info, backward_files = _backward(out, module_name, specs, replace(backward or BackwardChoice(), hopper=hopper),
                                              forwards)
    written += backward_files
    used = sorted({s.config_id for s in specs})
    fingerprint = json.dumps([sorted((s.key, s.rendered.source_hash) for s in specs),
                              sorted((k, v[0], [(w.shape.batch * w.shape.heads, w.shape.seq_q, w.shape.seq_k,
                                                 max(1, w.shape.heads // w.shape.heads_kv), w.config, w.shape.varlen,
                                                 w.shape.padded)
                                                for w in v[1]])
                                     for k, v in dispatch.items()), backward_info], default=str, sort_keys=True)
    namespace = "evoengineer_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:8]
    gpu, arch = per.runs[0].gpu, per.runs[0].arch
    table = [(w.shape, w.config) for w in per.winners]
    configs = {cid: {"label": per.configs[cid].label(), "short": short_config(per.configs[cid].config),
                     "config": per.configs[cid].config} for cid in used}
    fallback_cfg = per.configs[per.fallback]
    info: dict[str, Any] = {
        "schema": runtime.SCHEMA,
        "module": module_name, "op_namespace": namespace, "op": f"{namespace}::attention", "mode": mode,
        "config": fallback_cfg.config, "key": fallback_cfg.key, "template": fallback_cfg.template,
        "space": per.runs[0].space.name, "arch": arch, "gpu": gpu,
        "runs": [{"path": str(r.path), "space": r.space.name, "gpu": r.gpu, "arch": r.arch} for r in per.runs],
        "configs": {cid: {**configs[cid], "key": per.configs[cid].key, "template": per.configs[cid].template,
                          "run": per.configs[cid].run, "cases_won": sum(1 for w in per.winners if w.config == cid),
                          "variants": sorted(f"{s.dtype} {s.variant.label()}" for s in specs if s.config_id == cid)}
                    for cid in used},
        "dispatch": {
            "rule": DISPATCH_RULE,
            "fallback": per.fallback,
            "variants": [{"dtype": k[0], "head_dim": k[1], "causal": k[2], "fallback": v[0], "measured_cases": len(v[1]),
                          "cases": [{"batch": w.shape.batch, "heads": w.shape.heads, "heads_kv": w.shape.heads_kv,
                                     "seq_q": w.shape.seq_q, "seq_k": w.shape.seq_k, "config": w.config,
                                     **({"varlen": True} if w.shape.varlen else {}),
                                     **({"padded": True} if w.shape.padded else {})} for w in v[1]]}
                         for k, v in dispatch.items()],
            "table": [{"case": w.label, **{f: getattr(w.shape, f) for f in ("dtype", "batch", "heads", "heads_kv", "seq_q",
                                                                          "seq_k", "head_dim", "causal")},
                       **({"lengths": list(w.shape.lengths)} if w.shape.lengths else {}),
                       **({"padded": True} if w.shape.padded else {}),
                       "config": w.config, "config_short": short_config(per.configs[w.config].config),
                       "median_us": w.median_us, "candidates": w.candidates, "sdpa_backend": w.sdpa_backend,
                       "sdpa_us": w.sdpa_us, "speedup_vs_sdpa": w.speedup, "run": w.run}
                      for w in per.winners],
        },
        "decode": _decode_note(per, dispatch, table),
        "kernels": [_kernel_info(s, module_name) for s in specs],
        "notes": notes + (backward_info.pop("notes") if backward_info else []),
        **({"backward": backward_info} if backward_info else {}),
    }
    if measured is not None:
        info.update(rank=measured["rank"], measured=measured, resources=measured.get("resources", {}))
    info_path = out / "kernel.json"
    info_path.write_text(json.dumps(info, indent=2))
    package = out / module_name
    _copy_runtime(package)
    try:  # the package reads exactly this at import: a writer out of step with the reader fails here
        runtime.read_kernel_file(info_path)
    except runtime.KernelFileError as exc:
        raise ExportError(f"the export does not read back: {exc}") from None
    return [package, *written, info_path]


def _largest_first(fallback: str, cases: list[Any]) -> list[str]:
    """A variant's forward configurations, the winner of its largest measured case first (what a
    training step's calls are most like), its fallback last."""
    by_size = sorted(cases, key=lambda w: -w.shape.batch * w.shape.heads * w.shape.seq_q * w.shape.seq_k)
    return list(dict.fromkeys([*(w.config for w in by_size), fallback]))


def _backward(out: Path, module_name: str, specs: list[KernelSpec], choice: BackwardChoice,
              forwards: dict[tuple[str, int, bool], list[Config]]) -> tuple[dict | None, list[Path]]:
    """kernel.json's ``backward`` section (with its ``notes``) and the sources it names, written
    into ``out``; (None, []) where the choice is no backward or no variant has one. ``forwards``:
    each variant's forward configurations, best first, where the LSE forward may be one of them
    (``forward_lse_config``). Each variant also gets an LSE forward and backward kernels built with
    the features a backward holds (``backward_rules.FEATURES``: a window, a soft cap) for the calls
    that ask them (``feature_configs``)."""
    from ..kernels import RenderError, render
    from ..kernels.backward_rules import BACKWARD_TEMPLATE, FEATURES, HEAD_DIMS, forward_lse_config

    if not choice.enabled:
        return None, []
    variants: dict[tuple[str, int, bool], Variant] = {}
    for spec in specs:  # each variant's plain form (the feature kernels follow from it)
        plain = replace(spec.variant, features=()) if getattr(spec.variant, "features", ()) else spec.variant
        variants.setdefault((spec.dtype, spec.variant.head_dim, spec.variant.causal), plain)
    configs: dict[str, dict] = {}
    forward_kernels, kernels, entries, notes, written = [], [], [], [], []
    for (dtype, head_dim, causal), variant in sorted(variants.items()):
        label = f"{dtype} D{head_dim}{' causal' if causal else ''}"
        if head_dim not in HEAD_DIMS:
            notes.append(f"no backward for {label}: the backward supports head dims {', '.join(map(str, HEAD_DIMS))}")
            continue
        lse_config = forward_lse_config(head_dim, forwards.get((dtype, head_dim, causal), ()))
        with_features = replace(variant, features=FEATURES)
        lse = _lse_kernel(lse_config, dtype, variant, label)
        try:
            lse_features = _lse_kernel(lse_config, dtype, with_features, label)
        except ExportError:   # a forward that holds no such feature: the mma LSE forward, which holds them
            lse_features = _lse_kernel(forward_lse_config(head_dim), dtype, with_features, label)
        for spec in (lse, lse_features):
            config = spec.rendered.config
            configs[config.key()] = {"label": config.label(), "short": short_config(dict(config)),
                                     "config": config.to_dict(), "role": "lse_forward"}
            lse_file = f"{module_name}_lse_{spec.filename_stem}.cu"
            (out / lse_file).write_text(spec.rendered.source)
            written.append(out / lse_file)
            forward_kernels.append({**_kernel_info(spec, module_name), "source": lse_file})
        fallback = choice.fallback(dtype, head_dim, causal)
        exact = choice.deterministic_for(dtype, head_dim, causal)
        cases = [m for m in choice.measured if m.shape.variant_key == (dtype, head_dim, causal)]
        builds = [(config, variant) for config in dict.fromkeys([fallback, exact, *(m.config for m in cases)])]
        builds += [(config, with_features) for config in feature_configs(fallback, exact, head_dim)]
        for config, wanted in builds:
            cid = config.key()
            configs[cid] = {"label": config.label(), "short": short_backward(config), "config": config.to_dict(),
                            "role": "backward"}
            try:
                rendered = render(BACKWARD_TEMPLATE, config, wanted)
            except RenderError as exc:
                raise ExportError(f"backward {short_backward(config)} for {label}: {exc}") from None
            source = f"{module_name}_bwd_{cid}-{dtype}-{wanted.label()}.cu"
            (out / source).write_text(rendered.source)
            written.append(out / source)
            kernels.append(backward_kernel_entry(rendered, cid, config, dtype, head_dim, causal, source))
        entries.append({"dtype": dtype, "head_dim": head_dim, "causal": causal, "forward": lse_config.key(),
                        "fallback": fallback.key(), "deterministic": exact.key(), "measured_cases": len(cases),
                        "cases": [{"batch": m.shape.batch, "heads": m.shape.heads, "heads_kv": m.shape.heads_kv,
                                   "seq_q": m.shape.seq_q, "seq_k": m.shape.seq_k, "config": m.config.key(),
                                   "median_us": m.median_us} for m in cases]})
    if not entries:
        return None, written
    return {"rule": DISPATCH_RULE, "configs": configs, "forward_kernels": forward_kernels, "kernels": kernels,
            "variants": entries, "notes": notes}, written


def _lse_kernel(config: Config, dtype: str, variant: Variant, label: str) -> KernelSpec:
    """The LSE forward of ``config`` for ``variant`` (its features' switches included); ExportError
    in one line where it does not render."""
    from ..kernels import RenderError, render
    from ..kernels.backward_rules import FORWARD_TEMPLATE

    try:
        spec = KernelSpec(config.key(), dtype, variant, render(FORWARD_TEMPLATE, config, variant), [])
    except RenderError as exc:
        features = getattr(variant, "features", ())
        raise ExportError(f"LSE forward for {label}{' with ' + ', '.join(features) if features else ''}: {exc}") from None
    spec.args = kernel_args(spec.rendered.source, spec.rendered.launches[0].kernel)
    return spec


def _kernel_info(spec: KernelSpec, module_name: str) -> dict:
    meta = spec.rendered.launch_metadata()
    meta.pop("kernel_args", None)  # the signature this source declares is "args"
    return {**meta, "config": spec.config_id, "params": meta["config"], "dtype": spec.dtype,
            "head_dim": spec.variant.head_dim, "causal": spec.variant.causal,
            "launches": [_launch(launch) for launch in spec.rendered.launches],
            "source": f"{module_name}_{spec.filename_stem}.cu", "args": [list(a) for a in spec.args],
            "features": spec.features}


def _decode_note(per: PerShape, dispatch: dict, table: list[tuple[Shape, str]]) -> dict:
    """Which configurations serve q_len = 1: measured decode cases, and for each non-causal
    variant the configuration a typical decode call (B8, S_k 4096) gets."""
    measured = [{"case": w.label, "config": w.config} for w in per.winners if w.shape.seq_q == 1]
    examples = []
    for (dtype, head_dim, causal), (fallback, _) in dispatch.items():
        if causal:
            continue
        heads = 32 if head_dim >= 128 else 16
        probe = Shape(dtype, 8, heads, heads, 1, 4096, head_dim, False)
        examples.append({"call": probe.label(), "config": nearest(table, probe) or fallback})
    return {
        "measured_cases": measured,
        "configs": sorted({m["config"] for m in measured} | {e["config"] for e in examples}),
        "examples": examples,
        "note": "q_len = 1 (decode) calls go to the nearest measured decode case (S_q = 1) of their variant where it has "
                "any (a search of a decode space, e.g. h100-decode, exported with the prefill run), otherwise to the "
                "nearest case; a split-K/V configuration (SPLITS > 1: K/V split over CTAs, then a combine launch with a "
                "workspace) that wins a decode case serves the decode calls near it; one with SPLITS 0 chooses its "
                "split count per call from the shape (runtime.grid.decode_splits: whole waves of resident CTAs)",
    }


def _launch(launch: Any) -> dict:
    return {"kernel": launch.kernel, "block": list(launch.block), "smem": launch.smem,
            "rows_per_cta": launch.rows_per_cta, "grid_z": launch.grid_z, "persistent": launch.persistent,
            "pack_gqa": launch.pack_gqa, "tile_counter": launch.tile_counter,
            **({"split_tail": {"counter_words_per_cta": launch.split_tail[0], "floats_per_cta": launch.split_tail[1]}}
               if launch.split_tail else {}), **auto_split_json(launch)}
