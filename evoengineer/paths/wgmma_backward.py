"""The backward's wgmma path (``templates/_attn_bwd_wgmma.cuh.j2``, Hopper sm_90a): the dK/dV kernel on
warpgroup MMA, with the mma path's preprocess and dQ conversion kernels around it.

One CTA per (BLOCK_N keys, batch, K/V head) holds K and V in shared memory (128-byte swizzle) and
walks the query tiles (BLOCK_M rows) of every query head of its group (grouped-query attention: dK
and dV summed over the group). Each consumer warpgroup owns 64 of the keys, so the keys are the M
dimension of its GEMMs (FlashAttention-3's backward): S^T = K Q^T and dP^T = V dO^T read both operands
from shared memory (K-major); P^T and dS^T are computed in the accumulators' registers and are the A
operand, from registers, of dV += P^T dO and dK += dS^T Q (dO and Q MN-major from shared memory).
dQ += dS K needs dS, not dS^T, as its A operand: each warpgroup writes its dS^T to shared memory
(rows: keys) and dQ reads it back through a transposed (MN-major) A descriptor, with K as an
MN-major B; the fp32 partials go into the mma path's dQ workspace by vector reductions (or, DQ_MODE bulk, by a
producer warp's bulk reductions of a shared-memory tile). At BLOCK_M 64 (beside a second warpgroup at D128) the
GEMMs run in FlashAttention-3's order: S^T and dP^T in two wgmma groups, P^T computed while dP^T's runs and dS^T
while dV's does, then dQ's GEMMs and dK's, dQ's sums leaving while dK's runs; elsewhere (ptxas serialized or
spilled that order) S^T and dP^T, then dV and dK, then dQ.

Parameters:

- ``BLOCK_N``: keys per CTA, 64 per consumer warpgroup (``CONSUMER_WGS`` 1 or 2),
- ``BLOCK_M``: query rows per tile (64 or 128; the S^T and dP^T accumulators, BLOCK_M floats a
  thread, live beside dK's and dV's, head_dim floats: BLOCK_M + head_dim <= 192, <= 128 where one
  warpgroup prefetches the next tile alone),
- ``STAGES``: 1 or 2 (the next Q/dO tile loads by cp.async while dV and dK of this one run),
- ``DQ_MODE``: ``atomic`` (each consumer thread's fp32 vector reductions into the workspace) or ``bulk`` (needs
  LOAD tma: the consumers write dQ's tile to shared memory, a producer warp adds it into the workspace by bulk
  reductions, and dS^T has two buffers); the conversion kernel follows either,
- ``PRODUCER``: 0, every consumer thread loads the next tile by cp.async, or 1, a producer
  warpgroup does, into a ring of STAGES stages with full and empty mbarriers, the consumers only
  wait (beside two consumer warpgroups, setmaxnreg moves registers to them: ``registers``),
- ``LOAD``: ``cpasync`` (the producer's 128 threads copy) or ``tma`` (needs PRODUCER 1): one producer thread
  loads K and V once and each stage's Q and dO by cp.async.bulk.tensor (4-D tensor maps), one expect_tx a
  stage, while the producer's threads copy LSE and D by cp.async (4 bytes a row: a head's rows start
  anywhere); 16 bytes more shared memory (K's and V's mbarrier). The kernel then takes four tensor maps
  after the backward's arguments (``TENSOR_MAPS``).

Features (``FEATURES``): per-batch key ranges and query lengths (padded batches), a sliding window and
soft-capping, as the mma path's. Not yet: a deterministic dQ pass.
"""
from __future__ import annotations

from typing import Any

from .base import KernelPath, Scope, features_rule, head_dims_rule, rule

NAME = "wgmma"
TEMPLATE = "flash_attention_bwd"
PARAMS = ("BLOCK_M", "BLOCK_N", "CONSUMER_WGS", "STAGES", "DQ_MODE", "PRODUCER", "LOAD")
DEFAULTS: dict[str, Any] = {"CONSUMER_WGS": 1, "STAGES": 2, "DQ_MODE": "atomic", "PRODUCER": 0, "LOAD": "cpasync"}
LOADS = ("cpasync", "tma")
TENSOR_MAPS = ("q", "k", "v", "do")
"""The tensors the dK/dV kernel maps with LOAD tma, in the order of its tensor-map arguments."""
HEAD_DIMS = (64, 128)
DQ_MODES = ("atomic", "bulk")
ARCH = "sm_90a"
MAX_ACCUMULATORS = 192
"""Registers of a consumer thread's budget (``accumulators``) past which the kernel spills (255 a thread)."""
LONE_PREFETCH = 64
"""What one warpgroup that prefetches the next Q/dO tile alone (CONSUMER_WGS 1, STAGES 2) adds: twice the
loads' addresses a thread (ptxas spilled 24 to 136 bytes at D64 BLOCK_M 128 and D128 BLOCK_M 64)."""


