"""The export's features timed as a user calls them (``exported_vs_sdpa.py --features``): a
sliding window, soft-capping, a padded batch, packed sequences of different lengths, and the
head dims 96 and 256, each row against the SDPA call a user would make for the same result
and, where it is installed and takes the feature, flash-attn-4.

What ``sdpa`` is on each row (``FeatureRow.sdpa``):

- window, padding: SDPA with the equivalent boolean mask (SDPA has no window or key-length
  argument), K and V repeated to the query heads beforehand (transformers' sdpa path repeats
  them where it passes a mask; the copy is not timed); on the padded batch SDPA computes the
  padded query rows, which ours (``seqlens_q``) and flash-attn-4 (``seqused_q``) skip;
- varlen: SDPA sequence by sequence (``is_causal``, grouped heads through ``enable_gqa``) and
  the outputs concatenated, as code without packed-sequence support runs them; a block-diagonal
  mask over the packed tokens would cost the square of the total length;
- softcap: none (SDPA cannot soft-cap);
- plain: SDPA's causal call.

``sdpa floor`` (window, softcap, padding) is SDPA's plain causal call over the same tensors: not
the same computation (no window, cap or padding), the cost of attention without the feature, to
read ``evo`` against. Every row is causal and compared by the interleaved rounds of
``calls.measure_rounds``; the error is against an fp32 reference with the same mask
(``runtime.features.attend``, ``runtime.varlen.reference_varlen``).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from ..runtime.features import CallFeatures, Uncovered, allowed_keys, attend, repeat_kv, select_kernel
from .calls import block_lines, combine_rounds, measure_rounds, speedups
from .rotation import attention_set_bytes, cold_set_count

FEATURES = ("window", "softcap", "padding", "varlen", "plain")
SWITCH = {"window": "window", "softcap": "softcap", "padding": "seqlens", "varlen": "varlen", "plain": None}
"""The kernel switch (``runtime.features.SWITCHES``) each row's feature needs."""
FLOOR = "sdpa floor"
FEATURE_PAIRED = ("evo", "sdpa", FLOOR, "fa4")
"""Implementations of a feature row, interleaved in rounds (no forced SDPA backends)."""


@dataclass(frozen=True)
class FeatureRow:
    """One row: a causal call with one feature. ``lengths``: padding, each batch's key count (the
    batch padded to ``seq``); varlen, the packed sequences (``batch`` of them, ``seq`` the longest)."""

    name: str
    feature: str
    batch: int
    heads: int
    heads_kv: int
    seq: int
    head_dim: int
    window_left: int = -1
    softcap: float = 0.0
    lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.feature not in FEATURES:
            raise ValueError(f"{self.name}: feature {self.feature!r} is not one of {', '.join(FEATURES)}")
        if self.feature in ("padding", "varlen") and (len(self.lengths) != self.batch or max(self.lengths) > self.seq
                                                     or (self.feature == "varlen" and max(self.lengths) != self.seq)):
            raise ValueError(f"{self.name}: {self.batch} lengths of at most (varlen: the longest exactly) {self.seq}")

    @property
    def dims(self) -> tuple[int, int, int, int, int, int]:
        """(B, H, H_kv, S_q, S_k, D) as the plain rows give them (varlen: B sequences of the longest)."""
        return (self.batch, self.heads, self.heads_kv, self.seq, self.seq, self.head_dim)

    @property
    def gqa(self) -> bool:
        return self.heads != self.heads_kv

    @property
    def needed(self) -> tuple[str, ...]:
        """The kernel switches a call of this row needs."""
        switch = SWITCH[self.feature]
        return (switch,) if switch else ()

    @property
    def call_features(self) -> CallFeatures:
        """The call's window and cap as the runtime reads them (the mask they mean: ``allowed_keys``)."""
        return CallFeatures(window_left=self.window_left, window_right=0 if self.window_left >= 0 else -1,
                            softcap=self.softcap, seqlens=self.feature == "padding", varlen=self.feature == "varlen")

    @property
    def offsets(self) -> list[int]:
        """varlen: the packed sequences' offsets (batch + 1)."""
        from ..runtime.varlen import offsets_of

        return offsets_of(self.lengths)

    @property
    def tokens(self) -> int:
        """Query (and key) rows the call's tensors hold."""
        return sum(self.lengths) if self.feature == "varlen" else self.batch * self.seq

    @property
    def sdpa(self) -> str:
        """What the row's ``sdpa`` call is ('' where SDPA has none)."""
        return {"window": "the window as a boolean mask, K/V repeated to the query heads",
                "padding": "the causal and padding mask, K/V repeated to the query heads",
                "varlen": "a call per sequence (is_causal, enable_gqa), outputs concatenated",
                "plain": "is_causal", "softcap": ""}[self.feature]

    @property
    def floor(self) -> bool:
        """Whether the row times SDPA's plain causal call beside (``sdpa floor``)."""
        return self.feature in ("window", "softcap", "padding")

    def set_bytes(self, element_bytes: int = 2) -> int:
        """Bytes of one input set (q, k, v and the output)."""
        if self.feature == "varlen":
            return attention_set_bytes(1, self.heads, self.heads_kv, self.tokens, self.tokens, self.head_dim, element_bytes)
        return attention_set_bytes(*self.dims, element_bytes)


