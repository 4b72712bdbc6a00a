"""One export's runtime: its kernel.json read, the dispatch table, the kernels, the launcher,
the custom op and the functions a user calls, tied together."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checks import DTYPE_NAMES, Coverage
from .dispatch import DispatchTable
from .hf import make_hf_attention, register_hf
from .kernel_file import ExportData, read_kernel_file
from .launch import Launcher
from .loading import KernelCache
from .op import make_attention, make_feature_attention, register_features_op, register_op

KERNEL_FILE = "kernel.json"


class ExportedAttention:
    """The callables and tables of one export (``data``: its kernel.json, read and checked)."""

    def __init__(self, data: ExportData) -> None:
        self.data = data
        self.table = DispatchTable(data.dispatch)
        variant_gqa = data.variant_gqa()
        self.coverage = Coverage(data.dtypes, variant_gqa)
        self.gqa = all(variant_gqa.values())
        self.kernels = KernelCache(data)
        self.launcher = Launcher(data, self.table, self.coverage, self.kernels)
        self.op = register_op(data.op_namespace, self.launcher.forward, self.coverage)
        self.attention = make_attention(self.launcher.forward, self.op)
        self.features_op = register_features_op(data.op_namespace, self.launcher.forward_features, self.coverage)
        self.attention = make_feature_attention(self.attention, self.launcher.forward_features, self.features_op)
        self.hf_attention = make_hf_attention(self.attention, self.gqa)
        self.explain = self.launcher.explain

    @classmethod
    def load(cls, path: Path) -> "ExportedAttention":
        """The export whose kernel.json is ``path``; KernelFileError in one line when it cannot serve."""
        return cls(read_kernel_file(path))

    def dispatch(self, dtype: Any, head_dim: int, causal: bool, batch: int, heads: int, seq_q: int, seq_k: int,
                 heads_kv: int | None = None) -> str:
        """The configuration id (a key of ``configs``) that serves such a call (``dispatch.RULE``).
        ``dtype``: 'fp16', 'bf16' or a torch dtype."""
        name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))
        return self.table.choose(name, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv)

    def compile_all(self, device: Any = None) -> int:
        """Compile and load every kernel on ``device`` (default: the current one), e.g. before
        capturing a CUDA graph. Returns the number of kernels."""
        if device is None:
            index = torch.cuda.current_device()
        else:
            index = device if isinstance(device, int) else (torch.device(device).index or 0)
        return self.kernels.compile_all(index)

    def register_hf(self, name: str = "evo", fallback: str | None = None) -> str:
        """Register ``hf_attention`` with transformers under ``name``; returns ``name``. With
        ``fallback="sdpa"`` a call no kernel serves (a mask the kernels cannot express, a head dim
        not exported, ...) runs SDPA, counted in ``fallback_counts()``; by default it raises."""
        from .features import check_fallback

        hf = self.hf_attention if check_fallback(fallback) is None else make_hf_attention(self.attention, self.gqa, fallback,
                                                                                   self.launcher.fallbacks)
        return register_hf(hf, name)

    def fallback_counts(self, reset: bool = False) -> dict[str, int]:
        """Calls that ran the SDPA fallback so far, per reason (``reset``: start counting anew)."""
        return self.launcher.fallbacks.snapshot(reset)

    # -- the tables as plain values ------------------------------------------------------------

    def configs(self) -> dict[str, dict[str, Any]]:
        """config id -> label, short form, parameters."""
        return {cid: info.as_dict() for cid, info in self.data.configs.items()}

    def kernel_table(self) -> dict[tuple[str, int, bool, str], dict[str, Any]]:
        """(dtype, head_dim, causal, config id) -> launches, workspace, arguments, features, tensor maps, source."""
        return {key: spec.as_dict() for key, spec in self.data.kernels.items()}

    def dispatch_table(self) -> dict[tuple[str, int, bool], tuple[str, tuple[tuple[int, int, int, int, str], ...]]]:
        """(dtype, head_dim, causal) -> (fallback, ((B*H, S_q, S_k, H/H_kv, config id), ...))."""
        return {variant: (t.fallback, tuple((c.batch * c.heads, c.seq_q, c.seq_k, max(1, c.heads // c.heads_kv), c.config)
                                            for c in t.cases))
                for variant, t in self.data.dispatch.items()}
