"""L2 rotation: how many input sets a measurement rotates through so that the L2 holds none
of them when a call comes back to its set (``gpu.timing.input_sets_for_cold_l2``)."""
from __future__ import annotations

from ..gpu.timing import input_sets_for_cold_l2


def attention_set_bytes(batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int, head_dim: int,
                        element_bytes: int = 2) -> int:
    """Bytes of one attention input set: q and out (B, H, S_q, D), k and v (B, H_kv, S_k, D)."""
    return 2 * element_bytes * batch * head_dim * (heads * seq_q + heads_kv * seq_k)


def cold_set_count(set_bytes: int, at_least: int = 1, l2_bytes: int | None = None) -> int:
    """Input sets of ``set_bytes`` to rotate through: together at least twice the L2 (the GPU's
    own where ``l2_bytes`` is not given), and at least ``at_least``."""
    return max(at_least, input_sets_for_cold_l2(set_bytes, True, l2_bytes))
