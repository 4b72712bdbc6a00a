"""The exported module on the GPU: every dispatch regime against SDPA, the custom op
(opcheck, torch.compile fullgraph), CUDA-graph capture, decode, seq_q != seq_k, the
errors that need a GPU, and transformers' Llama with ``attn_implementation="evo"``.

The export comes from a hand-written run (``tests/run_fixtures.py``): real kernels, timings
chosen so that each of three configurations (wmma, mma, mma with a split K/V range and a
combine launch) serves some shapes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run_fixtures import MMA, SPLIT, WMMA, load_module, make_run  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    from evoengineer.results import export_runs

    root = tmp_path_factory.mktemp("export_gpu")
    export_runs([make_run(root / "run")], root / "out")
    return load_module(root / "out")


def _qkv(b: int, h: int, sq: int, sk: int, d: int, hkv: int | None = None, seed: int = 0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=gen, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv or h, sk, d, generator=gen, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv or h, sk, d, generator=gen, device="cuda", dtype=torch.float16)
    return q, k, v


def _reference(q, k, v, causal: bool, scale: float | None = None):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, scale=scale)


def _close(out, ref) -> None:
    import torch

    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape,causal,config", [
    ((1, 8, 512, 512, 64), False, WMMA), ((1, 8, 512, 512, 64), True, WMMA),
    ((2, 16, 2048, 2048, 64), True, MMA), ((4, 16, 1000, 1000, 128), False, MMA),
    ((8, 32, 1, 4096, 128), False, SPLIT), ((3, 32, 1, 777, 128), False, SPLIT),  # decode: two launches, a workspace
    ((2, 4, 300, 300, 128), True, MMA),  # a variant never measured: the fallback
])
def test_each_dispatch_regime_matches_sdpa(module, shape, causal, config) -> None:
    b, h, sq, sk, d = shape
    q, k, v = _qkv(b, h, sq, sk, d)
    plan = module.explain(q, k, v, is_causal=causal)
    assert plan["config"] == config.key()
    assert len(plan["launches"]) == (2 if config == SPLIT else 1) and (plan["workspace_bytes"] > 0) == (config == SPLIT)
    _close(module.attention(q, k, v, is_causal=causal), _reference(q, k, v, causal))


@pytest.mark.parametrize("b,h,hkv,sk", [(8, 32, 8, 4096), (3, 32, 4, 777), (2, 6, 2, 100)])
def test_grouped_query_decode_runs_packed_through_the_module(module, b: int, h: int, hkv: int, sk: int) -> None:
    """The decode winner packs the query heads of a K/V head into one CTA: a grid row per
    (batch, K/V head), the combine launch a row per query head."""
    q, k, v = _qkv(b, h, 1, sk, 128, hkv=hkv, seed=sk)
    plan = module.explain(q, k, v, enable_gqa=True)
    assert plan["config"] == SPLIT.key() and plan["params"]["PACK_GQA"] == 1
    assert [tuple(launch["grid"]) for launch in plan["launches"]] == [(1, b * hkv, 2), (1, b * h, 1)]
    _close(module.attention(q, k, v, enable_gqa=True), _reference(q, k.repeat_interleave(h // hkv, 1),
                                                                     v.repeat_interleave(h // hkv, 1), False))


@pytest.mark.parametrize("sq,sk", [(100, 333), (333, 100), (1, 64), (64, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_causal_with_seq_q_not_seq_k_is_top_left_like_sdpa(module, sq: int, sk: int, d: int) -> None:
    q, k, v = _qkv(2, 3, sq, sk, d, seed=sq * sk)
    _close(module.attention(q, k, v, is_causal=True), _reference(q, k, v, True))
    _close(module.attention(q, k, v, is_causal=False, scale=0.3), _reference(q, k, v, False, 0.3))


def test_strided_views_and_the_output_layout(module) -> None:
    import torch

    base = torch.randn(2, 333, 3, 64, device="cuda", dtype=torch.float16)  # (B, S, H, D) memory
    q = base.transpose(1, 2)
    k = torch.randn(2, 3, 333, 128, device="cuda", dtype=torch.float16)[..., :64]  # a last-dim slice: strides (.., 128, 1)
    v = torch.randn(3, 2, 333, 64, device="cuda", dtype=torch.float16).transpose(0, 1)
    out = module.attention(q, k, v, is_causal=True)
    assert out.stride() == q.stride()  # like q, so a (B, S, H, D) caller gets it back without a copy
    _close(out, _reference(q, k, v, True))


def test_repeated_calls_reuse_the_plan_and_follow_the_current_stream(module) -> None:
    import torch

    q, k, v = _qkv(1, 8, 512, 512, 64)
    first = module.attention(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q2 = q * 2  # work queued on `stream`: the kernel must run after it, on the same stream
        second = module.attention(q2, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    _close(first, _reference(q, k, v, False))
    _close(second, _reference(q * 2, k, v, False))
    assert len(module._export.launcher.plans()) >= 1


def test_opcheck(module) -> None:
    import torch

    q, k, v = _qkv(1, 2, 64, 80, 64)
    for kwargs in ({}, {"is_causal": True}, {"scale": 0.2}):
        torch.library.opcheck(module.attention_op, (q, k, v), kwargs)
    q, k, v = _qkv(2, 4, 1, 300, 128)
    torch.library.opcheck(module.attention_op, (q, k, v), {})


def test_torch_compile_fullgraph_traces_through_the_op(module) -> None:
    import torch

    def block(q, k, v):
        return module.attention(q * 1.5, k, v, is_causal=True).relu()

    compiled = torch.compile(block, fullgraph=True)
    for shape in ((1, 8, 512, 512, 64), (2, 4, 128, 128, 128)):
        q, k, v = _qkv(*shape)
        _close(compiled(q, k, v), torch.nn.functional.relu(_reference(q * 1.5, k, v, True)))


def test_cuda_graph_capture_replays_with_new_inputs(module) -> None:
    import torch

    for shape, causal in (((1, 8, 512, 512, 64), True), ((8, 32, 1, 4096, 128), False)):
        q, k, v = _qkv(*shape)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module.attention(q, k, v, is_causal=causal)  # warm-up: the plan and the kernels exist before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module.attention(q, k, v, is_causal=causal)
        for seed in (1, 2):
            fresh = _qkv(*shape, seed=seed)
            for static, new in zip((q, k, v), fresh):
                static.copy_(new)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _close(out, _reference(*fresh, causal))


def test_errors_that_need_a_gpu(module) -> None:
    import torch

    q, k, v = _qkv(1, 2, 64, 64, 64)
    with pytest.raises(ValueError, match="^attention: q, k and v must be on one device"):
        module.attention(q, k.cpu(), v)
    assert module.attention(q.clone().requires_grad_(), k, v).grad_fn is not None   # the training path
    with torch.no_grad():
        module.attention(q.clone().requires_grad_(), k, v)
    flat = torch.randn(1 + q.numel(), device="cuda", dtype=torch.float16)
    misaligned = flat[1:].view(q.shape)  # starts 2 bytes into an allocation
    with pytest.raises(ValueError, match="16-byte aligned"):
        module.attention(misaligned, k, v)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        module.attention(*_qkv(1, 4, 64, 64, 64, hkv=2))
    if not module.GQA:
        with pytest.raises(ValueError, match="take no K/V head count"):
            module.attention(*_qkv(1, 4, 64, 64, 64, hkv=2), enable_gqa=True)
    else:
        q, k, v = _qkv(1, 4, 64, 64, 64, hkv=2)
        _close(module.attention(q, k, v, enable_gqa=True),
               _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), False))


# -- transformers ------------------------------------------------------------------------------


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).to("cuda", torch.float16).eval()


def test_llama_with_evo_attention_matches_sdpa(module) -> None:
    import torch

    pytest.importorskip("transformers")
    module.register_hf("evo")
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 48), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref_logits = model(ids).logits.float()
        ref_tokens = model.generate(ids, max_new_tokens=10, do_sample=False)
        model.set_attn_implementation("evo")
        logits = model(ids).logits.float()
        tokens = model.generate(ids, max_new_tokens=10, do_sample=False)
    torch.testing.assert_close(logits, ref_logits, atol=3e-2, rtol=3e-2)
    top2 = ref_logits.topk(2, dim=-1).values
    assert torch.equal(tokens, ref_tokens), f"greedy tokens differ; smallest top-2 logit gap {(top2[..., 0] - top2[..., 1]).min():.4f}"


def test_llama_padding_mask_is_served_and_matches_sdpa(module) -> None:
    import torch

    pytest.importorskip("transformers")
    module.register_hf("evo")
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 16), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in the first row: a key start per batch (leftpad_k)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask).logits.float()
        model.set_attn_implementation("evo")
        module.fallback_counts(reset=True)
        logits = model(ids, attention_mask=mask).logits.float()
        model(ids, attention_mask=torch.ones_like(ids))  # a padding mask that masks nothing is fine
    kept = mask.bool()  # padded positions' outputs are never read
    torch.testing.assert_close(logits[kept], ref[kept], atol=3e-2, rtol=3e-2)
    assert module.fallback_counts() == {}
