"""LOAD=tma on the backward's wgmma path without a GPU: the template's tensor-map declarations and
kernel parameters, the rules, the SASS (TMA loads, no cp.async in the dK/dV kernel), renders with
LOAD unset or cpasync unchanged, the maps' geometry (4-D over q, k, v, do; 1-D over the LSE and D),
the driver's arguments through a stand-in, the packed argument block, and the export's kernel.json."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
from run_fixtures import make_run, stand_in_driver

from evoengineer import paths
from evoengineer.kernels import RenderError, compile_many, render
from evoengineer.kernels.backward_rules import (
    BACKWARD_TEMPLATE,
    WGMMA_CONFIGS,
    backward_arguments,
    backward_launch_arguments,
    backward_launches,
    problems,
    smem_bytes,
    wgmma_config,
)
from evoengineer.kernels.render import TensorMapArg, parameter_kinds
from evoengineer.kernels.sass import disassemble, nvdisasm, opcodes
from evoengineer.runtime import tensormap
from evoengineer.runtime.arguments import pack_arguments
from evoengineer.runtime.backward_file import TENSOR_MAP_TENSORS
from evoengineer.runtime.backward_launch import BackwardLauncher, map_layouts, map_pointers
from evoengineer.runtime.launch import repoint
from evoengineer.space import Variant, load_space

TMA = wgmma_config(64, 128, producer=1, load="tma")
CPASYNC = wgmma_config(64, 128, producer=1)
MAPS = paths.wgmma_backward.TENSOR_MAPS


def test_the_tma_variant_declares_four_maps_taken_by_the_dkdv_kernel_only() -> None:
    rendered = render(BACKWARD_TEMPLATE, TMA, Variant(128, True, "bf16"))
    assert [(m.arg, m.tensor, m.box, m.swizzle) for m in rendered.tensor_maps] == [
        ("tm_q", "q", (64, 64), 128), ("tm_k", "k", (64, 128), 128), ("tm_v", "v", (64, 128), 128),
        ("tm_do", "do", (64, 64), 128)]
    assert tuple(m.tensor for m in rendered.tensor_maps) == MAPS == TENSOR_MAP_TENSORS
    # the dK/dV kernel's parameters: the backward's, then the maps in their declared order
    head = rendered.source.split(" attn_bwd_dkdv(", 1)[1].split(") {", 1)[0]
    assert parameter_kinds(" ".join(head.split())) == backward_launch_arguments(rendered)
    assert backward_launch_arguments(rendered)[-4:] == [(f"tm_{t}", "tmap") for t in MAPS]
    for kernel in ("attn_bwd_pre", "attn_bwd_dq_convert"):
        params = rendered.source.split(f" {kernel}(", 1)[1].split(") {", 1)[0]
        assert parameter_kinds(" ".join(params.split())) == backward_arguments(rendered)
    # one expect_tx a stage: Q and dO (2 BM D bytes each); K and V once; LSE and D by the producer's 128 threads
    assert "STAGE_TX = 4u * BM * D;" in rendered.source and "KV_TX = 4u * BN * D;" in rendered.source
    assert "mbar_init(bars + 8 * s, 1 + LSE_THREADS);" in rendered.source and "LSE_THREADS = DQ_BULK ? 64 : 128;" in rendered.source
    assert "constexpr bool DQ_BULK = false;" in rendered.source and "mbar_wait(bars + KV_BAR, 0);" in rendered.source
    launches = backward_launches(rendered)
    assert launches[1].smem == smem_bytes(TMA, 128)["attn_bwd_dkdv"] == smem_bytes(CPASYNC, 128)["attn_bwd_dkdv"] + 16
    cpasync = render(BACKWARD_TEMPLATE, CPASYNC, Variant(128, True, "bf16"))
    assert not cpasync.tensor_maps and "TENSOR_MAP" not in cpasync.source and "CUtensorMap" not in cpasync.source


def test_load_cpasync_renders_as_load_left_out() -> None:
    for config in (CPASYNC, wgmma_config(64, 64, stages=1), WGMMA_CONFIGS[64]["w128n128-pr"]):
        variant = Variant(64, True, "fp16")
        unset = render(BACKWARD_TEMPLATE, config, variant).source
        explicit = render(BACKWARD_TEMPLATE, config.replace(LOAD="cpasync"), variant).source
        assert unset.split("\n", 1)[1] == explicit.split("\n", 1)[1]   # the first line names the configuration


def test_the_rules_and_the_template_refuse_tma_without_a_producer() -> None:
    for config in (wgmma_config(64, 128, load="tma"), wgmma_config(64, 128, producer=1, load="bulk")):
        assert any("wgmma.load" in p for p in problems(config, 64)), config.label()
        with pytest.raises(RenderError, match="BWD_WGMMA_REQUIRES_LOAD_CPASYNC_OR_TMA_WITH_A_PRODUCER"):
            render(BACKWARD_TEMPLATE, config, Variant(64, False, "fp16"))
    assert not problems(TMA, 64) and not problems(TMA, 128)


def test_dq_mode_bulk_needs_tma_and_reduces_dq_by_bulk_reductions() -> None:
    """DQ_MODE bulk: refused without LOAD tma (rules and template); its shared memory is the path rule's (the
    template's static_assert compiles); the dK/dV kernel's SASS adds dQ by bulk reductions (UBLKRED), the
    atomic twin by vector reductions only."""
    cpasync = wgmma_config(64, 128, producer=1, dq_mode="bulk")
    assert [p for p in problems(cpasync, 128) if "wgmma." in p] and all("wgmma.dq-bulk" in p for p in problems(cpasync, 128))
    with pytest.raises(RenderError, match="BWD_WGMMA_REQUIRES_DQ_MODE_ATOMIC_OR_BULK_WITH_LOAD_TMA"):
        render(BACKWARD_TEMPLATE, cpasync, Variant(128, False, "fp16"))
    bulk = WGMMA_CONFIGS[128]["w64n128-bulk"]
    assert bulk == TMA.replace(DQ_MODE="bulk") and not problems(bulk, 128)
    rendered = render(BACKWARD_TEMPLATE, bulk, Variant(128, True, "bf16"))
    assert backward_launches(rendered)[1].smem == smem_bytes(bulk, 128)["attn_bwd_dkdv"] == \
        smem_bytes(TMA, 128)["attn_bwd_dkdv"] + 2 * 64 * 128 + 4 * 64 * 128   # dS^T's second buffer, dQ's fp32 tile
    results = list(compile_many([rendered.source, render(BACKWARD_TEMPLATE, TMA, Variant(128, True, "bf16")).source], "sm_90a"))
    assert all(r.ok and r.spill_bytes == 0 and not r.wgmma_serialized for r in results), [r.error for r in results]
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    ops = [opcodes(disassemble(r.cubin_path, tool).split(".text.attn_bwd_dkdv:", 1)[1].split(".section", 1)[0])
           for r in results]
    assert any(op.startswith("UBLKRED") for op in ops[0]), ops[0]
    assert not any(op.startswith("UBLKRED") for op in ops[1]) and any(op.startswith("RED") for op in ops[1]), ops[1]


def test_the_space_holds_the_tma_variants_a_named_one_and_a_seed() -> None:
    space = load_space("h100-backward")
    valid = {c for c in space.valid_configs() if c["PATH"] == "wgmma"}
    tma = {c for c in valid if c["LOAD"] == "tma" and c["DQ_MODE"] == "atomic"}
    # every producer configuration has its TMA twin
    assert tma and {c.replace(LOAD="cpasync") for c in tma} == {
        c for c in valid if c["PRODUCER"] == 1 and c["LOAD"] == "cpasync"}
    assert space.complete(TMA) in tma and space.complete(TMA) in set(space.search.seeds)
    assert WGMMA_CONFIGS[64]["w64n128-tma"] == WGMMA_CONFIGS[128]["w64n128-tma"] == TMA
    assert TMA.short_label() == "bwg 64x128 st2 pr tma dq=atomic"


def test_the_tma_dkdv_kernel_loads_by_tma_and_compiles_without_spills() -> None:
    builds = [(c, Variant(d, causal, dtype)) for d, c in ((64, WGMMA_CONFIGS[64]["w128n128-tma"]), (128, TMA))
              for causal in (False, True) for dtype in ("fp16", "bf16")]
    results = list(compile_many([render(BACKWARD_TEMPLATE, c, v).source for c, v in builds], "sm_90a", workers=2))
    assert all(r.ok and r.spill_bytes == 0 and not r.wgmma_serialized for r in results), \
        [r.error or r.log[-300:] for r in results]
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    for (config, variant), result in zip(builds[:2], results[:2]):
        sass = disassemble(result.cubin_path, tool)
        dkdv = sass.split(".text.attn_bwd_dkdv:", 1)[1].split(".section", 1)[0]
        ops = opcodes(dkdv)
        assert ops["UTMALDG.4D"] >= 2 and "UTMALDG.1D" not in ops, ops
        # cp.async only for LSE and D: 4-byte copies (Q and dO, 16-byte ones in the cp.async variant, by TMA)
        assert any(op.startswith("LDGSTS") for op in ops), ops
        assert not any(op.startswith("LDGSTS") and ".128" in op for op in ops), ops
    cpasync = next(compile_many([render(BACKWARD_TEMPLATE, CPASYNC, Variant(128, False, "fp16")).source], "sm_90a"))
    ops = opcodes(disassemble(cpasync.cubin_path, tool).split(".text.attn_bwd_dkdv:", 1)[1].split(".section", 1)[0])
    assert any(op.startswith("LDGSTS") for op in ops) and not any(op.startswith("UTMALDG") for op in ops)


# -- the host side -------------------------------------------------------------------------------


def _tensors(batch: int = 2, heads: int = 8, heads_kv: int = 2, seq_q: int = 77, seq_k: int = 301, d: int = 128):
    q = torch.empty(batch, heads, seq_q, d, dtype=torch.float16)
    k = torch.empty(batch, seq_k, heads_kv, d, dtype=torch.float16).transpose(1, 2)   # (B, S, H, D) storage
    v = torch.empty(batch, heads_kv, seq_k, d, dtype=torch.float16)
    do = torch.empty(batch, heads, seq_q, d, dtype=torch.float16)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32)
    return q, k, v, do, lse


def test_the_maps_describe_each_tensor_with_its_own_strides() -> None:
    q, k, v, do, _ = _tensors()
    layouts = map_layouts(q, k, v, do)
    assert len(layouts) == len(TENSOR_MAP_TENSORS) == 4
    g = tensormap.map_geometry(TensorMapArg("tm_do", "do", (64, 128), 128), *layouts[3], "fp16")
    assert (g.dims, g.box) == ((128, 77, 8, 2), (64, 128, 1, 1))
    g = tensormap.map_geometry(TensorMapArg("tm_k", "k", (64, 128), 128), *layouts[1], "fp16")
    assert g.strides == (2 * 256, 256, 301 * 2 * 256)   # k's (B, S, H, D) storage


def test_a_backward_plan_encodes_its_maps_and_packs_them_after_the_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    drv, _keep = stand_in_driver(calls)
    monkeypatch.setattr(tensormap, "_DRIVER", [drv])
    rendered = render(BACKWARD_TEMPLATE, TMA, Variant(128, False, "fp16"))

    class Spec:   # what the launcher reads of a BackwardKernelSpec
        tensor_maps = rendered.tensor_maps
        dtype = "fp16"

    q, k, v, do, _ = _tensors()
    slots, at, keep = BackwardLauncher._encode_maps(Spec, q, k, v, do)
    assert [s[0] for s in slots] == list(range(4)) and keep and list(at) == [f"tm_{t}" for t in MAPS]
    assert [c[3] for c in calls] == [4, 4, 4, 4]                              # ranks
    assert calls[1][4] == k.data_ptr() and calls[1][5] == [128, 301, 2, 2] and calls[1][7] == [64, 128, 1, 1]
    assert calls[1][6] == [2 * 256, 256, 301 * 2 * 256]                       # k's (B, S, H, D) storage
    assert calls[3][4] == do.data_ptr() and calls[3][7] == [64, 64, 1, 1]
    # the argument block: every backward argument by value, then the maps by address
    args = backward_launch_arguments(rendered)
    values = {name: 0 for name, kind in args if kind != "tmap"}
    packed = pack_arguments(args, values, at)
    params = ctypes.cast(packed.address, ctypes.POINTER(ctypes.c_void_p))
    assert [params[i] for i in range(len(args) - 4, len(args))] == [at[f"tm_{t}"] for t in MAPS]
    assert params[0] == ctypes.addressof(packed.values)
    # a call re-points the maps whose tensors moved: dO to another tensor
    del calls[:]
    other = torch.empty_like(do)
    repoint(slots, map_pointers(q, k, v, other))
    assert calls == [("replace", at["tm_do"], other.data_ptr())]


def test_an_export_carries_the_tma_backward_and_reads_it_back(tmp_path: Path) -> None:
    from evoengineer.results import export_runs
    from evoengineer.results.export_backward import backward_choice
    from evoengineer.runtime.kernel_file import TensorMapSpec, read_kernel_file

    export_runs([make_run(tmp_path / "run")], tmp_path / "out", backward=backward_choice(["w64n128-tma"]))
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())["backward"]
    tma = [k for k in info["kernels"] if k["config"] == TMA.key()]
    # every variant's plain kernel and its kernel with the features (their arguments before the maps)
    assert len(tma) == 8 and all(k["args"][-4:] == [[f"tm_{t}", "tmap"] for t in MAPS] for k in tma)
    assert sorted(tuple(k.get("features", ())) for k in tma) == [()] * 4 + [("seqlens", "softcap", "window")] * 4
    assert all([m["tensor"] for m in k["tensor_maps"]] == list(MAPS) for k in tma)
    assert all("tensor_maps" not in k for k in info["kernels"] if k["config"] != TMA.key())
    assert info["configs"][TMA.key()]["short"] == "bwd wgmma 64x128 st2 tma atomic"
    data = read_kernel_file(tmp_path / "out" / "kernel.json")
    assert data.backward is not None
    spec = data.backward.kernels[("fp16", 128, True, TMA.key())]
    assert [m.tensor for m in spec.tensor_maps] == list(MAPS) and isinstance(spec.tensor_maps[0], TensorMapSpec)
    assert spec.args[-4:] == tuple((f"tm_{t}", "tmap") for t in MAPS)