MIXED = (412, 1873, 96, 2048, 733, 1290, 57, 3100, 988, 1501, 240, 640, 1777, 305, 1024, 2600)
"""A packed batch as fine-tuning data packs it: 16 sequences of 57 to 3,100 tokens (18,684)."""
FEATURE_ROWS = [
    FeatureRow("B1 H32/8 S8192 D128 window 4095", "window", 1, 32, 8, 8192, 128, window_left=4095),   # Mistral 7B
    FeatureRow("B4 H16/8 S2048 D256 softcap 50", "softcap", 4, 16, 8, 2048, 256, softcap=50.0),       # Gemma-2 9B
    FeatureRow("B4 H32/8 S2048 D128 padded", "padding", 4, 32, 8, 2048, 128, lengths=(2048, 1536, 1024, 512)),
    FeatureRow("varlen 1,17,1000,4099 H32/8 D128", "varlen", 4, 32, 8, 4099, 128, lengths=(1, 17, 1000, 4099)),
    FeatureRow("varlen 16 mixed H32/8 D128", "varlen", 16, 32, 8, max(MIXED), 128, lengths=MIXED),
    FeatureRow("B4 H32 S2048 D96", "plain", 4, 32, 32, 2048, 96),                                     # Phi-3 mini
    FeatureRow("B4 H16/8 S2048 D256", "plain", 4, 16, 8, 2048, 256),
]


def serving_kernel(module: Any, dtype: str, row: FeatureRow) -> tuple[str, str]:
    """(why the export cannot serve the row, '') or ('', the configuration id whose kernel runs
    it), by the export's own tables and the runtime's rule (``runtime.features.select_kernel``);
    no GPU. The reason is short enough for ``<row> <dtype>: <reason>`` to fit 80 columns."""
    batch, heads, heads_kv, seq_q, seq_k, head_dim = row.dims
    variant = (dtype, head_dim, True)
    if dtype not in module.DTYPES:
        return f"no {dtype} kernels in this export", ""
    if variant not in module.DISPATCH:
        return f"no {dtype} D{head_dim} causal kernel in this export", ""
    if row.gqa and not module.GQA:
        return "no GQA kernels in this export", ""
    chosen = module.dispatch(dtype, head_dim, True, batch, heads, seq_q, seq_k, heads_kv, varlen=row.feature == "varlen",
                             padded=row.feature == "padding")
    if not row.needed:
        return "", chosen
    kernels = {key: SimpleNamespace(config=key[3], features=tuple(spec.get("features", ())))
               for key, spec in module.KERNELS.items()}
    try:
        spec = select_kernel(kernels, variant, chosen, module.DISPATCH[variant][0], row.needed)
    except Uncovered:
        return f"no {dtype} D{head_dim} causal kernel with {' and '.join(row.needed)}", ""
    return "", spec.config


# -- inputs and calls (torch; a GPU, or the CPU for the SDPA side in tests) ------------------------


