"""Each model-family space's export serves its model: a two-layer, randomly initialised Hugging
Face model built from the real configuration of Llama-3 8B, Qwen2.5 7B, Mistral 7B v0.1 (sliding
window), Gemma-2 9B (head dim 256, soft cap, sliding window) and Phi-3 mini (head dim 96, sliding
window), in bf16, over prompts of different lengths (left padding), longer than the window where
the model has one, through ``register_hf`` (no call falls back), against the same model with SDPA
(eager attention for Gemma-2, whose soft cap SDPA lacks):

- the prompt's logits under flash-attn's rule at the model's output: ``max|ours - fp32| <=
  2 * max|sdpa_bf16 - fp32| + eps``, where fp32 is the same model in fp32;
- greedy generation equals SDPA's token for token, or parts from it only at a near-tie: where the
  two first differ, the fp32 model's logits of the two tokens are closer than the bf16 model's
  own error bound (random weights leave many top-2 gaps of a few bf16 steps)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run_fixtures import load_module, make_run  # noqa: E402

from evoengineer.space import load_space  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = {  # space -> (transformers config class, its published values, the reference attention)
    "llama3-8b": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                                  "rope_theta": 500000.0, "max_position_embeddings": 8192}, "sdpa"),
    "qwen2.5-7b": ("Qwen2Config", {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                                   "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
                                   "max_position_embeddings": 32768, "use_sliding_window": False}, "sdpa"),
    "mistral-7b": ("MistralConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096,
                                     "max_position_embeddings": 32768}, "sdpa"),
    "gemma2-9b": ("Gemma2Config", {"hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
                                   "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                   "query_pre_attn_scalar": 256, "sliding_window": 4096}, "eager"),
    "phi3-mini": ("Phi3Config", {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
                                 "num_key_value_heads": 32, "vocab_size": 32064, "sliding_window": 2047,
                                 "max_position_embeddings": 4096, "original_max_position_embeddings": 4096}, "sdpa"),
}


def _export(name: str, root: Path):
    """An export of a run of the family's space whose per-case winners are its mma seeds (the
    decode case's: a seed that splits the keys)."""
    space = load_space(name)
    doc = yaml.safe_load(yaml.safe_dump(dict(space.raw)))
    seeds = [s for s in space.search.seeds if s["PATH"] == "mma"]
    times = {}
    for case in space.cases:
        decode = case.seq == 1
        times[case.label()] = {s: (10.0 if (s["SPLITS"] > 1) == decode else 20.0) + i for i, s in enumerate(seeds)}
    run = make_run(root / "run", times, space=doc, name=name, sdpa={label: 100.0 for label in times})
    from evoengineer.results import export_runs

    export_runs([run], root / "out")
    return load_module(root / "out")


def _model(name: str):
    import transformers

    cls, values, _ = FAMILIES[name]
    config = getattr(transformers, cls)(num_hidden_layers=2, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, **values)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batched_greedy_generation_equals_sdpa_token_for_token(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    module = _export(name, tmp_path)
    module.register_hf("evo")
    model = _model(name)
    window = FAMILIES[name][1].get("sliding_window") if FAMILIES[name][1].get("use_sliding_window", True) else None
    length = (window or 200) + 60   # past the window, where there is one
    vocab = FAMILIES[name][1]["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, vocab, (3, length), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0    # left padding, as generate pads prompts of different lengths
    mask[2, :length // 2] = 0
    reference = FAMILIES[name][2]
    with torch.no_grad():
        model.set_attn_implementation(reference)
        ref_logits = model(ids, attention_mask=mask).logits.float()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        model.set_attn_implementation("evo")
        module.fallback_counts(reset=True)
        logits = model(ids, attention_mask=mask).logits.float()
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert module.fallback_counts() == {}
        exact = copy.deepcopy(model).float()
        exact.set_attn_implementation(reference)
        fp32 = torch.cat([exact(ids[i:i + 1], attention_mask=mask[i:i + 1]).logits for i in range(len(ids))])
        real = mask.bool()
        err, ref_err = ((x - fp32)[real].abs().max().item() for x in (logits, ref_logits))
        assert err <= 2 * ref_err + 1e-2, f"prompt logits: max|ours - fp32| {err:.4f} > 2 * {ref_err:.4f} + eps"
        if torch.equal(tokens, ref):
            return
        col = int((tokens != ref).any(0).nonzero()[0])
        row = int((tokens[:, col] != ref[:, col]).nonzero()[0])
        prefix = ref[:, :col]
        step = exact(prefix, attention_mask=torch.cat([mask, torch.ones_like(prefix[:, length:])], 1)).logits[row, -1]
        gap = (step[ref[row, col]] - step[tokens[row, col]]).abs().item()
    assert gap <= 2 * ref_err + 1e-2, (f"sequence {row} parts from SDPA's at new token {col - length}, where fp32 "
                                       f"puts the two tokens {gap:.4f} apart (> 2 * {ref_err:.4f} + eps)")
