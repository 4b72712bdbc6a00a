"""The export runtime (``evoengineer/runtime``) without a GPU: the dispatch rule, kernel.json
reading and checking, the fake implementation, tensor-map encoding through a stand-in driver,
grids, and exports whose names carry hostile text, imported in a fresh process on CPU."""
from __future__ import annotations

import copy
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_fixtures import load_module, make_run, stand_in_driver
from torch._subclasses.fake_tensor import FakeTensorMode

from evoengineer.space.model import path_component  # the space name as the parser keeps it
from evoengineer import runtime
from evoengineer.results import ExportError, Shape, export_runs, nearest
from evoengineer.runtime import launch as runtime_launch
from evoengineer.runtime import tensormap
from evoengineer.runtime.dispatch import DispatchTable, MeasuredCase, NoKernelError, VariantTable, nearest_index
from evoengineer.runtime.exported import ExportedAttention
from evoengineer.runtime.kernel_file import SCHEMA, KernelFileError, LaunchSpec, TensorMapSpec, read_kernel_file
from evoengineer.runtime.grid import counter_words, grid

REPO = Path(__file__).resolve().parent.parent
RUNTIME_DIR = REPO / "evoengineer" / "runtime"

# -- the dispatch rule -------------------------------------------------------------------------------


def case(batch: int, heads: int, seq_q: int, seq_k: int, config: str, heads_kv: int | None = None) -> MeasuredCase:
    return MeasuredCase(batch, heads, heads_kv or heads, seq_q, seq_k, config)


def test_the_nearest_case_in_log_space_wins_and_ties_go_to_the_earlier_case() -> None:
    cases = [case(1, 8, 512, 512, "small"), case(4, 16, 2048, 2048, "large")]
    assert nearest_index(cases, 1, 8, 8, 600, 600) == 0
    assert nearest_index(cases, 8, 16, 16, 4096, 4096) == 1
    # a tie (here: S_q above one case by as much as S_k below the other) goes to the earlier case
    tied = [case(1, 8, 512, 1024, "first"), case(1, 8, 1024, 512, "second")]
    assert nearest_index(tied, 1, 8, 8, 1024, 1024) == 0 and nearest_index(tied[::-1], 1, 8, 8, 1024, 1024) == 0
    assert nearest_index([], 1, 8, 8, 1, 1) is None
    # H/H_kv is a coordinate: a grouped case is nearer to a grouped call
    grouped = [case(2, 32, 2048, 2048, "mha"), case(2, 32, 2048, 2048, "gqa", heads_kv=8)]
    assert nearest_index(grouped, 2, 32, 8, 2048, 2048) == 1 and nearest_index(grouped, 2, 32, 32, 2048, 2048) == 0


def test_a_decode_call_looks_only_at_decode_cases_where_there_are_any() -> None:
    prefill, decode = case(8, 32, 1, 16, "prefill"), case(1, 1, 1, 65536, "decode")
    prefill = MeasuredCase(8, 32, 32, 4, 16, "prefill")     # S_q 4: not a decode case, and nearer in distance
    assert nearest_index([prefill, decode], 8, 32, 32, 1, 16) == 1
    assert nearest_index([prefill, decode], 8, 32, 32, 2, 16) == 0     # S_q 2 is no decode call
    assert nearest_index([prefill], 8, 32, 32, 1, 16) == 0


def test_the_table_falls_back_per_variant_and_names_what_it_covers() -> None:
    table = DispatchTable({("fp16", 64, False): VariantTable("fb", (case(1, 8, 512, 512, "a"),)),
                           ("fp16", 128, True): VariantTable("fb2")})
    assert table.choose("fp16", 64, False, 9, 9, 9, 9) == "a"
    assert table.choose("fp16", 128, True, 9, 9, 9, 9) == "fb2"
    with pytest.raises(NoKernelError, match=r"^attention: no exported kernel for bf16 head_dim 64; this module covers "
                                            r"fp16 D64, fp16 D128 causal$"):
        table.choose("bf16", 64, False, 1, 1, 1, 1)