def feature_inputs(row: FeatureRow, dtype: Any, sets: int, device: Any = "cuda", seed: int = 0) -> list[tuple]:
    """``sets`` input sets (q, k, v), standard normal: (B, H, S, D) and (B, H_kv, S, D); varlen
    packed, (total, H, D) and (total, H_kv, D)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    if row.feature == "varlen":
        shapes = [(row.tokens, row.heads, row.head_dim), (row.tokens, row.heads_kv, row.head_dim)]
    else:
        shapes = [(row.batch, row.heads, row.seq, row.head_dim), (row.batch, row.heads_kv, row.seq, row.head_dim)]
    return [tuple(torch.randn(*shapes[min(i, 1)], generator=gen, device=device, dtype=dtype) for i in range(3))
            for _ in range(sets)]


@dataclass
class RowTensors:
    """What a row's calls share beyond the input sets: the mask, key lengths, offsets."""

    mask: Any = None
    lengths: Any = None
    offsets: Any = None


def row_tensors(row: FeatureRow, device: Any) -> RowTensors:
    """The boolean mask (window, padding), the int32 key lengths (padding) and offsets (varlen)."""
    import torch

    out = RowTensors()
    if row.feature == "padding":
        out.lengths = torch.tensor(row.lengths, dtype=torch.int32, device=device)
    if row.feature in ("window", "padding"):
        out.mask = allowed_keys(row.batch if row.feature == "padding" else 1, row.seq, row.seq, True, row.call_features,
                                seqlens_k=out.lengths, device=device)
    if row.feature == "varlen":
        out.offsets = torch.tensor(row.offsets, dtype=torch.int32, device=device)
    return out


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword ``name`` (flash-attn-4's signature differs by version)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def sdpa_calls(row: FeatureRow, sets: list[tuple], shared: RowTensors) -> dict[str, Callable[..., Any]]:
    """``sdpa`` (the equivalent call, where SDPA has one) and ``sdpa floor`` (the plain causal
    call, on rows with a feature SDPA expresses only as a mask or not at all)."""
    import torch.nn.functional as F

    calls: dict[str, Callable[..., Any]] = {}
    if row.feature in ("window", "padding"):
        repeated = {id(q): (repeat_kv(k, row.heads), repeat_kv(v, row.heads)) for q, k, v in sets}
        mask = shared.mask
        calls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, *repeated[id(q)], attn_mask=mask)
    elif row.feature == "varlen":
        from ..runtime.varlen import sdpa_per_sequence

        offsets = list(row.offsets)
        calls["sdpa"] = lambda q, k, v: sdpa_per_sequence(q, k, v, offsets, offsets, True)
    elif row.feature == "plain":
        calls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=row.gqa)
    if row.floor:
        calls[FLOOR] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=row.gqa)
    return calls


def fa4_call(row: FeatureRow, sets: list[tuple], shared: RowTensors) -> tuple[Callable[..., Any] | None, str]:
    """flash-attn-4's call for the row (on (B, S, H, D) copies of dense sets), or (None, why not)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - absent or broken: no fa4 column
        return None, "flash-attn-4 is not installed"
    if row.feature == "varlen":
        if not accepts(flash_attn_varlen_func, "cu_seqlens_q"):
            return None, "flash_attn_varlen_func takes no cu_seqlens_q"
        offsets, longest = shared.offsets, row.seq
        return (lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                                                        max_seqlen_q=longest, max_seqlen_k=longest, causal=True)), ""
    copies = {id(q): tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) for q, k, v in sets}
    if row.feature == "padding":
        if not (accepts(flash_attn_varlen_func, "seqused_q") and accepts(flash_attn_varlen_func, "seqused_k")):
            return None, "flash_attn_varlen_func takes no seqused_q/seqused_k"
        used = shared.lengths
        return (lambda q, k, v: flash_attn_varlen_func(*copies[id(q)], seqused_q=used, seqused_k=used, causal=True)), ""
    keywords: dict[str, Any] = {}
    if row.feature == "window":
        keywords["window_size"] = (row.window_left, 0)
    if row.feature == "softcap":
        keywords["softcap"] = row.softcap
    missing = [name for name in keywords if not accepts(flash_attn_func, name)]
    if missing:
        return None, f"flash_attn_func takes no {missing[0]}"
    return (lambda q, k, v: flash_attn_func(*copies[id(q)], causal=True, **keywords)), ""


def evo_call(module: Any, row: FeatureRow, shared: RowTensors) -> Callable[..., Any]:
    """The export's call for the row, as a user writes it."""
    if row.feature == "varlen":
        offsets, longest = shared.offsets, row.seq
        return lambda q, k, v: module.attention_varlen(q, k, v, offsets, offsets, longest, longest, is_causal=True)
    keywords: dict[str, Any] = {}
    if row.feature == "window":
        keywords["window_size"] = (row.window_left, 0)
    elif row.feature == "softcap":
        keywords["softcap"] = row.softcap
    elif row.feature == "padding":   # the padded rows skipped, as flash-attn-4's seqused_q
        keywords["seqlens_k"] = keywords["seqlens_q"] = shared.lengths
    gqa = row.gqa
    return lambda q, k, v: module.attention(q, k, v, is_causal=True, enable_gqa=gqa, **keywords)


