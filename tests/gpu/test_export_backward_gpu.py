"""Training through an exported module on the GPU: gradients of the exported op against autograd
of fp32 SDPA under flash-attn's rule (``gpu.backward.rule_check``) on odd shapes (fp16, bf16,
grouped-query heads, causal, seq_q != seq_k, (B, S, H, D) storage), the deterministic mode bit
for bit, opcheck with autograd, torch.compile(fullgraph=True) over forward and backward,
CUDA-graph capture of a training step, errors that need a GPU, and a 2-layer Llama trained 20
steps through ``register_hf`` against SDPA.

The export comes from a replayed run of a tiny space over fp16 and bf16, D64 and D128, causal
and full (one mma configuration), exported with each head dim's default backward; the gradient,
compile and CUDA-graph tests also run an export of a wgmma forward (sm_90 GPUs), whose LSE
forward is that wgmma configuration writing the LSE, and the same export with the wgmma backward
that loads by TMA (``--backward w64n128-tma``: tensor maps encoded per plan, re-pointed per call)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.space import Config

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                       reason="needs a CUDA GPU with sm_80 or newer"),
]

FORWARD = Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SPLITS=1)
WGMMA_FORWARD = Config(PATH="wgmma", BLOCK_M=128, BLOCK_N=128, CONSUMER_WGS=2, INTRA_WG_OVERLAP=1, LOAD="tma",
                       O_TMA=1, PERSISTENT=1, PINGPONG=0, PRODUCER=1, Q_IN_REGS=1, REG_CONSUMER=240, REG_PRODUCER=24,
                       SOFTMAX_PIN=3, SPLIT_TAIL=0, STAGES=2)
"""A persistent wgmma forward (sm_90a): the export's LSE forward is then this configuration
writing the LSE (``kernels.backward_rules.forward_lse_config``)."""


def _export(root: Path, forward: Config, arch: str, name: str, backward: tuple[str, ...] = ()):
    """Replay a one-configuration run of a tiny space, export it with each head dim's default
    backward (or ``backward``: ``--backward`` values), and import the export."""
    import yaml

    space = {
        "name": "tiny-train",
        "target": {"name": "any", "arch": arch, "sms": 132, "smem_per_block": 232448},
        "problem": {"dtype": ["fp16", "bf16"], "shapes": [{"B": 1, "H": 8, "H_KV": 2, "S": 256, "D": d, "causal": [False, True]}
                                                          for d in (64, 128)]},
        "template": "flash_attention",
        "params": {k: [v] for k, v in forward.items()},
        "search": {"strategy": "grid", "budget": 1, "top_k": 1},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(space, sort_keys=False))
    (root / "rec.jsonl").write_text(json.dumps({"header": {"space_inline": space}}) + "\n" + json.dumps(
        {"config": forward.to_dict(), "key": forward.key(), "status": "ok", "reason": "", "objective_us": 10.0}) + "\n")
    run, out = root / "run", root / "best"
    for args in (("search", "--space", "tiny.yaml", "--replay", "rec.jsonl", "--run-dir", str(run), "--quiet"),
                 ("export", str(run), "--rank", "1", "--out", str(out), *(f"--backward={b}" for b in backward))):
        done = subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=root,
                              timeout=600)
        assert done.returncode == 0, done.stderr + done.stdout
    package = out / "evo_attention"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    assert len(loaded.BACKWARD) == 8
    loaded.KERNEL_JSON = json.loads((out / "kernel.json").read_text())
    return loaded


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    return _export(tmp_path_factory.mktemp("export_bwd_gpu"), FORWARD, "sm_90", "evo_attention_train")


@pytest.fixture(scope="module")
def wgmma_module(tmp_path_factory: pytest.TempPathFactory):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward needs an sm_90 GPU (H100, H200)")
    return _export(tmp_path_factory.mktemp("export_bwd_wgmma"), WGMMA_FORWARD, "sm_90a", "evo_attention_train_wgmma")


@pytest.fixture(scope="module")
def tma_module(tmp_path_factory: pytest.TempPathFactory):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward and backward need an sm_90 GPU (H100, H200)")
    return _export(tmp_path_factory.mktemp("export_bwd_tma"), WGMMA_FORWARD, "sm_90a", "evo_attention_train_tma",
                   backward=("w64n128-tma",))


@pytest.fixture(params=["mma", "wgmma", "tma"])
def either_module(request):
    """The export whose LSE forward is the mma kernel, the one whose LSE forward is its own wgmma forward,
    and that one with the backward that loads by TMA."""
    return request.getfixturevalue({"mma": "module", "wgmma": "wgmma_module", "tma": "tma_module"}[request.param])


def test_the_tma_export_runs_the_tma_backward(tma_module) -> None:
    backward = tma_module.KERNEL_JSON["backward"]
    chosen = {backward["configs"][v["fallback"]]["config"].get("LOAD") for v in backward["variants"]}
    assert chosen == {"tma"}
    assert all(k["args"][-1] == ["tm_do", "tmap"] for k in backward["kernels"] if k["config"] in
               {v["fallback"] for v in backward["variants"]})
    q, k, v, _ = _inputs(1, 8, 2, 300, 300, 128, "fp16")
    plan = tma_module.explain_backward(q, k, v, is_causal=True, enable_gqa=True)
    assert plan["short"] == "bwd wgmma 64x128 st2 tma atomic" and plan["launches"][1]["block"] == (384, 1, 1)


def test_the_wgmma_export_trains_through_its_own_forward(wgmma_module) -> None:
    backward = wgmma_module.KERNEL_JSON["backward"]
    lse = WGMMA_FORWARD.replace(WRITE_LSE=1).key()
    assert {v["forward"] for v in backward["variants"]} == {lse}
    assert backward["configs"][lse]["config"]["PATH"] == "wgmma"


def _dtype(name: str):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _inputs(b: int, h: int, hkv: int, sq: int, sk: int, d: int, dtype: str, seed: int = 0, bshd: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads: int, seq: int):
        if bshd:
            return torch.randn(b, seq, heads, d, generator=gen, device="cuda", dtype=_dtype(dtype)).transpose(1, 2)
        return torch.randn(b, heads, seq, d, generator=gen, device="cuda", dtype=_dtype(dtype))

    return make(h, sq), make(hkv, sk), make(hkv, sk), make(h, sq)


def _grads(module, q, k, v, do, causal: bool, deterministic: bool = False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], deterministic=deterministic)
    out.backward(do)
    return (out.detach(), *(t.grad for t in leaves))


SHAPES = [  # (B, H, H_kv, S_q, S_k)
    (1, 2, 2, 1, 1), (2, 3, 3, 5, 5), (2, 2, 2, 77, 77), (1, 2, 2, 257, 257), (1, 2, 2, 77, 257), (1, 2, 2, 257, 77),
    (1, 8, 2, 257, 257), (2, 8, 2, 77, 130), (2, 4, 4, 1024, 1024),
]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_gradients_of_the_exported_op_meet_flash_attns_rule(either_module, dtype: str, head_dim: int, causal: bool,
                                                            deterministic: bool) -> None:
    module = either_module
    from evoengineer.gpu.backward import rule_check, sdpa_gradients

    for i, shape in enumerate(SHAPES):
        q, k, v, do = _inputs(*shape, head_dim, dtype, seed=i, bshd=i % 2 == 1)
        out, dq, dk, dv = _grads(module, q, k, v, do, causal, deterministic)
        ref = sdpa_gradients(q, k, v, do, causal, None, torch.float32)
        low = sdpa_gradients(q, k, v, do, causal, None)
        for name, ours, r32, rlow in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref, low):
            check = rule_check(name, ours, r32, rlow)
            assert check.ok, f"{dtype} D{head_dim} {'causal' if causal else 'full'} {shape}: {check}"
        assert dq.stride() == q.stride() and dk.shape == k.shape


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_deterministic_mode_repeats_bit_for_bit(module, dtype: str) -> None:
    q, k, v, do = _inputs(2, 8, 2, 700, 700, 128, dtype, seed=3)
    first = _grads(module, q, k, v, do, True, deterministic=True)
    for _ in range(3):
        again = _grads(module, q, k, v, do, True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    module.set_deterministic(True)
    try:
        assert all(torch.equal(a, b) for a, b in zip(first, _grads(module, q, k, v, do, True, deterministic=None)))
    finally:
        module.set_deterministic(False)


def test_opcheck_with_autograd(module) -> None:
    q, k, v, _ = _inputs(1, 4, 2, 64, 80, 64, "fp16")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for causal in (False, True):
        torch.library.opcheck(module.attention_lse_op, (*leaves, causal, None, True, False))
        torch.library.opcheck(module.attention_op, (*leaves, causal, 0.2, True, True))
    out, lse = module.attention_lse_op(q, k, v, True, None, True, False)
    torch.library.opcheck(module.attention_backward_op, (out, q, k, v, out, lse, True, None, True, False))


def test_torch_compile_fullgraph_forward_and_backward(either_module) -> None:
    module = either_module

    def loss(q, k, v, do):
        return (module.attention(q * 1.5, k, v, is_causal=True, enable_gqa=True) * do).float().sum()

    compiled = torch.compile(loss, fullgraph=True)
    for shape in ((2, 8, 2, 300, 300), (1, 4, 4, 128, 512)):
        q, k, v, do = _inputs(*shape, 64, "bf16", seed=5)
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        loss(*eager, do).backward()
        traced = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*traced, do).backward()
        for a, b in zip(eager, traced):
            torch.testing.assert_close(b.grad.float(), a.grad.float(), atol=2e-2, rtol=2e-2)


def test_cuda_graph_capture_of_a_training_step(either_module) -> None:
    module = either_module
    q, k, v, do = _inputs(2, 8, 2, 512, 512, 128, "fp16", seed=7)
    static = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = module.attention(*static, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out, static, do)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()   # plans and kernels exist before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    for seed in (11, 12):
        fresh = _inputs(2, 8, 2, 512, 512, 128, "fp16", seed=seed)
        with torch.no_grad():
            for target, new in zip((*static, do), fresh):
                target.copy_(new)
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = _grads(module, *fresh, True)[1:]
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_errors_that_need_a_gpu(module) -> None:
    q, k, v, do = _inputs(1, 2, 2, 64, 64, 64, "fp16")
    leaf = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="^attention: q, k and v must be on one device"):
        module.attention(leaf, k.cpu(), v)
    with pytest.raises(TypeError, match="^attention: dtype torch.float32 has no exported kernel"):
        module.attention(leaf.float(), k.float(), v.float())
    out, lse = module.attention_lse_op(q, k, v)
    with pytest.raises(ValueError, match="^attention: backward inputs must be on one device"):
        module.attention_backward_op(do, q, k, v, out, lse.cpu(), False, None, False, False)
    (grad,) = torch.autograd.grad(module.attention(leaf, k, v).float().sum(), (leaf,), create_graph=True)
    with pytest.raises(RuntimeError, match="^attention: double backward"):
        grad.float().sum().backward()


def test_a_small_llama_trains_through_register_hf_as_through_sdpa(module) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    module.register_hf("evo_train")
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.05,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    data = torch.randint(3, 512, (20, 4, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    losses = {}
    for implementation in ("sdpa", "evo_train"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        model.set_attn_implementation(implementation)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[implementation] = []
        for ids in data:
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[implementation].append(loss.item())
    for step, (ref, ours) in enumerate(zip(losses["sdpa"], losses["evo_train"])):
        assert abs(ours - ref) <= 0.01 * abs(ref), f"step {step}: loss {ours:.4f} vs SDPA {ref:.4f}"
    assert losses["evo_train"][-1] < losses["evo_train"][0]
