"""One export's runtime: its kernel.json read, the dispatch table, the kernels, the launchers
(inference, LSE forward and backward, calls with features, packed variable-length sequences), the custom ops and the functions a user calls, tied together."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checks import DTYPE_NAMES, Coverage
from .dispatch import DispatchTable
from .hf import make_hf_attention, register_hf
from .kernel_file import ExportData, read_kernel_file
from .backward_launch import BackwardLauncher
from .launch import Launcher
from .loading import KernelCache
from .op import (Settings, grad_checker, make_attention, make_feature_attention, make_training, register_features_op,
                 register_ops)
from .varlen import VarlenLauncher, make_varlen_attention, register_varlen_op

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
        self.backward = BackwardLauncher(data, self.launcher, self.coverage, self.kernels)
        self.ops = register_ops(data.op_namespace, self.launcher.forward, self.backward.forward_lse,
                                self.backward.run_backward, self.coverage, grad_checker(data.backward))
        self.op = self.ops.attention
        self.settings = Settings()
        self.features_op = register_features_op(data.op_namespace, self.launcher.forward_features, self.coverage)
        train = make_training(self.ops, self.settings)
        self.attention = make_feature_attention(make_attention(self.launcher.forward, self.ops, train),
                                                self.launcher.forward_features, self.features_op,
                                                self.launcher.features_with_grad, train)
        self.varlen = VarlenLauncher(self.launcher, self.attention)
        self.varlen_op = register_varlen_op(data.op_namespace, self.varlen.forward, self.coverage)
        self.attention_varlen = make_varlen_attention(self.varlen.forward, self.varlen_op, self.varlen.with_grad)
        self.hf_attention = make_hf_attention(self.attention, self.gqa)
        self.explain = self.launcher.explain
        self.explain_backward = self.backward.explain

    @classmethod
    def load(cls, path: Path) -> "ExportedAttention":
        """The export whose kernel.json is ``path``; KernelFileError in one line when it cannot serve."""
        return cls(read_kernel_file(path))

    def dispatch(self, dtype: Any, head_dim: int, causal: bool, batch: int, heads: int, seq_q: int, seq_k: int,
                 heads_kv: int | None = None, varlen: bool = False, padded: bool = False) -> str:
        """The configuration id (a key of ``configs``) that serves such a call (``dispatch.RULE``).
        ``dtype``: 'fp16', 'bf16' or a torch dtype; ``varlen``: an ``attention_varlen`` call of
        ``batch`` sequences, ``seq_q`` and ``seq_k`` the longest; ``padded``: a call with
        ``seqlens_q`` (a padded batch)."""
        name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))
        return self.table.choose(name, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv, varlen, padded)

    def dispatch_backward(self, dtype: Any, head_dim: int, causal: bool, batch: int, heads: int, seq_q: int,
                          seq_k: int, heads_kv: int | None = None, deterministic: bool = False) -> str:
        """The backward configuration id (a key of ``backward_configs``) that serves such a call;
        NotImplementedError where the export has no backward for it."""
        name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))
        return self.backward.choose(name, head_dim, causal, batch, heads, seq_q, seq_k, heads_kv, deterministic)

    def set_deterministic(self, flag: bool = True) -> None:
        """Make every backward of this module deterministic (dQ without atomics: bit-identical
        gradients run to run), unless a call passes ``deterministic=``."""
        self.settings.deterministic = bool(flag)

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

    def backward_configs(self) -> dict[str, dict[str, Any]]:
        """Backward and LSE-forward config id -> label, short form, parameters (empty: no backward)."""
        return {cid: info.as_dict() for cid, info in self.data.backward.configs.items()} if self.data.backward else {}

    def backward_table(self) -> dict[tuple[str, int, bool], dict[str, Any]]:
        """(dtype, head_dim, causal) -> the LSE forward, the backward fallback and measured cases,
        the deterministic backward."""
        if self.data.backward is None:
            return {}
        return {variant: {"forward": b.forward, "fallback": b.table.fallback, "deterministic": b.deterministic,
                          "cases": tuple((c.batch * c.heads, c.seq_q, c.seq_k, max(1, c.heads // c.heads_kv), c.config)
                                         for c in b.table.cases)}
                for variant, b in self.data.backward.variants.items()}

    def kernel_table(self) -> dict[tuple[str, int, bool, str], dict[str, Any]]:
        """(dtype, head_dim, causal, config id) -> launches, workspace, arguments, features, tensor maps, source."""
        return {key: spec.as_dict() for key, spec in self.data.kernels.items()}

    def dispatch_table(self) -> dict[tuple[str, int, bool], tuple[str, tuple[tuple[int, int, int, int, str], ...]]]:
        """(dtype, head_dim, causal) -> (fallback, ((B*H, S_q, S_k, H/H_kv, config id), ...))."""
        return {variant: (t.fallback, tuple((c.batch * c.heads, c.seq_q, c.seq_k, max(1, c.heads // c.heads_kv), c.config)
                                            for c in t.cases))
                for variant, t in self.data.dispatch.items()}
