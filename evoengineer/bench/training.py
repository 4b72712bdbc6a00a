"""The backward of an export against SDPA's and flash-attn-4's, and a small Llama's training step.

Backward device time: each side's backward alone (the forward ran once before, its saved
state reused), timed by ``gpu.timing.time_graph`` (CUDA-graph replay, rotating over input sets
that L2 cannot hold) in interleaved rounds (``protocol.run_rounds``); ratios are paired per
round (``protocol.paired_ratio``). Sides: ``evo`` (the export's ``attention_backward`` op),
``cudnn`` (SDPA's default on Hopper, forced), ``flash`` (SDPA's FlashAttention-2 backend, forced)
and ``fa4`` (flash-attn-4's ``flash_attn.cute.flash_attn_func`` through autograd, where installed).
TF/s count 2.5 times the forward's FLOPs (4 B H S_q S_k D), half of it for causal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .features import MIXED
from .protocol import Summary, geomean, paired_ratio, run_rounds
from .rotation import attention_set_bytes, cold_set_count

SIDES = ("evo", "cudnn", "flash", "fa4")


@dataclass(frozen=True)
class TrainShape:
    batch: int
    heads: int
    heads_kv: int
    seq: int
    head_dim: int

    def label(self) -> str:
        heads = f"H{self.heads}" if self.heads == self.heads_kv else f"H{self.heads}/{self.heads_kv}"
        return f"B{self.batch} {heads} S{self.seq} D{self.head_dim}"


SHAPES = (TrainShape(4, 16, 16, 2048, 64), TrainShape(4, 16, 16, 2048, 128), TrainShape(8, 16, 16, 4096, 128),
          TrainShape(2, 32, 8, 4096, 128), TrainShape(1, 32, 32, 8192, 128))
"""The shapes of the training comparison (the fourth grouped-query, the last one long sequence)."""


def backward_flops(shape: TrainShape, causal: bool) -> float:
    """2.5 times the forward's 4 B H S^2 D, half for causal."""
    forward = 4.0 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim
    return 2.5 * forward / (2 if causal else 1)