REGISTERS = (24, 240)
"""setmaxnreg of the producer and of each consumer warpgroup beside two consumer warpgroups (384 threads start at
168 registers each; P + 2 C fits their 504; the template sets the same)."""
REGISTERS_BULK_128 = (32, 232)
"""The same with DQ_MODE bulk and BLOCK_M 128: the producer's dQ reductions and LSE/D copies spilled 8 to 24 bytes at
24 registers (NVRTC 13.5)."""


def registers(c: Scope) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg values, (0, 0) for none (one consumer warpgroup or no producer)."""
    if not int(c.get("PRODUCER", 0)) or int(c["CONSUMER_WGS"]) != 2:
        return 0, 0
    return REGISTERS_BULK_128 if c.get("DQ_MODE", "atomic") == "bulk" and int(c["BLOCK_M"]) == 128 else REGISTERS


def overlap_gemms(c: Scope, head_dim: int) -> bool:
    """FlashAttention-3's GEMM order in the dK/dV kernel (the template sets the same): at BLOCK_M 64, beside a
    second consumer warpgroup at D128. At 128 rows ptxas serialized the wgmma groups and spilled; one warpgroup of
    64 rows at D128 spilled 160 to 216 bytes (NVRTC 13.5)."""
    return int(c["BLOCK_M"]) == 64 and (int(c["CONSUMER_WGS"]) == 2 or head_dim == 64)


def threads(c: Scope) -> int:
    """128 per consumer warpgroup, and 128 for the producer."""
    return 128 * (int(c["CONSUMER_WGS"]) + int(c.get("PRODUCER", 0)))


def accumulators(c: Scope, head_dim: int) -> int:
    """A consumer thread's register budget: S^T and dP^T (BLOCK_M / 2 floats each) with dK and dV
    (head_dim / 2 each), and ``LONE_PREFETCH`` where one warpgroup prefetches alone."""
    lone = int(c["CONSUMER_WGS"]) == 1 and int(c["STAGES"]) == 2 and not int(c.get("PRODUCER", 0))
    return int(c["BLOCK_M"]) + head_dim + (LONE_PREFETCH if lone else 0)


def spill_free_at_the_limit(c: Scope) -> bool:
    """At MAX_ACCUMULATORS the combinations whose causal variants ptxas (NVRTC 13.5) compiles without
    spills: two consumer warpgroups whose second stage is loaded by a producer (or one stage and no
    producer), or one warpgroup of 64 rows, one stage and no producer."""
    wgs, stages, producer = int(c["CONSUMER_WGS"]), int(c["STAGES"]), int(c.get("PRODUCER", 0))
    if wgs == 2:
        return (stages == 2) == (producer == 1)
    return stages == 1 and not producer and int(c["BLOCK_M"]) == 64


def dq_tiles(c: Scope, head_dim: int) -> int:
    """dQ's fp32 tiles in shared memory (DQ_MODE bulk): one, or one a warpgroup where the warpgroups split the
    keys of dQ's one 64 x 64 block (BLOCK_M 64, head dim 64, two warpgroups); 0 for atomic."""
    if c.get("DQ_MODE", "atomic") != "bulk":
        return 0
    wgs = int(c["CONSUMER_WGS"])
    return 1 if (int(c["BLOCK_M"]) // 64) * (head_dim // 64) % wgs == 0 else wgs


def kernel_smem(c: Scope, head_dim: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel of the backward (bytes), as the template declares it:
    1 KB to align the swizzled tiles, K and V, STAGES x (Q, dO, LSE and D rows), dS^T (two with DQ_MODE
    bulk, and dQ's tiles), and with a producer two mbarriers a stage (with LOAD tma, 16 bytes more: K's and
    V's mbarrier)."""
    bm, bn, stages, d = int(c["BLOCK_M"]), int(c["BLOCK_N"]), int(c["STAGES"]), head_dim
    bulk = c.get("DQ_MODE", "atomic") == "bulk"
    dkdv = 1024 + 4 * bn * d + stages * (4 * bm * d + 8 * bm) + 2 * bm * bn * (2 if bulk else 1)
    dkdv += 4 * dq_tiles(c, d) * bm * d + 16 * stages * int(c.get("PRODUCER", 0))
    dkdv += 16 if c.get("LOAD", "cpasync") == "tma" else 0
    return {"attn_bwd_pre": 0, "attn_bwd_dkdv": dkdv, "attn_bwd_dq_convert": 0}


def smem_bytes(c: Scope, head_dim: int) -> int:
    """The largest of the backward's kernels' shared memory."""
    return max(kernel_smem(c, head_dim).values())


def template_values(c: Scope, head_dim: int) -> dict[str, Any]:
    """What the template reads of these rules besides shared memory, threads and rows: the setmaxnreg
    values and FlashAttention-3's GEMM order."""
    return {"REGISTERS": registers(c), "OVERLAP_GEMMS": overlap_gemms(c, head_dim)}


FEATURES: tuple[str, ...] = ("seqlens", "softcap", "window")
"""The compile-time features the path holds (SEQLENS, SOFTCAP, WINDOW), as the mma path's: masks and tile bounds
in the dK/dV kernel; the soft cap's derivative from P (no register keeps t between the softmax steps)."""

RULES = (
    head_dims_rule(NAME, HEAD_DIMS),
    features_rule(NAME, FEATURES),
    rule(NAME, "arch", "wgmma exists only on sm_90a", "", lambda c: c.get("ARCH_NAME", ARCH) == ARCH),
    rule(NAME, "keys", "BLOCK_N is 64 keys per consumer warpgroup, CONSUMER_WGS 1 or 2", "BLOCK_N CONSUMER_WGS",
         lambda c: c["CONSUMER_WGS"] in (1, 2) and c["BLOCK_N"] == 64 * c["CONSUMER_WGS"]),
    rule(NAME, "rows", "BLOCK_M is 64 or 128", "BLOCK_M", lambda c: c["BLOCK_M"] in (64, 128)),
    rule(NAME, "stages", "STAGES is 1 or 2", "STAGES", lambda c: c["STAGES"] in (1, 2)),
    rule(NAME, "producer", "PRODUCER is 0 or 1", "PRODUCER", lambda c: c.get("PRODUCER", 0) in (0, 1)),
    rule(NAME, "load", "LOAD is cpasync, or tma with a producer warpgroup (PRODUCER 1)", "LOAD PRODUCER",
         lambda c: c.get("LOAD", "cpasync") in LOADS and (c.get("LOAD", "cpasync") == "cpasync" or c.get("PRODUCER", 0) == 1)),
    rule(NAME, "dq-mode", f"DQ_MODE is one of {', '.join(DQ_MODES)}", "DQ_MODE", lambda c: c["DQ_MODE"] in DQ_MODES),
    rule(NAME, "dq-bulk", "DQ_MODE bulk needs LOAD tma (a producer warp reduces dQ's tile)", "DQ_MODE LOAD",
         lambda c: c["DQ_MODE"] != "bulk" or c.get("LOAD", "cpasync") == "tma"),
    rule(NAME, "registers", f"S^T, dP^T, dK and dV accumulators (BLOCK_M + head dim floats, {LONE_PREFETCH} more where "
         f"one warpgroup prefetches the next tile alone) within {MAX_ACCUMULATORS}", "BLOCK_M CONSUMER_WGS STAGES PRODUCER",
         lambda c: accumulators(c, c["MAX_HEAD_DIM"]) <= MAX_ACCUMULATORS),
    rule(NAME, "at-the-limit", f"at {MAX_ACCUMULATORS} accumulators, two warpgroups with a producer for 2 stages or none "
         "for 1, or one warpgroup of 64 rows, 1 stage, no producer (else ptxas spills in the causal variants)",
         "BLOCK_M CONSUMER_WGS STAGES PRODUCER",
         lambda c: accumulators(c, c["MAX_HEAD_DIM"]) != MAX_ACCUMULATORS or spill_free_at_the_limit(c)),
    rule(NAME, "smem", "every kernel's tiles fit the shared memory per block", "BLOCK_M BLOCK_N STAGES PRODUCER LOAD DQ_MODE",
         lambda c: smem_bytes(c, c["MAX_HEAD_DIM"]) <= c["SMEM_LIMIT"]),
)


def label(values: dict[str, Any]) -> None:
    """Fold the parameters into short-label tokens, in place: ``bwg`` (the consumer warpgroups follow
    from BLOCK_N) and ``dq=atomic``; a producer warpgroup reads ``pr``."""
    values["PATH"] = "bwg"
    if values.get("CONSUMER_WGS") is not None and values.get("BLOCK_N") == 64 * values["CONSUMER_WGS"]:
        values.pop("CONSUMER_WGS")
    values["dq"] = values.pop("DQ_MODE", "atomic")


PATH = KernelPath(NAME, PARAMS, RULES, smem_bytes, threads=threads, rows_per_cta=lambda c: c["BLOCK_N"],
                  defaults=DEFAULTS, label=label, head_dims=HEAD_DIMS, features=FEATURES,
                  template_values=template_values)