def reference(row: FeatureRow, q: Any, k: Any, v: Any, shared: RowTensors) -> Any:
    """The row's result in fp32 (the same mask, window, cap and lengths), by torch alone."""
    q, k, v = q.float(), k.float(), v.float()
    if row.feature == "varlen":
        from ..runtime.varlen import reference_varlen   # imports torch: only where a row runs

        return reference_varlen(q, k, v, row.offsets, row.offsets, True, None, row.call_features)
    mask = shared.mask if shared.mask is not None else allowed_keys(1, row.seq, row.seq, True, device=q.device)
    if row.feature == "padding":   # the padded rows see no key (0), as ours skips them
        mask = allowed_keys(row.batch, row.seq, row.seq, True, seqlens_k=shared.lengths, device=q.device,
                            seqlens_q=shared.lengths)
    return attend(q, k, v, mask, None, row.softcap)


# -- the rows measured -------------------------------------------------------------------------------


def feature_title(row: FeatureRow, dtype: str) -> str:
    """``B4 H32 S2048 D96 bf16`` (every feature row is causal)."""
    return f"{row.name} {dtype}"


def measure_features(module: Any, rows: list[FeatureRow], dtypes: list[str], calls: int, repetitions: int, rounds: int,
                     say: Callable[[str], None] = print, peers: bool = True, device: str = "cuda",
                     l2_bytes: int | None = None) -> tuple[list[dict], list[str]]:
    """Every row x dtype measured (``say`` gets each row's block of lines and each skipped row's
    one line): (result rows, one per implementation, and notes). The input sets together
    outgrow twice the L2 (the GPU's, or ``l2_bytes``)."""
    import torch

    results: list[dict] = []
    notes: list[str] = []
    for row in rows:
        for dtype_name in dtypes:
            title = feature_title(row, dtype_name)
            why, config = serving_kernel(module, dtype_name, row)
            if why:
                notes.append(f"{title}: {why}")
                say(notes[-1])
                continue
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
            sets = feature_inputs(row, dtype, cold_set_count(row.set_bytes(), l2_bytes=l2_bytes), device)
            shared = row_tensors(row, device)
            ours = evo_call(module, row, shared)
            try:
                out = ours(*sets[0]).float()
            except Exception as exc:  # noqa: BLE001 - refused or failed (a compile, a launch): one line, next row
                notes.append(f"{title}: the call failed: {first_line(exc)}")
                say(notes[-1])
                continue
            try:
                err = float((out - reference(row, *sets[0], shared)).abs().max())
            except torch.cuda.OutOfMemoryError as exc:
                err = math.nan
                notes.append(f"{title}: no error figure, the fp32 reference ran out of memory: {first_line(exc)}")
                say(notes[-1])
            del out
            impls = {"evo": ours, **sdpa_calls(row, sets, shared)}
            fa4, no_fa4 = fa4_call(row, sets, shared) if peers else (None, "")
            if fa4 is not None:
                impls["fa4"] = fa4
            per_round = measure_rounds(impls, sets, calls, max(5, repetitions // rounds), rounds, FEATURE_PAIRED)
            measured = [combine_rounds(impl, per_round[impl]) for impl in impls]
            versus = {theirs: speedups(measured, theirs=theirs) for theirs in ("sdpa", FLOOR, "fa4")}
            short = module.CONFIGS[config]["short"] if config in module.CONFIGS else config
            for line in feature_block(f"{title}: {short}", row, measured, versus, err, no_fa4):
                say(line)
            for r in measured:
                results.append({"shape": row.name, "feature": row.feature, "dtype": dtype_name, "causal": True,
                                "batch": row.batch, "heads": row.heads, "heads_kv": row.heads_kv, "seq_q": row.seq,
                                "seq_k": row.seq, "head_dim": row.head_dim, "lengths": list(row.lengths),
                                "window_left": row.window_left, "softcap": row.softcap, "config": config,
                                "max_abs_err": err, **r,
                                **({f"speedup_{tag}_{c}": v[c] for tag, v in (("sdpa", versus["sdpa"]),
                                                                              ("floor", versus[FLOOR]),
                                                                              ("fa4", versus["fa4"]))
                                    for c in ("device_us", "eager_us") if v}
                                   if r["impl"] == "evo" else {})})
            del sets, shared, impls
            if device == "cuda":
                torch.cuda.empty_cache()
    return results, notes


def first_line(exc: BaseException) -> str:
    """An exception's first line (160 characters at most), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def feature_block(title: str, row: FeatureRow, measured: list[dict], versus: dict[str, dict], err: float,
                  no_fa4: str = "") -> list[str]:
    """A row's lines within 80 columns: each implementation's times (``calls.block_lines``), the
    speed-ups (SDPA's time / ours) against SDPA's equivalent call, its plain causal floor and
    flash-attn-4, and the error against the fp32 reference."""
    lines = block_lines(title, measured, versus["sdpa"], None)
    if not row.sdpa:
        lines.append("  sdpa: none, SDPA cannot soft-cap")
    if versus[FLOOR]:
        f = versus[FLOOR]
        lines.append(f"  ×floor device {f['device_us']:.2f} eager {f['eager_us']:.2f} "
                     "(SDPA plain causal: not the same computation)")
    if versus["fa4"]:
        lines.append(f"  ×fa4 device {versus['fa4']['device_us']:.2f} eager {versus['fa4']['eager_us']:.2f}"
                     + (" (both skip the padded rows)" if row.feature == "padding" else ""))
    elif no_fa4:
        lines.append(f"  fa4: none, {no_fa4}")
    lines.append(f"  max abs error against an fp32 reference with the same mask: {err:.1e}")
    return lines


def feature_summary_lines(results: list[dict]) -> list[str]:
    """The feature rows' device speed-ups in one table (SDPA's, the floor's and flash-attn-4's
    time over ours) and how many rows reach 1.0 against SDPA (its equivalent call, else its
    floor) and against flash-attn-4; within 80 columns."""
    evo = [r for r in results if r["impl"] == "evo" and r.get("status") == "ok"]
    if not evo:
        return []

    def figure(r: dict, tag: str) -> str:
        value = r.get(f"speedup_{tag}_device_us")
        return f"{value:>7.2f}" if value is not None and math.isfinite(value) else f"{'-':>7}"

    lines = ["feature rows, device time: ×sdpa, ×floor (SDPA's plain causal call), ×fa4",
             f"  {'row':<42}{'×sdpa':>7}{'×floor':>7}{'×fa4':>7}{'error':>9}"]
    versus_sdpa, versus_fa4 = [], []
    for r in evo:
        label = f"{r['shape']} {r['dtype']}"
        lines.append(f"  {label[:42]:<42}{figure(r, 'sdpa')}{figure(r, 'floor')}{figure(r, 'fa4')}{r['max_abs_err']:>9.1e}")
        against = r.get("speedup_sdpa_device_us", r.get("speedup_floor_device_us"))
        if against is not None:
            versus_sdpa.append(against >= 1.0)
        if r.get("speedup_fa4_device_us") is not None:
            versus_fa4.append(r["speedup_fa4_device_us"] >= 1.0)
    lines.append(f"  ×sdpa >= 1.0 (the floor where SDPA has no such call): {sum(versus_sdpa)} of {len(versus_sdpa)} rows")
    lines.append(f"  ×fa4 >= 1.0: {sum(versus_fa4)} of {len(versus_fa4)} rows")
    return lines


def list_lines(rows: list[FeatureRow], dtypes: list[str], module: Any = None) -> list[str]:
    """The rows and what each compares (with an export: the kernel that serves it, or why none)."""
    lines = []
    for row in rows:
        for dtype in dtypes:
            line = feature_title(row, dtype)
            if module is not None:
                why, config = serving_kernel(module, dtype, row)
                line += f": {why}" if why else f": {module.CONFIGS[config]['short']}"
            lines.append(line)
        lines.append(f"  sdpa: {row.sdpa or 'none, SDPA cannot soft-cap'}")
        if row.floor:
            lines.append("  sdpa floor: SDPA's plain causal call (not the same computation)")
    return lines
