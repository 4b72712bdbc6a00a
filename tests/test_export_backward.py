"""Exports that train, without a GPU: the backward section of kernel.json (written, read back,
checked), the ops' fake implementations under FakeTensorMode, autograd through the ops on meta
tensors (shapes only), torch.library.opcheck, torch.compile's forward and backward graphs, the
deterministic switch and the errors a user sees."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_fixtures import LARGE64, LARGE64_C, LARGE128, MMA, load_module, make_run, space_doc
from torch._subclasses.fake_tensor import FakeTensorMode

from evoengineer.kernels.backward_rules import BACKWARD_CONFIGS, default_config, forward_lse_config
from evoengineer.results import ExportError, export_runs
from evoengineer.results.export_backward import backward_choice, parse_backward_option
from evoengineer.runtime.kernel_file import KernelFileError, read_kernel_file
from evoengineer.runtime.op import DOUBLE_BACKWARD_ERROR
from evoengineer.space import Config

VARIANTS = [("fp16", d, c) for d in (64, 128) for c in (False, True)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("export_bwd")
    export_runs([make_run(root / "run")], root / "out")
    return root / "out", load_module(root / "out")


def _meta(*shape: int, grad: bool = True, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


# -- kernel.json ----------------------------------------------------------------------------------


def test_the_export_carries_an_lse_forward_a_backward_and_a_deterministic_backward_per_variant(exported) -> None:
    out, module = exported
    info = json.loads((out / "kernel.json").read_text())["backward"]
    assert [(v["dtype"], v["head_dim"], v["causal"]) for v in info["variants"]] == VARIANTS
    for entry in info["variants"]:
        d = entry["head_dim"]
        assert entry["forward"] == forward_lse_config(d).key()
        assert entry["fallback"] == default_config(d, hopper=True).key() and entry["cases"] == []
        assert entry["deterministic"] == default_config(d, deterministic_dq=True).key()
    for kernel in info["kernels"]:
        assert (out / kernel["source"]).exists() and kernel["source"].startswith("evo_attention_bwd_")
        assert [l["grid"] for l in kernel["launches"]] == ["q", "kv", "q"]
        assert kernel["workspaces"] == {"Dsum": 1, "dQacc": 0 if kernel["deterministic"] else kernel["head_dim"]}
        assert ["dO", "ptr"] in kernel["args"] and ["scale", "f32"] in kernel["args"]
    for kernel in info["forward_kernels"]:
        assert kernel["workspace_floats_per_row"] == 1 and "WRITE_LSE=1" in kernel["params"] or kernel["params"]["WRITE_LSE"] == 1
    data = read_kernel_file(out / "kernel.json")
    assert data.backward is not None and set(data.backward.variants) == set(VARIANTS)
    assert {spec.deterministic for spec in data.backward.kernels.values()} == {True, False}
    assert set(module.BACKWARD) == set(VARIANTS)
    assert module.dispatch_backward("fp16", 128, True, 2, 8, 77, 77) == default_config(128, hopper=True).key()
    assert module.dispatch_backward(torch.float16, 64, False, 2, 8, 77, 77, deterministic=True) == \
        default_config(64, deterministic_dq=True).key()
    assert module.BACKWARD_CONFIGS[default_config(64, hopper=True).key()]["short"] == "bwd wgmma 128x128 st2 tma bulk"


def test_an_export_for_another_arch_than_sm_90a_defaults_to_the_mma_backward(tmp_path: Path) -> None:
    doc = space_doc()
    doc["target"]["arch"] = "sm_90"   # no wgmma: the backward that runs on every GPU since sm_80
    doc["search"]["seeds"] = [s for s in doc["search"]["seeds"] if s["PATH"] != "wgmma"]
    export_runs([make_run(tmp_path / "run", space=doc)], tmp_path / "out")
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())["backward"]
    assert {(v["head_dim"], v["fallback"]) for v in info["variants"]} == {(d, default_config(d).key()) for d in (64, 128)}
    assert all(info["configs"][v["fallback"]]["config"]["PATH"] == "mma" for v in info["variants"])


PTMA = Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=128, CONSUMER_WGS=2, INTRA_WG_OVERLAP=1, LOAD="tma", O_TMA=1,
              PERSISTENT=1, PINGPONG=0, PRODUCER=1, Q_IN_REGS=1, REG_CONSUMER=240, REG_PRODUCER=24, SOFTMAX_PIN=3,
              SPLIT_TAIL=0, STAGES=2)
"""A persistent wgmma forward: it can write the LSE (its workspace is free)."""


def test_the_lse_forward_is_the_exports_own_wgmma_forward_where_it_can_write_the_lse(tmp_path: Path) -> None:
    counter = PTMA.replace(PERSISTENT=2)   # its workspace is the tile counter: no LSE
    times = {LARGE64: {PTMA: 140.0, counter: 150.0, MMA: 250.0}, LARGE64_C: {PTMA: 90.0, MMA: 140.0},
             LARGE128: {counter: 200.0, MMA: 480.0}}
    export_runs([make_run(tmp_path / "run", times)], tmp_path / "out")
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())["backward"]
    # D128's largest case went to the counter kernel: the variant's next choice, the fallback (PTMA)
    lse = PTMA.replace(WRITE_LSE=1).key()
    assert {v["forward"] for v in info["variants"]} == {lse} == {forward_lse_config(64, [counter, PTMA]).key()}
    kernel = next(k for k in info["forward_kernels"] if k["config"] == lse)
    assert kernel["tensor_maps"] and kernel["workspace_floats_per_row"] == 1
    data = read_kernel_file(tmp_path / "out" / "kernel.json")   # the runtime reads it back
    assert data.backward.forward_kernels[("fp16", 128, True, lse)].tensor_maps
    # no wgmma forward that can write it: the mma one
    assert forward_lse_config(128, [counter, MMA]) == forward_lse_config(128)
    assert forward_lse_config(128).get("PATH") == "mma"


def test_backward_options_choose_the_configuration_per_head_dim(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    assert parse_backward_option("D128:m32n128-sep") == {128: BACKWARD_CONFIGS[128]["m32n128-sep"]}
    assert parse_backward_option("m32n128") == {64: BACKWARD_CONFIGS[64]["m32n128"], 128: BACKWARD_CONFIGS[128]["m32n128"]}
    assert parse_backward_option("m64n64") == {64: BACKWARD_CONFIGS[64]["m64n64"]}    # a D64 name only
    (config,) = parse_backward_option("D64:BLOCK_M=32,BLOCK_N=64,DQ_MODE=separate").values()
    assert config["STAGES"] == 2 and config["DQ_MODE"] == "separate"
    assert set(parse_backward_option("BLOCK_M=64,BLOCK_N=128")) == {64, 128}
    for bad, message in (("D96:m64n64", "head dims 64, 128"), ("nope", "no configuration 'nope'"),
                         ("D64:BLOCK_M=128,BLOCK_N=64", "BLOCK_M 128"), ("BLOCK_M=64,BLOCK_N=96", "BLOCK_N 96")):
        with pytest.raises(ExportError, match=message):
            parse_backward_option(bad)
    choice = backward_choice(["D128:m32n128-sep", "D64:m64n128"])
    export_runs([run], tmp_path / "out", backward=choice)
    module = load_module(tmp_path / "out")
    sep = BACKWARD_CONFIGS[128]["m32n128-sep"].key()
    assert module.BACKWARD[("fp16", 128, True)]["fallback"] == sep == module.BACKWARD[("fp16", 128, True)]["deterministic"]
    assert module.BACKWARD[("fp16", 64, False)]["fallback"] == BACKWARD_CONFIGS[64]["m64n128"].key()


def test_the_cli_exports_backward_options_or_none(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    cli = lambda *a: subprocess.run([sys.executable, "-m", "evoengineer", "export", str(run), *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=tmp_path, timeout=300)
    done = cli("--out", str(tmp_path / "a"), "--backward", "D64:m64n64-sep")
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "a" / "kernel.json").read_text())
    assert {v["fallback"] for v in info["backward"]["variants"] if v["head_dim"] == 64} == {BACKWARD_CONFIGS[64]["m64n64-sep"].key()}
    bad = cli("--out", str(tmp_path / "b"), "--backward", "D64:zzz")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no configuration 'zzz'" in bad.stderr
    done = cli("--out", str(tmp_path / "c"), "--no-backward")
    assert done.returncode == 0, done.stderr
    assert "backward" not in json.loads((tmp_path / "c" / "kernel.json").read_text())
    module = load_module(tmp_path / "c")
    assert module.BACKWARD == {}
    with pytest.raises(NotImplementedError, match=r"^attention: a gradient is needed .* this export has no backward kernels"):
        module.attention(_meta(1, 2, 8, 64), _meta(1, 2, 8, 64), _meta(1, 2, 8, 64))
    with torch.no_grad():   # inference needs no backward
        assert module.attention(_meta(1, 2, 8, 64), _meta(1, 2, 8, 64), _meta(1, 2, 8, 64)).shape == (1, 2, 8, 64)


_EDITS = __import__("itertools").count()


def _edit(out: Path, change) -> Path:
    doc = json.loads((out / "kernel.json").read_text())
    change(doc["backward"])
    doc["op_namespace"] += f"_{next(_EDITS)}"   # another export: ops of its own
    target = out.parent / f"edited_{abs(hash(json.dumps(doc, sort_keys=True)))}"
    target.mkdir()
    for path in out.glob("*.cu"):
        (target / path.name).write_text(path.read_text())
    (target / "kernel.json").write_text(json.dumps(doc))
    return target / "kernel.json"


BROKEN = {
    "unknown backward argument": (lambda b: b["kernels"][0]["args"].__setitem__(0, ["alpha", "ptr"]),
                                  r"backward\.kernels\[0\]\.args\[0\]: \"alpha\" \(\"ptr\"\) is not an argument"),
    "grid over something else": (lambda b: b["kernels"][0]["launches"][0].__setitem__("grid", "z"),
                                 r"backward\.kernels\[0\]\.launches\[0\]\.grid: expected q or kv"),
    "workspace without size": (lambda b: b["kernels"][0]["workspaces"].pop("Dsum"),
                               r"backward\.kernels\[0\]\.workspaces: no size for Dsum"),
    "deterministic that is not": (lambda b: b["variants"][0].__setitem__("deterministic", b["variants"][0]["fallback"]),
                                  r"backward\.variants\[0\]\.deterministic: .* is not a deterministic backward"),
    "forward unknown": (lambda b: b["variants"][1].__setitem__("forward", "zzz"),
                        r"backward\.variants\[1\]\.forward: \"zzz\" has no LSE forward kernel for fp16 D64 causal"),
    "lse forward with two floats": (lambda b: b["forward_kernels"][0].__setitem__("workspace_floats_per_row", 2),
                                    r"backward\.forward_kernels\[0\]: an LSE forward has one launch"),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_a_broken_backward_section_is_one_line_naming_the_key(exported, what: str) -> None:
    out, _ = exported
    change, message = BROKEN[what]
    with pytest.raises(KernelFileError) as caught:
        read_kernel_file(_edit(out, change))
    text = str(caught.value)
    assert "\n" not in text and "re-export" in text and __import__("re").search(message, text), text


# -- the ops without a GPU ---------------------------------------------------------------------------


def test_the_fake_implementations_give_the_outputs_metadata(exported) -> None:
    _, module = exported
    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, 2, 300, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(TypeError, match="bfloat16 has no exported kernel"):
            module.attention_lse_op(q, kv, kv, True, None, True, False)
        q, kv = q.half(), kv.half()
        out, lse = module.attention_lse_op(q, kv, kv, True, None, True, False)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 8, 100, 64), torch.float16, (2, 8, 100), torch.float32)
        dq, dk, dv = module.attention_backward_op(out, q, kv, kv, out, lse, True, None, True, True)
        assert (dq.shape, dk.shape, dv.shape) == ((2, 8, 100, 64), (2, 2, 300, 64), (2, 2, 300, 64))
        bshd = torch.empty(2, 100, 8, 64, dtype=torch.float16, device="cuda").transpose(1, 2)
        out, lse = module.attention_lse_op(bshd, bshd, bshd)
        assert out.stride() == bshd.stride() and lse.is_contiguous()
        assert module.attention_backward_op(out, bshd, bshd, bshd, out, lse, False, None, False, False)[0].stride() == bshd.stride()


@pytest.mark.parametrize("causal,heads_kv,seq_k", [(False, 8, 100), (True, 2, 300)])
def test_gradients_flow_through_the_ops_on_meta_tensors(exported, causal: bool, heads_kv: int, seq_k: int) -> None:
    _, module = exported
    q, k, v = _meta(2, 8, 100, 128), _meta(2, heads_kv, seq_k, 128), _meta(2, heads_kv, seq_k, 128)
    out = module.attention(q, k, v, is_causal=causal, enable_gqa=heads_kv != 8)
    assert "attention_lse" in type(out.grad_fn).__name__ and out.grad_fn.deterministic is False
    out.float().sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    # the inference op, held by itself, is differentiable too (it recomputes the LSE)
    q.grad = None
    module.attention_op(q, k, v, causal, None, heads_kv != 8).sum().backward()
    assert q.grad.shape == q.shape
    with torch.no_grad():
        assert module.attention(q, k, v, is_causal=causal, enable_gqa=heads_kv != 8).grad_fn is None


def test_the_deterministic_switch_reaches_the_backward(exported) -> None:
    _, module = exported
    q = _meta(1, 4, 16, 64)
    assert module.attention(q, q, q, deterministic=True).grad_fn.deterministic is True
    module.set_deterministic(True)
    try:
        assert module.attention(q, q, q).grad_fn.deterministic is True
        assert module.attention(q, q, q, deterministic=False).grad_fn.deterministic is False
    finally:
        module.set_deterministic(False)
    torch.use_deterministic_algorithms(True)
    try:
        assert module.attention(q, q, q).grad_fn.deterministic is True
    finally:
        torch.use_deterministic_algorithms(False)
    assert module.attention(q, q, q).grad_fn.deterministic is False
    assert module.explain_backward(q, q, q, deterministic=True)["config"] == default_config(64, deterministic_dq=True).key()


def test_opcheck_passes_for_the_three_ops(exported) -> None:
    _, module = exported
    q, kv = _meta(2, 8, 40, 64), _meta(2, 2, 70, 64)
    for op, args in ((module.attention_op, (q, kv, kv, True, 0.2, True, False)),
                     (module.attention_lse_op, (q, kv, kv, False, None, True, True))):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"} and "test_autograd_registration" in results
    out, lse = module.attention_lse_op(q.detach(), kv.detach(), kv.detach(), False, None, True, False)
    plain = (out, q.detach(), kv.detach(), kv.detach(), out, lse, False, None, True, False)
    assert set(torch.library.opcheck(module.attention_backward_op, plain).values()) == {"SUCCESS"}


def test_double_backward_and_uncovered_variants_are_one_line(exported, tmp_path: Path) -> None:
    out_dir, module = exported
    q = _meta(1, 4, 16, 64)
    (grad,) = torch.autograd.grad(module.attention(q, q, q).float().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="^" + DOUBLE_BACKWARD_ERROR.replace("(", r"\(").replace(")", r"\)") + "$"):
        grad.float().sum().backward()
    # an export whose backward leaves out fp16 D128 causal
    path = _edit(out_dir, lambda b: b.__setitem__("variants", [v for v in b["variants"] if (v["head_dim"], v["causal"]) != (128, True)]))
    __import__("shutil").copytree(out_dir / "evo_attention", path.parent / "evo_attention")
    partial = load_module(path.parent)
    q = _meta(1, 4, 16, 128)
    with pytest.raises(NotImplementedError, match=r"^attention: a gradient is needed .* no backward for fp16 head_dim 128 "
                                                  r"causal; its backward covers fp16 D64, fp16 D64 causal, fp16 D128;"):
        partial.attention(q, q, q, is_causal=True)
    assert partial.attention(q, q, q).shape == q.shape
    with pytest.raises(ValueError, match="^attention: backward inputs must be on one device, got cpu, meta"):
        module._export.backward.run_backward(torch.zeros(1, 4, 16, 64, dtype=torch.float16), q.detach(), q.detach(), q.detach(),
                                     q.detach(), torch.empty(1, 4, 16, device="meta"), False, None, False, False)


def _recording_backend(graphs: list):
    from torch._dynamo.backends.common import aot_autograd

    def record(name: str):
        def compiler(gm, example_inputs):
            graphs.append((name, {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
            return gm
        return compiler

    return aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))


def test_torch_compile_traces_forward_and_backward_and_inference_writes_no_lse(exported) -> None:
    _, module = exported
    ns = module.OP_NAMESPACE
    graphs: list = []
    step = torch.compile(lambda q, k, v: module.attention(q, k, v, is_causal=True, enable_gqa=True).float().square().sum(),
                         fullgraph=True, backend=_recording_backend(graphs))
    q, kv = _meta(2, 8, 64, 64), _meta(2, 2, 64, 64)
    step(q, kv, kv).backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    named = dict(graphs)
    assert f"{ns}.attention_lse.default" in named["forward"] and f"{ns}.attention_backward.default" in named["backward"]
    graphs.clear()
    with torch.no_grad():
        step(q.detach(), kv.detach(), kv.detach())
    assert [name for name, _ in graphs] == ["forward"]
    assert f"{ns}.attention.default" in graphs[0][1] and f"{ns}.attention_lse.default" not in graphs[0][1]
