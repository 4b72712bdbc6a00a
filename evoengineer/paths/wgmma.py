"""The wgmma path (Hopper, sm_90a): warpgroup MMA from shared-memory descriptors, 64 query rows
per consumer warpgroup, an optional producer warpgroup with setmaxnreg, loads by cp.async or
TMA, persistent CTAs, and O stored by TMA."""
from __future__ import annotations

from typing import Any

from .base import KernelPath, Scope, features_rule, head_dims_rule, rule, scope_head_dims

NAME = "wgmma"
PARAMS = ("BLOCK_M", "BLOCK_N", "STAGES", "Q_IN_REGS", "CONSUMER_WGS", "PRODUCER", "REG_PRODUCER", "REG_CONSUMER",
          "INTRA_WG_OVERLAP", "PINGPONG", "LOAD", "PERSISTENT", "O_TMA", "SPLIT_TAIL", "SOFTMAX_PIN")
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
DEFAULTS = {"STAGES": 2, "Q_IN_REGS": 0, "CONSUMER_WGS": 1, "PRODUCER": 0, "REG_PRODUCER": 0, "REG_CONSUMER": 0,
            "INTRA_WG_OVERLAP": 0, "PINGPONG": 0, "LOAD": "cpasync", "PERSISTENT": 0, "O_TMA": 0, "SPLIT_TAIL": 0,
            "SOFTMAX_PIN": 0}
"""What the template takes for a parameter a configuration leaves out."""
FEATURES = ("seqlens", "softcap", "varlen", "window")
"""The compile-time features the template holds (SEQLENS, SOFTCAP, VARLEN, WINDOW). With WINDOW,
SEQLENS or VARLEN a work tile's K/V tiles start past 0, so SPLIT_TAIL, which cuts every work tile's
K/V tiles alike, is ignored (as with the causal mask); with VARLEN, O_TMA's store is replaced by
the stores from registers (a TMA store would write past a sequence's rows), and WRITE_LSE, which
serves the dense backward only, is refused."""
ARCH = "sm_90a"
REGISTER_FILE = 65536
"""32-bit registers per multiprocessor; a thread gets at most 255."""


def writes_lse(config: Scope) -> bool:
    """Whether the configuration can also write the rows' log-sum-exp (``WRITE_LSE=1``, the
    forward a backward needs): its workspace then holds the LSE, so not with a tile counter
    (``PERSISTENT=2``, which ``SPLIT_TAIL`` needs), whose workspace is the counter."""
    return config.get("PATH") == NAME and config.get("PERSISTENT", DEFAULTS["PERSISTENT"]) != 2