def _inputs(shape: TrainShape, dtype: Any, seed: int) -> tuple[Any, Any, Any, Any]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(shape.batch, h, shape.seq, shape.head_dim, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    return make(shape.heads), make(shape.heads_kv), make(shape.heads_kv), make(shape.heads)


def backward_call(side: str, module: Any, q: Any, k: Any, v: Any, do: Any, causal: bool) -> Callable[[], Any]:
    """One backward of ``side`` on these inputs (its forward run once here, its state kept)."""
    from ..gpu.backward_jobs import sdpa_backward_op

    gqa = q.shape[1] != k.shape[1]
    if side == "evo":
        out, lse = module.attention_lse_op(q, k, v, causal, None, gqa, False)
        op = module.attention_backward_op
        return lambda: op(do, q, k, v, out, lse, causal, None, gqa, False)
    return sdpa_backward_op(side, q, k, v, do, causal, None)


def time_backwards(module: Any, shape: TrainShape, dtype: Any, causal: bool, sides: Sequence[str], rounds: int,
                   repetitions: int) -> dict[str, Any]:
    """side -> list of per-round median µs (a side that fails: its reason instead)."""
    from ..gpu.timing import time_graph

    sets = cold_set_count(2 * attention_set_bytes(shape.batch, shape.heads, shape.heads_kv, shape.seq, shape.seq,
                                                   shape.head_dim))
    inputs = [_inputs(shape, dtype, seed) for seed in range(sets)]
    calls: dict[str, list[Callable[[], Any]]] = {}
    reasons: dict[str, str] = {}
    for side in sides:
        try:
            calls[side] = [backward_call(side, module, *s, causal) for s in inputs]
        except Exception as exc:  # noqa: BLE001 - a side that cannot run this shape is a row, not a crash
            reasons[side] = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__

    def measure(side: str) -> float | None:
        try:
            return time_graph(calls[side], repetitions=repetitions, warmup=5).median_us
        except Exception as exc:  # noqa: BLE001
            reasons[side] = str(exc).strip().splitlines()[0][:120]
            return None

    figures = run_rounds(list(calls), rounds, measure)
    return {side: (figures[side] if figures.get(side) else reasons.get(side, "failed")) for side in sides}


def backward_row(shape: TrainShape, dtype_name: str, causal: bool, figures: dict[str, Any]) -> dict[str, Any]:
    """A table row: per side median µs and TF/s, and evo's paired time ratio against each other side."""
    flops = backward_flops(shape, causal)
    row: dict[str, Any] = {"shape": shape.label(), "dtype": dtype_name, "causal": causal, "sides": {}}
    for side, values in figures.items():
        if isinstance(values, list):
            summary = Summary.of(values)
            row["sides"][side] = {"median_us": summary.median_us, "min_us": summary.min_us, "max_us": summary.max_us,
                                  "rounds": summary.rounds, "tflops": flops / (summary.median_us * 1e-6) / 1e12}
        else:
            row["sides"][side] = {"skipped": values}
    ours = figures.get("evo")
    row["evo_time_over"] = {side: paired_ratio(ours, values) for side, values in figures.items()
                            if side != "evo" and isinstance(values, list) and isinstance(ours, list)}
    return row


def summary_lines(rows: Sequence[dict]) -> list[str]:
    """Geometric means of evo's time over each other side's (< 1: evo faster)."""
    lines = []
    for side in SIDES[1:]:
        ratios = [r["evo_time_over"][side] for r in rows if side in r.get("evo_time_over", {})]
        if ratios:
            lines.append(f"evo time / {side} time, geomean over {len(ratios)} rows: {geomean(ratios):.3f} "
                         f"(worst {max(ratios):.3f})")
    return lines


PADDED_LENGTHS = (2048, 1536, 1024, 512)
"""The padded Llama step's batch: four sequences right-padded to 2,048 tokens."""


def right_padding_mask(lengths: Sequence[int], total: int) -> Any:
    """The attention mask transformers takes for right-padded sequences: (batch, total), 1 on the
    first ``lengths[b]`` tokens of row b, 0 on its padding."""
    import torch

    return (torch.arange(total)[None, :] < torch.tensor(list(lengths))[:, None]).long()


def llama_step_times(module: Any, rounds: int, steps: int, dtype: Any, compiled: bool = False,
                     lengths: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Milliseconds per training step (forward, backward, AdamW) of a small random Llama with SDPA
    and with the export (``register_hf``), in interleaved rounds of ``steps`` steps; ``compiled``:
    each side's model under ``torch.compile`` (one model a side, compiled at its first step).
    ``lengths``: a padded batch of these lengths (right padding, 2,048 tokens a row; the padding's
    labels ignored) instead of two full rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    name = module.register_hf("evo_bench")
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
    rows = 2 if lengths is None else len(lengths)
    ids = torch.randint(0, config.vocab_size, (rows, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = None if lengths is None else right_padding_mask(lengths, 2048).cuda()
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)

    def build(implementation: str) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", dtype)
        model.set_attn_implementation(implementation)
        model.train()
        return (torch.compile(model) if compiled else model), torch.optim.AdamW(model.parameters(), lr=1e-5)

    shared = None if compiled else build("sdpa")
    sides = {implementation: build(implementation) if compiled else shared for implementation in ("sdpa", name)}

    def measure(implementation: str) -> float:
        model, optimizer = sides[implementation]
        if not compiled:
            model.set_attn_implementation(implementation)
        for _ in range(2):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps

    return run_rounds(["sdpa", name], rounds, measure)


PACKED_ROWS = (("1,17,1000,4099", (1, 17, 1000, 4099)), ("16 mixed", MIXED))
"""Packed batches a training call takes: the issue's lengths, and 16 sequences as fine-tuning packs them
(``features.MIXED``)."""


def packed_call_times(module: Any, lengths: Sequence[int], rounds: int, calls: int, dtype: Any, heads: int = 32,
                      heads_kv: int = 8, head_dim: int = 128, causal: bool = True) -> dict[str, list[float]]:
    """Milliseconds per training call (forward and the gradients of q, k, v) on packed sequences of
    ``lengths``, eager, in interleaved rounds of ``calls`` calls: the export's ``attention_varlen`` and
    SDPA sequence by sequence (``varlen.sdpa_per_sequence``: what a caller without packed kernels runs)."""
    import itertools

    import torch

    from ..runtime.varlen import sdpa_per_sequence

    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k, v = (torch.randn(total, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
    offsets = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    longest = max(lengths)
    sides = {
        "evo": lambda: module.attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal),
        "sdpa per sequence": lambda: sdpa_per_sequence(q, k, v, offsets, offsets, causal),
    }

    def measure(side: str) -> float:
        call = sides[side]
        for _ in range(2):
            torch.autograd.grad(call(), (q, k, v), do)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            torch.autograd.grad(call(), (q, k, v), do)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    return run_rounds(list(sides), rounds, measure)
