"""The exported module without a GPU: per-shape winners, the dispatch rule, the kernel
argument list, the fake implementation and the errors a user sees. Real exports of
hand-written runs (real rendering), imported as a user imports them."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_fixtures import (
    DECODE,
    LARGE64,
    LARGE128,
    MMA,
    SMALL,
    SMALL_C,
    SPLIT,
    TIMES,
    WMMA,
    load_module,
    make_run,
    space_doc,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from evoengineer.results import ExportError, Shape, export_runs, kernel_args, nearest, per_shape_winners
from evoengineer.space import Config

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("export")
    run = make_run(root / "run")
    export_runs([run], root / "out")
    return root, load_module(root / "out")


def test_per_shape_winners_take_the_fastest_configuration_of_each_case(tmp_path: Path) -> None:
    per = per_shape_winners([make_run(tmp_path / "run")])
    won = {w.label: w.config for w in per.winners}
    for label, times in TIMES.items():
        assert won[label] == min(times, key=times.get).key(), label
    assert per.fallback == MMA.key()  # the geometric-mean winner
    small = next(w for w in per.winners if w.label == SMALL)
    assert (small.median_us, small.sdpa_backend, small.sdpa_us, small.candidates) == (20.0, "flash", 18.0, 3)
    decode = next(w for w in per.winners if w.label == DECODE)
    assert decode.shape == Shape("fp16", 8, 32, 32, 1, 4096, 128, False)  # a label outside the space, read as a shape
    assert set(per.configs) == {WMMA.key(), MMA.key(), SPLIT.key()}  # the incorrect record is not a candidate


def test_export_dispatches_each_call_to_the_nearest_measured_case(exported) -> None:
    _, module = exported
    assert module.FALLBACK == MMA.key()
    assert module.dispatch("fp16", 64, False, 1, 8, 512, 512) == WMMA.key()      # a measured case: its winner
    assert module.dispatch(torch.float16, 64, True, 2, 8, 700, 700) == WMMA.key()  # near the small case
    assert module.dispatch("fp16", 64, False, 8, 16, 4096, 4096) == MMA.key()   # near the large one
    assert module.dispatch("fp16", 128, False, 8, 32, 1, 4096) == SPLIT.key()  # decode: the split-K/V config
    assert module.dispatch("fp16", 128, False, 4, 32, 1, 8192) == SPLIT.key()
    assert module.dispatch("fp16", 128, False, 4, 16, 1024, 1024) == MMA.key()
    assert module.dispatch("fp16", 128, True, 1, 1, 16, 16) == MMA.key()       # no measured case: the fallback
    with pytest.raises(ValueError, match="no exported kernel for bf16 head_dim 64"):
        module.dispatch("bf16", 64, False, 1, 8, 512, 512)
    with pytest.raises(ValueError, match="covers fp16 D64, fp16 D64 causal, fp16 D128, fp16 D128 causal"):
        module.dispatch("fp16", 96, False, 1, 8, 512, 512)


def test_the_module_and_the_python_rule_agree_on_random_shapes(tmp_path: Path, exported) -> None:
    root, module = exported
    table = per_shape_winners([root / "run"]).table()
    rng = random.Random(7)
    for _ in range(300):
        shape = Shape("fp16", rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 8, 16, 32]), 0, rng.choice([1, 7, 64, 512, 3000]),
                      rng.choice([1, 64, 512, 4096, 9000]), rng.choice([64, 128]), rng.random() < 0.5)
        shape = Shape(shape.dtype, shape.batch, shape.heads, shape.heads, shape.seq_q, shape.seq_k, shape.head_dim, shape.causal)
        expected = nearest(table, shape) or module.FALLBACK
        assert module.dispatch(shape.dtype, shape.head_dim, shape.causal, shape.batch, shape.heads, shape.seq_q,
                               shape.seq_k) == expected, shape


def test_export_writes_one_kernel_per_distinct_configuration_and_variant(exported) -> None:
    root, module = exported
    assert set(module.KERNELS) == {
        ("fp16", 64, False, WMMA.key()), ("fp16", 64, True, WMMA.key()),  # winners, where they win
        ("fp16", 64, False, MMA.key()), ("fp16", 64, True, MMA.key()),  # the fallback: every variant
        ("fp16", 128, False, MMA.key()), ("fp16", 128, True, MMA.key()),
        ("fp16", 128, False, SPLIT.key()),
        # and, of the fallback, a kernel with every feature per variant (padding, soft-capping, packed sequences, windows)
        *((dtype, d, c, MMA.key(), ("seqlens", "softcap", "varlen", "window")) for dtype in ("fp16",) for d in (64, 128)
          for c in (False, True)),
    }
    split = module.KERNELS[("fp16", 128, False, SPLIT.key())]
    assert [l["kernel"] for l in split["launches"]] == ["attn_fwd", "attn_combine"] and split["workspace_floats_per_row"] > 0
    info = json.loads((root / "out" / "kernel.json").read_text())
    assert info["op"] == f"{module.OP_NAMESPACE}::attention" and info["mode"] == "per-shape"
    assert "nearest" in info["dispatch"]["rule"] and info["dispatch"]["fallback"] == MMA.key()
    table = {row["case"]: row for row in info["dispatch"]["table"]}
    assert table[LARGE64]["config"] == MMA.key() and table[LARGE64]["median_us"] == 250.0
    assert table[SMALL_C]["config_short"] == "wmma 64x64 w4" and table[SMALL]["speedup_vs_sdpa"] == pytest.approx(0.9)
    assert LARGE128 + " causal" not in table  # never timed: its variant runs the fallback
    assert info["decode"]["measured_cases"] == [{"case": DECODE, "config": SPLIT.key()}]
    assert SPLIT.key() in info["decode"]["configs"]
    for kernel in info["kernels"]:
        switches = tuple(f for f in kernel["features"] if f != "gqa")
        assert (root / "out" / kernel["source"]).read_text() == module.KERNELS[
            (kernel["dtype"], kernel["head_dim"], kernel["causal"], kernel["config"], *((switches,) if switches else ()))]["source"]
        assert [name for name, _ in kernel["args"][:10]] == ["Q", "K", "V", "O", "WS", "B", "H", "H_kv", "S_q", "S_k"]
        assert kernel["args"][0] == ["Q", "ptr"] and "gqa" in kernel["features"]
    assert module.GQA is True


def test_two_runs_combine_and_runs_of_other_gpus_are_refused(tmp_path: Path) -> None:
    faster = MMA.replace(BLOCK_N=128)
    first = make_run(tmp_path / "a")
    second = make_run(tmp_path / "b", {LARGE128: {faster: 400.0}, SMALL: {faster: 30.0}}, name="second")
    per = per_shape_winners([first, second])
    won = {w.label: (w.config, w.run) for w in per.winners}
    assert won[LARGE128] == (faster.key(), str(second)) and won[SMALL] == (WMMA.key(), str(first))
    assert per.fallback == MMA.key()  # the first run's
    export_runs([first, second], tmp_path / "out")
    module = load_module(tmp_path / "out")
    assert module.dispatch("fp16", 128, False, 4, 16, 2048, 2048) == faster.key()

    other = make_run(tmp_path / "c", gpu="NVIDIA L4")
    with pytest.raises(ExportError, match="different GPUs: NVIDIA H100 80GB HBM3 .*NVIDIA L4"):
        per_shape_winners([first, other])
    done = cli("export", str(first), str(other), "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "different GPUs" in done.stderr


def test_cli_leaderboard_per_shape_and_export(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    table = cli("leaderboard", str(run), "--per-shape", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    at = next(i for i, line in enumerate(lines) if line.startswith(DECODE))
    row, folded = lines[at], " ".join(lines[at:at + 2]).split()   # a long label folds onto the next line
    assert SPLIT.key()[:6] in row and "25.0" in row and "30.0" in row and "1.20" in row
    assert all(word in folded for word in SPLIT.short_label().split())
    assert any(line.startswith(f"{MMA.key()} (3 cases, fallback): mma 128x64 w4") for line in lines)
    doc = json.loads(cli("leaderboard", str(run), "--per-shape", "--json", cwd=tmp_path).stdout)
    assert {c["label"]: c["config"] for c in doc["cases"]}[SMALL] == WMMA.key() and doc["fallback"] == MMA.key()

    both = cli("leaderboard", str(run), str(run), cwd=tmp_path)
    assert both.returncode == 2 and "--per-shape" in both.stderr
    ranked = cli("export", str(run), str(run), "--rank", "1", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert ranked.returncode == 2 and "--rank" in ranked.stderr and "Traceback" not in ranked.stderr

    done = cli("export", str(run), "--out", str(tmp_path / "best"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the module stands alone: torch only (cupy is imported at the first launch), from another directory
    probe = subprocess.run(
        [sys.executable, "-S", "-c",
         "import sys; sys.path[:0] = sys.argv[2:]; sys.path.insert(0, sys.argv[1]); import evo_attention as m\n"
         "print(m.dispatch('fp16', 128, False, 8, 32, 1, 4096), 'cupy' in sys.modules)",
         str(tmp_path / "best"), *[p for p in sys.path if "site-packages" in p]],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert probe.stdout.split() == [SPLIT.key(), "False"], probe.stderr


def test_rank_export_holds_one_configuration(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    done = cli("export", str(run), "--rank", "2", "--out", str(tmp_path / "second"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "second" / "kernel.json").read_text())
    board = json.loads(cli("leaderboard", str(run), "--json", cwd=tmp_path).stdout)
    assert info["mode"] == "rank" and info["rank"] == 2 and info["config"] == board["entries"][1]["config"]
    assert {(k["head_dim"], k["causal"]) for k in info["kernels"]} == {(64, False), (64, True), (128, False), (128, True)}
    assert len(info["configs"]) == 1
    module = load_module(tmp_path / "second")
    assert {module.dispatch("fp16", d, c, 8, 32, 1, 4096) for d in (64, 128) for c in (False, True)} == {info["key"]}


# -- the kernel argument list -------------------------------------------------------------------


def test_kernel_args_are_read_from_the_kernel_signature() -> None:
    from evoengineer.kernels import render
    from evoengineer.space import Variant

    source = render("flash_attention", SPLIT, Variant(128, False)).source
    args = kernel_args(source, "attn_combine")
    assert args[:6] == [("Q", "ptr"), ("K", "ptr"), ("V", "ptr"), ("O", "ptr"), ("WS", "ptr"), ("B", "i32")]
    assert ("q_sb", "i64") in args and args[-1] == ("scale_log2", "f32")
    gqa = source.replace("int B, int H, int S_q", "int B, int H, int H_kv, int S_q")
    assert [n for n, _ in kernel_args(gqa, "attn_fwd")][5:9] == ["B", "H", "H_kv", "S_q"]
    with pytest.raises(ExportError, match="'alpha' is not one the module knows"):
        kernel_args(source.replace("float scale_log2", "float alpha"), "attn_fwd")
    with pytest.raises(ExportError, match="no __global__ definition"):
        kernel_args(source, "attn_bwd")


def test_kernels_that_take_a_kv_head_count_serve_grouped_query_attention(tmp_path: Path) -> None:
    """What the GQA templates will emit (``int H_kv`` after ``int H``): the export reads it from
    the measured sources, packs H_kv, and accepts H_q a multiple of H_kv."""
    from evoengineer.kernels import render
    from evoengineer.space import Variant

    run = make_run(tmp_path / "run", {SMALL: {WMMA: 20.0}, SMALL_C: {WMMA: 15.0}})
    for variant in (Variant(d, c) for d in (64, 128) for c in (False, True)):
        source = render("flash_attention", WMMA, variant).source
        gqa = source.replace("int B, int H, int S_q", "int B, int H, int H_kv, int S_q")
        (run / "sources" / f"{WMMA.key()}-{variant.label()}.cu").write_text(gqa)
    export_runs([run], tmp_path / "out")
    module = load_module(tmp_path / "out")
    assert module.GQA is True
    assert all("gqa" in spec["features"] for spec in module.KERNELS.values())
    with FakeTensorMode():
        q = torch.empty(2, 32, 128, 64, dtype=torch.float16, device="cuda")
        kv = torch.empty(2, 8, 128, 64, dtype=torch.float16, device="cuda")
        assert module.attention(q, kv, kv, is_causal=True, enable_gqa=True).shape == (2, 32, 128, 64)
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            module.attention(q, kv, kv)
    values = module.arguments.scalar_values(2, 32, 8, 128, 128, (1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12), 0.5)
    assert values["H_kv"] == 8 and values["H"] == 32


# -- the fake implementation and the errors -----------------------------------------------------------


def test_the_op_on_fake_tensors_gives_the_output_meta(exported) -> None:
    _, module = exported
    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 8, 300, 64, dtype=torch.float16, device="cuda")
        for out in (module.attention(q, k, k, is_causal=True), module.attention_op(q, k, k, True, 0.1, False),
                    getattr(torch.ops, module.OP_NAMESPACE).attention(q, k, k)):
            assert (out.shape, out.dtype, out.device.type) == ((2, 8, 100, 64), torch.float16, "cuda")
        decode = module.attention(torch.empty(8, 32, 1, 128, dtype=torch.float16, device="cuda"),
                                  torch.empty(8, 32, 4096, 128, dtype=torch.float16, device="cuda"),
                                  torch.empty(8, 32, 4096, 128, dtype=torch.float16, device="cuda"))
        assert decode.shape == (8, 32, 1, 128)
        bshd = torch.empty(2, 100, 8, 64, dtype=torch.float16, device="cuda").transpose(1, 2)  # (B, S, H, D) memory
        out = module.attention(bshd, bshd, bshd)
        assert out.stride() == bshd.stride()  # so hf_attention's transpose back is free
        with pytest.raises(TypeError, match="one dtype"):
            module.attention(q, k.float(), k)


def _cpu(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


BAD_INPUTS = {
    "cpu tensors": ((_cpu(1, 2, 8, 64),) * 3, {}, ValueError, "q, k and v must be CUDA tensors, got device cpu"),
    "mismatched dtypes": ((_cpu(1, 2, 8, 64), _cpu(1, 2, 8, 64, dtype=torch.bfloat16), _cpu(1, 2, 8, 64)), {}, TypeError,
                          "must have one dtype, got q torch.float16, k torch.bfloat16, v torch.float16"),
    "dtype not exported": ((_cpu(1, 2, 8, 64, dtype=torch.float32),) * 3, {}, TypeError,
                           "dtype torch.float32 has no exported kernel; this module covers torch.float16"),
    "mismatched head dims": ((_cpu(1, 2, 8, 64), _cpu(1, 2, 8, 128), _cpu(1, 2, 8, 128)), {}, ValueError,
                             "must have one head_dim, got q 64, k 128, v 128"),
    "head dim not exported": ((_cpu(1, 2, 8, 96),) * 3, {}, ValueError, "no exported kernel for fp16 head_dim 96"),
    "last dim not contiguous": ((_cpu(1, 2, 8, 128)[..., ::2],) * 3, {}, ValueError,
                                r"q needs a contiguous last dimension \(stride 1\), got strides \(2048, 1024, 128, 2\)"),
    "not 4-D": ((_cpu(2, 8, 64),) * 3, {}, ValueError, r"q must be 4-D \(batch, heads, seq, head_dim\), got shape \(2, 8, 64\)"),
    "gqa without enable_gqa": ((_cpu(1, 4, 8, 64), _cpu(1, 2, 8, 64), _cpu(1, 2, 8, 64)), {}, ValueError,
                               "q has 4 heads and k, v have 2; pass enable_gqa=True"),
    "heads not a multiple": ((_cpu(1, 4, 8, 64), _cpu(1, 3, 8, 64), _cpu(1, 3, 8, 64)), {"enable_gqa": True}, ValueError,
                             r"q's heads \(4\) must be a multiple of k and v's heads \(3\)"),
    "k and v differ": ((_cpu(1, 2, 8, 64), _cpu(1, 2, 8, 64), _cpu(1, 2, 9, 64)), {}, ValueError, "shapes do not match"),
    "scale not positive": ((_cpu(1, 2, 8, 64),) * 3, {"scale": 0.0}, ValueError, "scale must be positive"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error(exported, case: str) -> None:
    _, module = exported
    args, kwargs, kind, message = BAD_INPUTS[case]
    with pytest.raises(kind, match=r"^attention: .*" + message):
        module.attention(*args, **kwargs)


def test_inputs_that_require_grad_take_the_training_path_and_its_checks(exported) -> None:
    _, module = exported
    q = _cpu(1, 2, 8, 64)
    k = _cpu(1, 2, 8, 64).requires_grad_()
    with pytest.raises(ValueError, match="^attention: q, k and v must be CUDA tensors"):   # the LSE forward's checks
        module.attention(q, k, k)
    with pytest.raises(ValueError, match="^attention: no exported kernel for fp16 head_dim 96"):   # forward first
        module.attention(*(torch.zeros(1, 2, 8, 96, dtype=torch.float16, device="meta", requires_grad=True),) * 3)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA tensors"):  # no grad needed: the inference checks
        module.attention(q, k, k)


# -- Hugging Face ------------------------------------------------------------------------------------


class _Llamaish:
    is_causal = True
    num_key_value_groups = 2


def test_hf_attention_reads_no_mask_causal_padding_and_windows_and_refuses_the_rest(exported) -> None:
    _, module = exported
    causal = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    plan = module.hf.mask_plan(causal, 2, 6, 6)
    assert plan.causal is True and plan.features == module.features.PLAIN and plan.seqlens_k is None
    assert module.hf.mask_plan(torch.ones(2, 1, 6, 6, dtype=torch.bool), 2, 6, 6).causal is False
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert module.hf.mask_plan(additive, 2, 6, 6).causal is True
    assert module.hf.mask_plan(torch.ones(1, 1, 1, 9, dtype=torch.bool), 2, 1, 9).causal is False  # decode: the whole cache
    padded = causal.clone()
    padded[1, :, :, 0] = False  # left padding of one token in the second row
    plan = module.hf.mask_plan(padded, 2, 6, 6)
    assert plan.causal and plan.leftpad_k.tolist() == [0, 1] and plan.seqlens_k is None
    q = _cpu(2, 4, 6, 64)
    kv = _cpu(2, 2, 6, 64)
    scattered = causal.clone()
    scattered[1, :, 4, 2] = False
    packed = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool().view(1, 1, 6, 6) & causal  # two sequences
    for mask, message in ((scattered, "is not padding"), (packed, "is not padding"),
                          (additive + 0.5, "general additive bias")):
        with pytest.raises(ValueError, match="^hf_attention: .*" + message):
            module.hf_attention(_Llamaish(), q if mask.shape[-2] == 6 else _cpu(2, 4, 3, 64),
                                kv if mask.shape[-1] == 6 else _cpu(2, 2, 9, 64), kv if mask.shape[-1] == 6 else _cpu(2, 2, 9, 64), mask)
    with pytest.raises(ValueError, match="^hf_attention: dropout 0.1 is not supported"):
        module.hf_attention(_Llamaish(), q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention sinks"):
        module.hf_attention(_Llamaish(), q, kv, kv, None, s_aux=torch.zeros(4))
    # accepted masks, soft-capping, windows and GQA (K/V repeated for kernels without a K/V head count)
    # reach the kernel's checks
    for mask, extra in ((additive, {}), (padded, {}), (None, {"softcap": 30.0}), (None, {"sliding_window": 4})):
        with pytest.raises(ValueError, match="CUDA tensors"):
            module.hf_attention(_Llamaish(), q, kv, kv, mask, scaling=0.125, **extra)
    # queries after a cache, causal aligned bottom-right, is a window (left, right) aligned top-left
    after_cache = torch.ones(1, 1, 3, 9, dtype=torch.bool).tril(diagonal=6)
    plan = module.hf.mask_plan(after_cache, 2, 3, 9)
    assert not plan.causal and (plan.features.window_left, plan.features.window_right) == (2, 6)


def test_register_hf_registers_the_function_and_sdpas_masks(exported) -> None:
    transformers = pytest.importorskip("transformers")
    _, module = exported
    assert module.register_hf("evo_test") == "evo_test"
    assert transformers.AttentionInterface._global_mapping["evo_test"] is module.hf_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["evo_test"]
    # sdpa's builder, but no mask where there is no padding, also while tracing
    padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    causal = {"batch_size": 2, "q_length": 6, "kv_length": 6, "q_offset": 0, "kv_offset": 0}
    sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert builder(**causal) is None and builder(**causal, attention_mask=padding).equal(sdpa(**causal, attention_mask=padding))
    for other in ({"local_size": 4}, {"allow_is_causal_skip": False}):   # a window that bites; a caller that needs the mask
        assert builder(**causal, **other).equal(sdpa(**causal, **{"allow_is_causal_skip": False, **other}))
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
    embeds = torch.zeros(2, 6, 32)

    config._attn_implementation = "evo_test"   # traced (transformers 5.17's sdpa builder makes the whole mask there)
    traced = torch.compile(lambda e: create_causal_mask(config, e, None, None), backend="eager", fullgraph=True)
    assert traced(embeds) is None


# -- a fallback that does not hold every head dim of the export ---------------------------------------------

WG128 = Config({"PATH": "wgmma", "CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PRODUCER": 1,
                "REG_PRODUCER": 24, "REG_CONSUMER": 240, "INTRA_WG_OVERLAP": 1, "PINGPONG": 1, "LOAD": "tma"})
MMA_PAD = Config({"PATH": "mma", "BLOCK_M": 64, "BLOCK_N": 64, "WARPS": 4, "VEC": 8, "STAGES": 2, "SMEM_LAYOUT": "pad",
                  "Q_IN_REGS": 0, "P_IN_REGS": 1, "SPLITS": 1})


SWITCHED = {"seqlens", "softcap", "varlen", "window"}


def _two_dims_run(path: Path, other: int, other_causal: list[bool]) -> Path:
    doc = space_doc("dims")
    doc["problem"]["shapes"] = [{"B": 4, "H": 16, "S": 2048, "D": 64, "causal": [False, True]},
                                {"B": 1, "H": 8, "S": 512, "D": other, "causal": other_causal}]
    doc["search"]["seeds"] = []
    times = {"B4 H16 S2048 D64": {WG128: 100.0}, "B4 H16 S2048 D64 causal": {WG128: 60.0}}
    for causal in other_causal:
        times[f"B1 H8 S512 D{other}{' causal' if causal else ''}"] = {MMA_PAD: 400.0}
    return make_run(path, times, space=doc, sdpa={label: 100.0 for label in times})


def test_a_fallback_invalid_at_a_head_dim_is_left_out_there_with_a_note(tmp_path: Path) -> None:
    export_runs([_two_dims_run(tmp_path / "run", 256, [False, True])], tmp_path / "out")
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())
    assert info["key"] == WG128.key()   # the fallback: the geometric-mean winner
    assert any("not valid at fp16 D256" in note and "wgmma." in note for note in info["notes"])
    plain = {(k["head_dim"], k["config"]) for k in info["kernels"] if not SWITCHED & set(k["features"])}
    assert (256, WG128.key()) not in plain and (256, MMA_PAD.key()) in plain and (64, WG128.key()) in plain
    assert {k["config"] for k in info["kernels"] if k["head_dim"] == 256} == {MMA_PAD.key()}   # with features too


def test_a_head_dim_measured_causal_only_gets_a_plain_kernel_for_full_calls(tmp_path: Path) -> None:
    """D256 causal measured, the fallback (WG128) invalid at D256: full D256 calls get the mma kernel."""
    export_runs([_two_dims_run(tmp_path / "run", 256, [True])], tmp_path / "out")
    info = json.loads((tmp_path / "out" / "kernel.json").read_text())
    full256 = [k for k in info["kernels"] if (k["head_dim"], k["causal"]) == (256, False)]
    assert {k["config"] for k in full256} == {MMA_PAD.key()}
    assert any(not SWITCHED & set(k["features"]) for k in full256) and any(SWITCHED & set(k["features"]) for k in full256)
    module = load_module(tmp_path / "out")
    assert module.dispatch("fp16", 256, False, 1, 8, 512, 512) == MMA_PAD.key()