def test_the_search_and_the_runtime_apply_one_rule() -> None:
    """``results.nearest`` (the per-shape table, in Shapes) against the table of the runtime."""
    rng = random.Random(3)
    dims = lambda: (rng.choice([1, 2, 8]), rng.choice([8, 32]), rng.choice([1, 2, 8, 32]), rng.choice([1, 100, 4096]),  # noqa: E731
                    rng.choice([64, 4096]))
    shapes = []
    for i in range(40):
        b, h, g, sq, sk = dims()
        shapes.append((Shape("fp16", b, h, max(1, h // g), sq, sk, rng.choice([64, 128]), rng.random() < 0.5), f"c{i % 7}"))
    table = DispatchTable({v: VariantTable("fallback", tuple(MeasuredCase(s.batch, s.heads, s.heads_kv, s.seq_q, s.seq_k, c)
                                                             for s, c in shapes if s.variant_key == v))
                           for v in {s.variant_key for s, _ in shapes}})
    for _ in range(300):
        b, h, g, sq, sk = dims()
        probe = Shape("fp16", b, h, max(1, h // g), sq, sk, rng.choice([64, 128]), rng.random() < 0.5)
        if probe.variant_key in table.variants:
            assert table.choose(*probe.variant_key, b, h, sq, sk, probe.heads_kv) == nearest(shapes, probe)


# -- grids --------------------------------------------------------------------------------------


def test_grids_of_plain_packed_and_persistent_launches() -> None:
    plain = LaunchSpec("f", (128, 1, 1), 0, 64, grid_z=2)
    assert grid(plain, 2, 8, 8, 100, 132) == (2, 16, 2)
    packed = LaunchSpec("f", (128, 1, 1), 0, 64, pack_gqa=True)
    assert grid(packed, 3, 32, 4, 1, 132) == (1, 12, 1)        # 8 query heads of a K/V head in one block row
    persistent = LaunchSpec("f", (384, 1, 1), 0, 128, persistent=True, tile_counter=True, split_tail=(2, 4096))
    assert grid(persistent, 4, 16, 16, 2048, 132) == (132, 1, 1) and grid(persistent, 1, 1, 1, 128, 132) == (1, 1, 1)
    assert counter_words(persistent, 1, 1, 128, 132) == (1, 1)                       # fewer tiles than multiprocessors
    zeroed = 1 + 132 * 2
    assert counter_words(persistent, 4, 16, 2048, 132) == ((zeroed + 3) // 4 * 4 + 132 * 4096, zeroed)


# -- kernel.json ----------------------------------------------------------------------------------

ARGS = [["Q", "ptr"], ["K", "ptr"], ["V", "ptr"], ["O", "ptr"], ["WS", "ptr"], ["B", "i32"], ["H", "i32"],
        ["H_kv", "i32"], ["S_q", "i32"], ["S_k", "i32"], *[[f"{t}_s{d}", "i64"] for t in "qkvo" for d in "bhs"],
        ["scale_log2", "f32"]]
_NAMESPACES = itertools.count()


def kernel_doc(namespace: str | None = None) -> dict:
    """A small valid kernel.json: one configuration "a" for fp16 D64 (full and causal), a second
    "b" that wins a measured case of fp16 D64."""
    kernel = {"config": "a", "dtype": "fp16", "head_dim": 64, "causal": False, "source": "a.cu", "args": ARGS,
              "launches": [{"kernel": "attn_fwd", "block": [128, 1, 1], "smem": 0, "rows_per_cta": 64}],
              "workspace_floats_per_row": 0, "features": ["gqa"], "tensor_maps": []}
    return {
        "schema": SCHEMA, "module": "evo_attention", "op_namespace": namespace or f"evotest_{os.getpid()}_{next(_NAMESPACES)}",
        "arch": "sm_90", "gpu": "NVIDIA H100",
        "configs": {cid: {"label": f"X={cid}", "short": f"mma {cid}", "config": {"X": cid}} for cid in ("a", "b")},
        "dispatch": {"rule": runtime.DISPATCH_RULE, "fallback": "a", "variants": [
            {"dtype": "fp16", "head_dim": 64, "causal": False, "fallback": "a",
             "cases": [{"batch": 1, "heads": 8, "heads_kv": 8, "seq_q": 512, "seq_k": 512, "config": "b"}]},
            {"dtype": "fp16", "head_dim": 64, "causal": True, "fallback": "a", "cases": []}]},
        "kernels": [kernel, {**kernel, "causal": True}, {**kernel, "config": "b", "source": "b.cu"}],
    }


def write_export(directory: Path, doc: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("a.cu", "b.cu"):
        (directory / name).write_text(f"// {name}\nextern \"C\" __global__ void attn_fwd() {{}}\n")
    path = directory / "kernel.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_kernel_file_reads_into_typed_values(tmp_path: Path) -> None:
    data = read_kernel_file(write_export(tmp_path, kernel_doc("evotest_read")))
    assert data.op_namespace == "evotest_read" and data.dtypes == ["fp16"] and data.head_dims == [64]
    spec = data.kernels[("fp16", 64, False, "b")]
    assert spec.args[0] == ("Q", "ptr") and spec.launches[0].block == (128, 1, 1) and spec.gqa
    assert spec.source.startswith("// b.cu")
    assert data.dispatch[("fp16", 64, False)].cases == (MeasuredCase(1, 8, 8, 512, 512, "b"),)
    assert data.variant_gqa() == {("fp16", 64, False): True, ("fp16", 64, True): True}


def _set(doc: dict, path: str, value: object) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split("/")
    target = doc
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return doc


BROKEN = {
    "no schema": ("schema", KeyError, "no schema .*an export of an earlier EvoEngineer.*re-export"),
    "foreign schema": ("schema", "someone-else/7", 'schema "someone-else/7"; this runtime reads evoengineer-attention-export/2'),
    "not an object": ("kernels/0", [], r"kernels\[0\]: expected an object"),
    "namespace with code": ("op_namespace", "x; import os", r"op_namespace: \"x; import os\" is not a Python identifier"),
    "block of two": ("kernels/0/launches/0/block", [128, 1], r"kernels\[0\]\.launches\[0\]\.block: expected 3 integers"),
    "bool for an int": ("kernels/0/head_dim", True, r"kernels\[0\]\.head_dim: expected an integer"),
    "unknown argument": ("kernels/0/args/5", ["alpha", "i32"], r"kernels\[0\]\.args\[5\]: \"alpha\" is not an argument"),
    "source outside": ("kernels/0/source", "../a.cu", r"kernels\[0\]\.source: \"../a.cu\" is not a .cu file name"),
    "source missing": ("kernels/0/source", "gone.cu", r"gone.cu: cannot read the kernel source"),
    "case without kernel": ("dispatch/variants/1/cases", [{"batch": 1, "heads": 1, "heads_kv": 1, "seq_q": 1, "seq_k": 1,
                                                           "config": "b"}],
                            r"dispatch\.variants\[1\]\.cases\[0\]\.config: \"b\" has no kernel for fp16 D64 causal"),
    "fallback unknown": ("dispatch/fallback", "zzz", r"dispatch\.fallback: \"zzz\" is not one of configs"),
    "tensor map without argument": ("kernels/0/tensor_maps", [{"arg": "tm_q", "tensor": "q", "box": [64, 64], "swizzle": 128}],
                                    r"kernels\[0\]\.tensor_maps: must describe each tensor-map argument"),
    "launch kernel name": ("kernels/0/launches/0/kernel", "a(b)", r"launches\[0\]\.kernel: \"a\(b\)\" is not a kernel name"),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_a_broken_kernel_file_is_one_line_naming_the_file_and_the_key(tmp_path: Path, what: str) -> None:
    key, value, message = BROKEN[what]
    path = write_export(tmp_path, _set(kernel_doc(), key, value))
    with pytest.raises(KernelFileError) as caught:
        read_kernel_file(path)
    text = str(caught.value)
    assert "\n" not in text and "re-export" in text and str(tmp_path) in text, text
    assert __import__("re").search(message, text), text


def test_a_kernel_file_that_is_no_json_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "kernel.json").write_text('{"schema": ')
    with pytest.raises(KernelFileError, match=r"kernel.json: not JSON .*re-export"):
        read_kernel_file(tmp_path / "kernel.json")


# -- the op on fake tensors -------------------------------------------------------------------


def test_the_fake_implementation_gives_the_output_meta_and_checks_the_call(tmp_path: Path) -> None:
    export = ExportedAttention.load(write_export(tmp_path, kernel_doc()))
    assert export.dispatch(torch.float16, 64, False, 1, 8, 512, 512) == "b" and export.dispatch("fp16", 64, True, 1, 8, 1, 1) == "a"
    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.float16, device="cuda")
        kv = torch.empty(2, 2, 300, 64, dtype=torch.float16, device="cuda")
        for out in (export.attention(q, kv, kv, is_causal=True, enable_gqa=True), export.op(q, kv, kv, False, 0.1, True)):
            assert (out.shape, out.dtype, out.device.type) == ((2, 8, 100, 64), torch.float16, "cuda")
        with pytest.raises(ValueError, match="^attention: no exported kernel for fp16 head_dim 128"):
            export.attention(*(torch.empty(1, 1, 8, 128, dtype=torch.float16, device="cuda"),) * 3)
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            export.attention(q, kv, kv)
    graph = torch.compile(lambda q, k, v: export.attention(q, k, v).sum(), fullgraph=True, backend="eager")
    with FakeTensorMode():   # traced through the op, never run
        q = torch.empty(1, 8, 16, 64, dtype=torch.float16, device="cuda")
        assert graph(q, q, q).shape == ()


def test_a_second_copy_of_an_export_shares_its_op(tmp_path: Path) -> None:
    doc = kernel_doc()
    first = ExportedAttention.load(write_export(tmp_path / "one", doc))
    second = ExportedAttention.load(write_export(tmp_path / "two", doc))
    assert first.op is second.op is getattr(torch.ops, doc["op_namespace"]).attention.default


# -- tensor maps through a stand-in driver -------------------------------------------------------


def test_a_tma_plan_encodes_each_map_once_and_repoints_it_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's tensor maps: the encoder's arguments per map (the output's at q's address
    until a call re-points it), then a replace only for a tensor that moved."""
    maps = [{"arg": f"tm_{t}", "tensor": t, "box": [64, 128], "swizzle": 128} for t in ("q", "k", "out")]
    doc = _set(kernel_doc(), "kernels/0/tensor_maps", maps)
    doc = _set(doc, "kernels/0/args", ARGS + [[m["arg"], "tmap"] for m in maps])
    export = ExportedAttention.load(write_export(tmp_path, doc))
    spec = export.data.kernels[("fp16", 64, False, "a")]
    assert [m.arg for m in spec.tensor_maps] == ["tm_q", "tm_k", "tm_out"] and isinstance(spec.tensor_maps[0], TensorMapSpec)
    calls: list = []
    drv, _keep = stand_in_driver(calls)
    monkeypatch.setattr(tensormap, "_DRIVER", [drv])
    q = torch.empty(2, 300, 4, 64, dtype=torch.float16).transpose(1, 2)      # (B, S, H, D) storage
    k = torch.empty(2, 4, 500, 64, dtype=torch.float16)
    slots, at, keep = export.launcher._encode_maps(spec, q, k, k, torch.empty_like(q, device="meta"))
    assert [s[0] for s in slots] == [0, 1, 3] and at["tm_k"] == slots[1][1] and keep
    geometry = tensormap.map_geometry(spec.tensor_maps[1], k.shape, k.stride(), "fp16")
    assert calls[1] == ("encode", at["tm_k"], 6, 4, k.data_ptr(), list(geometry.dims), list(geometry.strides),
                        [64, 128, 1, 1], [1, 1, 1, 1], 0, 3, 3, 0)
    assert calls[0][4] == calls[2][4] == q.data_ptr() and calls[0][5] == [64, 300, 4, 2]
    del calls[:]
    runtime_launch.repoint(slots, (q.data_ptr(), k.data_ptr(), k.data_ptr(), q.data_ptr()))
    assert calls == []                                                       # nothing moved
    runtime_launch.repoint(slots, (q.data_ptr(), 0x60000, k.data_ptr(), 0x90000))
    assert calls == [("replace", at["tm_k"], 0x60000), ("replace", at["tm_out"], 0x90000)]
    expanded = torch.empty(2, 1, 500, 64, dtype=torch.float16).expand(2, 4, 500, 64)
    with pytest.raises(ValueError, match=r"^attention: tensor map tm_k: k's heads stride 0"):
        export.launcher._encode_maps(spec, q, expanded, expanded, torch.empty_like(q, device="meta"))


# -- exports ---------------------------------------------------------------------------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def import_alone(out: Path, code: str, name: str = "evo_attention") -> subprocess.CompletedProcess:
    """Import the export at ``out`` in a fresh CPU-only process where evoengineer is not importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    script = ("import sys; sys.modules['evoengineer'] = None; sys.path.insert(0, sys.argv[1])\n"
              f"import {name} as m\n{code}")
    return subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=out, env=env,
                          timeout=120)


HOSTILE = ('x"""\nimport pathlib; pathlib.Path({marker!r}).write_text("ran")\n"""\n'
           "'''\nimport pathlib; pathlib.Path({marker!r}).write_text('ran')\n'''\n"
           "{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}\n{{% raw %}}\n#")


def test_an_export_of_hostile_names_runs_none_of_them(tmp_path: Path) -> None:
    """A space name and a GPU name that close the docstrings and template tags of a generated
    module: the export holds them as JSON data only, and importing it runs none of them."""
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(marker=str(marker))
    run = make_run(tmp_path / "run", name=hostile, gpu=hostile)
    done = cli("export", str(run), "--out", str(tmp_path / "best"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "best"
    info = json.loads((out / "kernel.json").read_text())
    assert info["space"] == path_component(hostile, "space") and info["gpu"] == hostile and info["runs"][0]["gpu"] == hostile
    # the package is the runtime, byte for byte: nothing of the run is in its code
    assert sorted(p.name for p in (out / "evo_attention").glob("*.py")) == sorted(p.name for p in RUNTIME_DIR.glob("*.py"))
    for path in RUNTIME_DIR.glob("*.py"):
        assert (out / "evo_attention" / path.name).read_bytes() == path.read_bytes(), path.name
    probe = import_alone(out, "print(m.GQA, m.FALLBACK, len(m.KERNELS), m.OP_NAMESPACE.isidentifier(), 'cupy' in sys.modules)")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split()[0] == "True" and probe.stdout.split()[-2:] == ["True", "False"], probe.stdout
    assert not marker.exists()


def test_an_old_or_foreign_kernel_file_fails_import_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_runs([make_run(tmp_path / "run")], out)
    info = json.loads((out / "kernel.json").read_text())
    for schema in (None, "evoengineer-attention-export/1"):
        changed = {k: v for k, v in info.items() if k != "schema"} | ({"schema": schema} if schema else {})
        (out / "kernel.json").write_text(json.dumps(changed))
        probe = import_alone(out, "")
        last = probe.stderr.strip().splitlines()[-1]
        assert probe.returncode == 1 and last.startswith("ImportError: ") and last.endswith("re-export with `evoengineer export`")
        assert str(out / "kernel.json") in last


def test_module_names_are_identifiers_and_an_earlier_export_is_replaced(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    for bad in ("evo-attention", "x; import os", "class", "1st", "os", "torch", "é"):
        with pytest.raises(ExportError, match="module name"):
            export_runs([run], tmp_path / "x", module_name=bad)
    assert not (tmp_path / "x").exists()
    done = cli("export", str(run), "--out", str(tmp_path / "x"), "--module", "a b", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a Python identifier" in done.stderr

    out = tmp_path / "out"
    out.mkdir()
    (out / "my_attn.py").write_text('"""FlashAttention forward found by EvoEngineer, 1 configuration(s)\n"""\n')
    (out / "my_attn").mkdir()
    (out / "my_attn" / "__init__.py").write_text('"""The runtime of an exported attention module, an older one"""\n')
    (out / "my_attn" / "stale.py").write_text("")
    written = export_runs([run], out, module_name="my_attn")
    assert written[0] == out / "my_attn" and not (out / "my_attn.py").exists() and not (out / "my_attn" / "stale.py").exists()
    module = load_module(out, "my_attn")
    assert module.dispatch("fp16", 64, False, 1, 8, 512, 512) and json.loads((out / "kernel.json").read_text())["module"] == "my_attn"
    (out / "mine").mkdir()
    (out / "mine" / "__init__.py").write_text("# someone's own package\n")
    with pytest.raises(ExportError, match="mine: exists and is not an exported runtime package"):
        export_runs([run], out, module_name="mine")
    assert (out / "mine" / "__init__.py").read_text() == "# someone's own package\n"