def panel_head_dim(head_dim: int) -> int:
    """The head dim the kernel computes with: ``head_dim`` rounded up to whole 64-column panels
    (the TMA reads zeros past the tensor's columns)."""
    return -(-head_dim // 64) * 64


def threads(c: Scope) -> int:
    """128 per consumer warpgroup, and 128 for the producer."""
    return 128 * (c["CONSUMER_WGS"] + c["PRODUCER"])


def entry_registers(warpgroups: int) -> int:
    """Registers per thread at launch (``__launch_bounds__(threads, 1)``) of a block of ``warpgroups``."""
    return min(255, REGISTER_FILE // (128 * warpgroups) // 8 * 8)


def consumer_register_cap(c: Scope) -> int:
    """Registers a consumer thread may hold: its setmaxnreg, else what the launch gives."""
    return c["REG_CONSUMER"] or entry_registers(c["CONSUMER_WGS"] + c["PRODUCER"])


def consumer_registers(c: Scope, head_dim: int) -> int:
    """Registers a consumer thread needs: the S and P accumulators (3/4 of BLOCK_N), O's
    (head_dim / 2), 32 more with intra-warpgroup overlap (two S tiles live), 24 in a persistent
    loop without overlap (it spills at the bare count), and Q's fragments with 8 to spare (64x160
    with Q in registers spills at 248 of 255)."""
    head_dim = panel_head_dim(head_dim)
    return (3 * c["BLOCK_N"] // 4 + head_dim // 2 + (32 if c["INTRA_WG_OVERLAP"] else 0)
            + (24 if c["PERSISTENT"] and not c["INTRA_WG_OVERLAP"] else 0)
            + (head_dim // 4 + 8 if c["Q_IN_REGS"] else 0))


def barriers(c: Scope) -> bool:
    """Stages tracked by mbarriers: with a producer warpgroup or TMA loads."""
    return bool(c["PRODUCER"] or c["LOAD"] == "tma")


def o_tma(c: Scope) -> bool:
    """O leaves through shared memory and a TMA store: ``O_TMA``, except for packed sequences
    (``VARLEN``, where a kernel stores O from registers)."""
    return bool(c["O_TMA"]) and not c.get("VARLEN", 0)


def smem_bytes(c: Scope, head_dim: int) -> int:
    """1 KB for the 1024-byte alignment of the swizzled tiles, the Q tile (and with O_TMA the O
    tile), STAGES K and V tiles, and 256 bytes of mbarriers where stages are tracked."""
    head_dim = panel_head_dim(head_dim)
    return (1024 + 2 * head_dim * c["BLOCK_M"] * (1 + o_tma(c)) + 4 * head_dim * c["BLOCK_N"] * c["STAGES"]
            + (256 if barriers(c) else 0))


def template_values(c: Scope, head_dim: int) -> dict[str, Any]:
    """What the template reads of these rules besides shared memory, threads and rows: the head dim
    it computes with, the registers a thread gets at launch (what setmaxnreg moves between the
    warpgroups) and whether O leaves by a TMA store."""
    return {"PANEL_HEAD_DIM": panel_head_dim(head_dim), "ENTRY_REGISTERS": entry_registers(threads(c) // 128),
            "O_TMA": int(o_tma(c))}


def _setmaxnreg_ok(c: Scope) -> bool:
    rp, rc, cwg = c["REG_PRODUCER"], c["REG_CONSUMER"], c["CONSUMER_WGS"]
    if rp == 0 and rc == 0:
        return True
    return (c["PRODUCER"] == 1 and cwg >= 2 and rp > 0 and rc > 0
            and rp + cwg * rc <= (cwg + 1) * entry_registers(cwg + 1))


RULES = (
    head_dims_rule(NAME, HEAD_DIMS),
    features_rule(NAME, FEATURES),
    rule(NAME, "panel-head-dims", "a head dim that is not a multiple of 64 needs LOAD tma (the kernel computes "
         "the next multiple of 64 from the zeros the TMA reads past the head dim)", "LOAD",
         lambda c: c["LOAD"] == "tma" or all(d % 64 == 0 for d in scope_head_dims(c))),
    rule(NAME, "cpasync-head-dims", "the cp.async loader's 128 threads cover whole rows eight at a time, one 16-byte "
         "chunk a thread: head dims up to 128 (past that, LOAD tma)", "LOAD",
         lambda c: c["LOAD"] == "tma" or all(d <= 128 for d in scope_head_dims(c))),
    rule(NAME, "arch", "wgmma and setmaxnreg exist only on sm_90a", "", lambda c: c["ARCH_NAME"] == ARCH),
    rule(NAME, "tile", "one 64-row strip per consumer warpgroup; 16-key slices, at least 64 keys a tile, "
         "at least two stages", "BLOCK_M BLOCK_N STAGES CONSUMER_WGS",
         lambda c: c["BLOCK_M"] == 64 * c["CONSUMER_WGS"] and c["BLOCK_N"] % 16 == 0 and c["BLOCK_N"] >= 64
         and c["STAGES"] >= 2),
    rule(NAME, "pingpong", "ping-pong schedules two or more consumer warpgroups fed by a producer",
         "PINGPONG PRODUCER CONSUMER_WGS",
         lambda c: not c["PINGPONG"] or (c["PRODUCER"] == 1 and c["CONSUMER_WGS"] >= 2)),
    rule(NAME, "persistent", "a persistent CTA's producer thread loads the next work tile by TMA while the "
         "consumers finish this one", "PERSISTENT PRODUCER LOAD",
         lambda c: not c["PERSISTENT"] or (c["PRODUCER"] == 1 and c["LOAD"] == "tma")),
    rule(NAME, "o-tma", "O goes through its own shared-memory buffer only in a persistent CTA (elsewhere it is "
         "staged in Q's place)", "O_TMA PERSISTENT", lambda c: not c["O_TMA"] or c["PERSISTENT"] >= 1),
    rule(NAME, "split-tail", "the last round's tiles are cut into chunks only where the CTAs take their work "
         "from the counter", "SPLIT_TAIL PERSISTENT", lambda c: not c["SPLIT_TAIL"] or c["PERSISTENT"] == 2),
    rule(NAME, "q-in-regs", "Q in registers needs its tile's mbarrier, and gave wrong scores on an H100 without "
         "intra-warpgroup overlap", "Q_IN_REGS INTRA_WG_OVERLAP PRODUCER LOAD",
         lambda c: not c["Q_IN_REGS"] or (c["INTRA_WG_OVERLAP"] >= 1 and barriers(c))),
    rule(NAME, "softmax-pin", "the softmax is held before the wait for P V where P V is issued with Q K^T and "
         "waited for on its own (with overlap 2 the row max comes first anyway)",
         "SOFTMAX_PIN INTRA_WG_OVERLAP PRODUCER LOAD",
         lambda c: not c["SOFTMAX_PIN"] or (c["INTRA_WG_OVERLAP"] == 1 and barriers(c))),
    rule(NAME, "overlap-stages", "overlap without a producer needs a third stage to load into",
         "PRODUCER INTRA_WG_OVERLAP STAGES",
         lambda c: c["PRODUCER"] == 1 or not c["INTRA_WG_OVERLAP"] or c["STAGES"] >= 3),
    rule(NAME, "setmaxnreg", "setmaxnreg.inc only gets registers the producer gave back; asking for more deadlocks",
         "REG_PRODUCER REG_CONSUMER PRODUCER CONSUMER_WGS", _setmaxnreg_ok),
    rule(NAME, "producer-registers", "with 24 registers a cp.async producer spills at BLOCK_N 64 (a TMA producer "
         "is one thread issuing copies)", "REG_PRODUCER BLOCK_N LOAD",
         lambda c: c["REG_PRODUCER"] == 0 or c["REG_PRODUCER"] >= 32 or c["BLOCK_N"] >= 128 or c["LOAD"] == "tma"),
    rule(NAME, "consumer-registers", "the S, P and O accumulators (and Q's fragments) of a consumer thread fit its "
         "register cap", "REG_CONSUMER CONSUMER_WGS PRODUCER BLOCK_N INTRA_WG_OVERLAP PERSISTENT Q_IN_REGS",
         lambda c: consumer_register_cap(c) >= consumer_registers(c, c["MAX_HEAD_DIM"])),
    rule(NAME, "smem", "the Q tile (and with O_TMA the O tile), STAGES K and V tiles (128-byte swizzled) and "
         "barriers fit the shared memory per block", "BLOCK_M BLOCK_N STAGES O_TMA PRODUCER LOAD",
         lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)


def label(values: dict[str, Any]) -> None:
    """Fold the wgmma parameters into short-label tokens, in place: the consumer warpgroups follow
    from BLOCK_M; ``r24/240`` is the setmaxnreg pair (it implies the producer); ``ovl`` and its
    kin the overlap; LOAD=tma names the path ``tma``, persistent CTAs ``ptma`` (``dtma`` from the
    counter; ``stma``/``htma`` cutting the last round), ``...o`` with O stored by TMA."""
    for name, unused in (("WARPS", 1), ("VEC", 1)):  # configurations recorded when every path carried them
        if values.get(name) == unused:
            values.pop(name)
    if values.get("CONSUMER_WGS") is not None and values.get("BLOCK_M") == 64 * values["CONSUMER_WGS"]:
        values.pop("CONSUMER_WGS")
    if values.get("REG_PRODUCER") and values.get("REG_CONSUMER") and values.get("PRODUCER") == 1:
        values["SETMAXNREG"] = f"{values.pop('REG_PRODUCER')}/{values.pop('REG_CONSUMER')}"
        values.pop("PRODUCER")  # register reallocation implies the producer warpgroup
    if values.get("INTRA_WG_OVERLAP") in (1, 2):
        values["INTRA_WG_OVERLAP"] = overlap_token(values)
    if values.get("LOAD") == "tma":
        values.pop("LOAD")
        values["PATH"] = "tma"  # the wgmma path loading by TMA
        if values.get("PERSISTENT") in (1, 2):
            # ... from persistent CTAs (``dtma``: taking their work tiles from a counter)
            values["PATH"] = "ptma" if values.pop("PERSISTENT") == 1 else "dtma"
            if values["PATH"] == "dtma" and values.get("SPLIT_TAIL") in (1, 2):
                # ... which cut a short last round over every CTA (stream-K; ``htma``: up to half full)
                values["PATH"] = "stma" if values.pop("SPLIT_TAIL") == 1 else "htma"
            if values.get("O_TMA") == 1:
                values.pop("O_TMA")
                values["PATH"] += "o"  # ... which store O by TMA as well


def overlap_token(values: dict[str, Any]) -> str:
    """The token for INTRA_WG_OVERLAP 1 or 2 (``ovl``, ``ov2``), with the parameters that need the
    overlap folded in and popped from ``values``: Q_IN_REGS=1 (``ovq``, ``oq2``) and, with overlap 1,
    SOFTMAX_PIN's digit (``ovl3``, ``ovq2``)."""
    overlap = values["INTRA_WG_OVERLAP"]
    q_in_regs = values.get("Q_IN_REGS") == 1
    if q_in_regs:
        values.pop("Q_IN_REGS")
    token = ("ovq" if q_in_regs else "ovl") if overlap == 1 else ("oq2" if q_in_regs else "ov2")
    if overlap == 1 and values.get("SOFTMAX_PIN") in (1, 2, 3):
        token += str(values.pop("SOFTMAX_PIN"))
    return token


PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=threads, rows_per_cta=lambda c: 64 * c["CONSUMER_WGS"],
                  defaults=DEFAULTS, label=label, head_dims=HEAD_DIMS,
                  features=FEATURES, template_values=template_values)
