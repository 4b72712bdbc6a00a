"""Export a leaderboard entry as a drop-in kernel: CUDA sources, launch metadata, and a
Python module with ``attention(q, k, v, is_causal=False, scale=None)`` that needs only
torch and cupy."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2

from ..resources import templates_dir
from ..search import RunDir
from ..space import Config, load_space

MODULE_NAME = "evo_attention"


def export_entry(run_path: Path, entry: dict, board: dict, out: Path, module_name: str = MODULE_NAME) -> list[Path]:
    """Write ``<out>/<module>.py``, one ``.cu`` per problem variant and ``kernel.json``."""
    from ..kernels import from_source, render
    from ..space import Variant

    run = RunDir(Path(run_path))
    meta = run.meta()
    space = load_space(run.path / "space.yaml")
    config = Config(entry["config"])
    out.mkdir(parents=True, exist_ok=True)
    variants = sorted({Variant(d, c, t) for d in {v.head_dim for v in space.variants} for c in (False, True) for t in space.dtypes},
                      key=lambda v: (v.head_dim, v.causal, v.dtype))
    kernels, written = [], []
    for variant in variants:
        measured = run.path / "sources" / f"{config.key()}-{variant.label()}.cu"
        # the source that was measured, where the run kept it; variants outside the space are rendered now
        rendered = (from_source(space.template, config, variant, measured.read_text()) if measured.exists()
                    else render(space.template, config, variant))
        cu = out / f"{module_name}_{variant.label()}.cu"
        cu.write_text(rendered.source)
        written.append(cu)
        kernels.append({
            "head_dim": variant.head_dim, "causal": variant.causal, "dtype": variant.dtype, "rendered": rendered,
            "launches_json": json.dumps(rendered.launch_metadata()["launches"]),
            "workspace": rendered.workspace_floats_per_row, "source_literal": repr(rendered.source),
        })
    figures = ", ".join(f"{c['label']}: {c['median_us']:.2f} µs" for c in entry["cases"])
    speed = ", ".join(f"{b} {s:.2f}x" for b, s in entry["speedup"].items() if s)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    module = env.get_template("_export_module.py.j2").render(
        config_label=config.label(), gpu=board.get("gpu", "?"), arch=meta.get("arch", space.target.arch), space=space.name,
        figures=f"{figures}; speedup over SDPA (geomean): {speed or 'n/a'}", module_name=module_name,
        config_json=repr(config.to_dict()), head_dims=sorted({k["head_dim"] for k in kernels}), kernels=kernels,
        dtypes=list(space.dtypes),
    )
    module_path = out / f"{module_name}.py"
    module_path.write_text(module)
    info = {
        "config": config.to_dict(), "key": config.key(), "template": space.template, "space": space.name,
        "arch": meta.get("arch", space.target.arch), "gpu": board.get("gpu"), "rank": entry["rank"],
        "measured": {"cases": entry["cases"], "geomean_us": entry["geomean_us"], "speedup_vs_sdpa": entry["speedup"],
                     "retimed": board.get("retimed")},
        "resources": entry.get("resources", {}),
        "kernels": [{"head_dim": k["head_dim"], "causal": k["causal"], "dtype": k["dtype"], "source": f"{module_name}_{k['rendered'].variant.label()}.cu",
                     **k["rendered"].launch_metadata()} for k in kernels],
    }
    info_path = out / "kernel.json"
    info_path.write_text(json.dumps(info, indent=2))
    return [module_path, *written, info_path]
