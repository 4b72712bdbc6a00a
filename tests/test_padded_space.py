"""Padded batches as search cases: a shape's lengths with ``padded: true`` (a dense batch whose
sequences end at their lengths, ``attention(seqlens_k=, seqlens_q=)``), its label, work and
features, the gate's padded edge shapes, its own partition, and an export that sends calls with
``seqlens_q`` to the padded case's winner."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_varlen_space import SPACE

from evoengineer.gpu import gate_cases
from evoengineer.gpu.evaluate import EDGE_LENGTHS, input_set_bytes, padding_mask, sdpa_op
from evoengineer.results import load_leaderboard, per_shape_winners
from evoengineer.search.partition import split_cases
from evoengineer.space import Case, Config, SpaceError, parse_space

PADDED = {"H": 8, "H_KV": 2, "D": 64, "causal": [False, True], "lengths": [256, 192, 64, 128], "padded": True}


def _doc(**shape: object) -> dict:
    doc = json.loads(json.dumps(SPACE))
    doc["name"], doc["description"] = "padded", "A dense and a padded shape at D64, on the mma and wmma paths."
    doc["problem"]["shapes"][1] = {**PADDED, **shape}
    return doc


def _space(**shape: object):
    return parse_space(_doc(**shape), "padded.yaml")


def test_a_padded_shape_is_a_dense_batch_with_per_batch_lengths() -> None:
    space = _space(causal=True)
    case = next(c for c in space.cases if c.lengths)
    assert case == Case(4, 8, 256, 64, True, heads_kv=2, lengths=(256, 192, 64, 128), padded=True)
    assert case.padded and not case.packed and case.features == ("seqlens",)
    assert case.label() == "B4 H8/2 padded 64..256 T640 S256 D64 causal"
    assert case.tokens == 4 * 256 and input_set_bytes(case) == 2 * 2 * 4 * 64 * (8 * 256 + 2 * 256)
    assert case.flops() == pytest.approx(4.0 * 8 * 64 * sum(n * n / 2.0 for n in (256, 192, 64, 128)))
    longer = next(c for c in _space(S=300).cases if c.lengths)
    assert (longer.seq, longer.seq_kv) == (300, 300) and longer.label().startswith("B4 H8/2 padded 64..256 T640 S300")


@pytest.mark.parametrize("shape, key, words", [
    ({"lengths": None, "padded": True}, "problem.shapes[1].padded", "needs its lengths"),
    ({"S": 100}, "problem.shapes[1].S", "at least its longest length (256)"),
    ({"S_KV": 300}, "problem.shapes[1].S_KV", "leave S_KV out"),
    ({"padded": "yes"}, "problem.shapes[1].padded", "true or false"),
])
def test_a_bad_padded_shape_is_one_line_naming_the_key(shape: dict, key: str, words: str) -> None:
    doc = _doc(**shape)
    if shape.get("lengths", ...) is None:
        doc["problem"]["shapes"][1] = {"B": 2, "H": 8, "S": 64, "D": 64, "padded": True}
    with pytest.raises(SpaceError) as err:
        parse_space(doc, "padded.yaml")
    assert err.value.key == key and words in err.value.message and "\n" not in str(err.value), str(err.value)


def test_a_padded_variant_is_gated_on_padded_edge_shapes_and_searched_in_its_own_partition() -> None:
    space = _space()
    variant = next(c.variant for c in space.cases if c.padded and c.causal)
    cases = gate_cases(space, variant)
    padded = [c for c in cases if c.padded]
    assert {c.lengths for c in padded} >= {n for _, n in EDGE_LENGTHS}
    assert all(c.seq == max(c.lengths) + 3 for c in padded[1:])   # padding past the longest sequence
    assert any(not c.lengths for c in cases)   # and the dense edge shapes (null lengths)
    parts = dict(split_cases(space, "head-dim"))
    assert list(parts) == ["D64", "D64 padded"]
    assert all("seqlens" in c.features for c in parts["D64 padded"].cases)
    assert "B4 H8/2 padded 64..256 T640 S256 D64" in dict(split_cases(space, "shape"))


# -- a replayed search and its export ----------------------------------------------------------------


def _us(config: Config, label: str) -> float:
    """Made-up times: dense cases like BLOCK_N 64, padded ones BLOCK_N 32 and one stage."""
    padded = "padded" in label
    fit = (config["BLOCK_N"] == 32 and config["STAGES"] == 1) if padded else config["BLOCK_N"] == 64
    return (80.0 if padded else 100.0) * (1.0 if fit else 1.4) * (1 + 0.01 * config["BLOCK_M"] // 64)


@pytest.fixture
def searched(tmp_path: Path) -> tuple[Path, Path]:
    """(a run of a replayed search of the padded space in partitions, its export directory)."""
    from run_fixtures import replayed_partitioned_search

    return replayed_partitioned_search(tmp_path, _doc(), _us, lambda c: 150.0 if c.lengths else 120.0)


def test_the_export_serves_calls_with_query_lengths_by_the_padded_case_winner(searched: tuple[Path, Path]) -> None:
    from run_fixtures import load_module

    from evoengineer.runtime.features import call_features, select_kernel

    run, out = searched
    board = load_leaderboard(run)
    assert [p["name"] for p in board["partitions"]] == ["D64", "D64 padded"]
    per = per_shape_winners([run])
    won = {w.label: w for w in per.winners}
    padded = won["B4 H8/2 padded 64..256 T640 S256 D64 causal"]
    dense = won["B2 H8/2 S256 D64 causal"]
    assert padded.shape.padded and not padded.shape.varlen and padded.shape.lengths == (256, 192, 64, 128)
    assert per.configs[padded.config].config["BLOCK_N"] == 32 and per.configs[dense.config].config["BLOCK_N"] == 64
    info = json.loads((out / "kernel.json").read_text())
    variant = next(v for v in info["dispatch"]["variants"] if v["head_dim"] == 64 and v["causal"])
    assert any(c.get("padded") and c["config"] == padded.config for c in variant["cases"])
    assert any(k["config"] == padded.config and "seqlens" in k["features"] and k["causal"] for k in info["kernels"])

    module = load_module(out)
    # a call with query lengths goes to the padded case, one without them (key lengths alone) to the dense case
    assert module.dispatch("fp16", 64, True, 2, 8, 256, 256, heads_kv=2, padded=True) == padded.config
    assert module.dispatch("fp16", 64, True, 2, 8, 256, 256, heads_kv=2) == dense.config
    assert module.dispatch("fp16", 64, False, 2, 8, 256, 256, heads_kv=2, padded=True) == won[
        "B4 H8/2 padded 64..256 T640 S256 D64"].config
    lengths = [3, 1]
    features = call_features(seqlens_k=lengths, seqlens_q=lengths)
    assert features.padded and features.needed(True) == ("seqlens",)
    assert not call_features(seqlens_k=lengths).padded
    export = module._export
    spec = select_kernel(export.data.kernels, ("fp16", 64, True), padded.config,
                         export.table.variants[("fp16", 64, True)].fallback, features.needed(True))
    assert spec.config == padded.config and "seqlens" in spec.features


def test_sdpa_times_a_padded_case_with_its_mask_under_a_forced_backend_or_its_own_choice() -> None:
    """The reference call the search times beside a padded case (on CPU tensors here): SDPA with the
    padding mask and K/V repeated to the query heads, torch's own choice or a forced backend (math
    gives the same; cuDNN has no CPU kernel, so forcing it raises); flash-attn-4 is refused in one
    line."""
    import torch

    case = next(c for c in _space(causal=True).cases if c.lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(case.batch, case.heads, case.seq, case.head_dim, generator=gen)
    k, v = (torch.randn(case.batch, case.heads_kv, case.seq, case.head_dim, generator=gen) for _ in range(2))
    mask = padding_mask(case, "cpu")
    own = sdpa_op("default", q, k, v, case.causal, None, mask=mask)()
    assert own.shape == q.shape
    torch.testing.assert_close(sdpa_op("math", q, k, v, case.causal, None, mask=mask)(), own)
    # batch 2 (64 keys): its rows see only those keys, causal
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[2:3, :, :64], k[2:3, :, :64].repeat_interleave(4, 1), v[2:3, :, :64].repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(own[2:3, :, :64], expected)
    with pytest.raises(RuntimeError, match="No viable backend"):
        sdpa_op("cudnn", q, k, v, case.causal, None, mask=mask)()
    with pytest.raises(ValueError, match="flash-attn-4"):
        sdpa_op("fa4", q, k, v, case.causal, None, mask=mask)
