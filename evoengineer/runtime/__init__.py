"""The runtime of an exported attention module: torch, cupy and the standard library only.

``evoengineer export`` copies this package verbatim into the export directory (as
``<out>/evo_attention/``) beside ``kernel.json`` (configurations, dispatch table, launch metadata,
op namespace, provenance) and the kernels' CUDA sources. Imported there, the package reads that
kernel.json as plain JSON and serves it:

    import sys; sys.path.insert(0, "best")
    from evo_attention import attention
    out = attention(q, k, v, is_causal=True)    # (batch, heads, seq, head_dim) CUDA tensors

    import evo_attention; evo_attention.register_hf()   # transformers: attn_implementation="evo"

attention(q, k, v, is_causal=False, scale=None, enable_gqa=False) follows
torch.nn.functional.scaled_dot_product_attention: is_causal masks top-left aligned (query i
sees keys 0..i, also when seq_q != seq_k), scale defaults to 1/sqrt(head_dim) and must be
positive, enable_gqa lets k and v have fewer heads than q (kernels that take a K/V head count
only, see GQA). No attn_mask, no dropout.

Training: where q, k or v requires grad (and grad mode is on), the call runs the export's LSE
forward (the output and each row's log-sum-exp) and ``loss.backward()`` runs its backward kernels
(a preprocess, dK/dV over key tiles, dQ by atomics or by a separate pass), chosen per shape by the
same rule (BACKWARD: per (dtype, head_dim, causal)). Calls that need no gradient write no LSE.
attention(..., deterministic=True), or set_deterministic(True) for the module, or
torch.use_deterministic_algorithms(True), runs a backward whose gradients are bit-identical run
to run. A double backward, and a gradient of a variant no exported backward covers, are refused
in one line.

Features, keywords as flash-attn's: window_size=(left, right), softcap=, and per-batch key
ranges seqlens_k=, leftpad_k= and query lengths seqlens_q= (int32 (batch,) tensors: padding),
served by kernels exported with those features (kernel.json lists each kernel's);
fallback='sdpa' runs SDPA for a call no kernel covers, counted per reason by fallback_counts()
and explain() (features.py). A window, a soft cap or per-batch key ranges and query lengths (a
padded batch) with inputs that require grad run an LSE forward and backward kernels built with
them.

Packed variable-length sequences, as flash-attn's varlen: attention_varlen(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False, scale=None, window_size=(-1, -1),
softcap=0.0, fallback=None) with q (total_q, heads, head_dim), k and v (total_k, heads_kv,
head_dim), int32 (batch + 1,) offsets; causal and windows align bottom-right there, as
flash-attn's (varlen.py). Served by the kernels with the varlen feature; a call that needs a gradient
trains through the padded batch's kernels (varlen.train_packed).

Each kernel is compiled at first use by NVRTC (cupy.RawModule) for the GPU present and launched
with cupy.cuda.driver.launchKernel on torch's current stream, reading and writing the tensors in
place through their strides; kernels that load by TMA also take tensor maps (cuTensorMapEncodeTiled
through ctypes). Each call runs one configuration, chosen by the nearest measured case
(DISPATCH_RULE); a configuration with SPLITS 0 splits the K/V range over as many CTAs as the
call's shape needs to fill the GPU (grid.decode_splits; explain() tells the count). Per shape, strides, dtype and device the plan is prepared once (per thread);
a repeated call only reads the pointers, allocates the output and launches.

It is also the torch custom op torch.ops.<OP_NAMESPACE>.attention (with attention_lse and
attention_backward for training, the autograd formula registered with
torch.library.register_autograd) with fake implementations, so torch.compile(fullgraph=True)
traces forward and backward and CUDA graphs capture a whole training step (warm up each shape,
or call compile_all(), before capturing). dispatch(...) answers which configuration serves a shape,
explain(q, k, v, ...) what a call runs; hf_attention / register_hf plug it into transformers.

As ``evoengineer.runtime`` (the library), it is the search's tensor-map encoder and dispatch rule,
and ``exported.ExportedAttention`` loads any export's kernel.json.
"""
from __future__ import annotations

from pathlib import Path

from .dispatch import RULE as DISPATCH_RULE
from .dispatch import DispatchTable, MeasuredCase, NoKernelError, VariantTable, nearest_index, point
from .kernel_file import SCHEMA, ExportData, KernelFileError, is_identifier, read_kernel_file
from .tensormap import TensorMapError

if __name__ == "evoengineer.runtime":
    __all__ = [
        "DISPATCH_RULE", "SCHEMA", "DispatchTable", "ExportData", "KernelFileError", "MeasuredCase", "NoKernelError",
        "TensorMapError", "VariantTable", "is_identifier", "nearest_index", "point", "read_kernel_file",
    ]
else:  # a copy in an export directory: serve the kernel.json beside this package
    from .exported import KERNEL_FILE, ExportedAttention
    from .launch import LOG2E

    try:
        _export = ExportedAttention.load(Path(__file__).resolve().parent.parent / KERNEL_FILE)
    except KernelFileError as exc:  # an export that cannot serve is a module that cannot be imported
        raise ImportError(str(exc)) from None
    attention = _export.attention
    attention_op = _export.op
    """torch.ops.<OP_NAMESPACE>.attention.default: the same computation through the dispatcher."""
    dispatch = _export.dispatch
    explain = _export.explain
    compile_all = _export.compile_all
    dispatch_backward = _export.dispatch_backward
    explain_backward = _export.explain_backward
    set_deterministic = _export.set_deterministic
    attention_lse_op = _export.ops.attention_lse
    attention_backward_op = _export.ops.attention_backward
    BACKWARD = _export.backward_table()
    BACKWARD_CONFIGS = _export.backward_configs()
    hf_attention = _export.hf_attention
    register_hf = _export.register_hf
    fallback_counts = _export.fallback_counts
    attention_features_op = _export.features_op
    """torch.ops.<OP_NAMESPACE>.attention_features.default: a call with a window, soft cap,
    per-batch key ranges or a fallback through the dispatcher."""
    attention_varlen = _export.attention_varlen
    attention_varlen_op = _export.varlen_op
    """torch.ops.<OP_NAMESPACE>.attention_varlen.default: a varlen call through the dispatcher."""
    OP_NAMESPACE = _export.data.op_namespace
    ARCH = _export.data.arch
    """The GPU architecture searched on; kernels compile for the GPU present."""
    FALLBACK = _export.data.fallback
    CONFIGS = _export.configs()
    KERNELS = _export.kernel_table()
    DISPATCH = _export.dispatch_table()
    DTYPES = _export.data.dtypes
    HEAD_DIMS = _export.data.head_dims
    GQA = _export.gqa
    """Whether every kernel takes a K/V head count (grouped-query attention without copies)."""
    __all__ = ["attention", "attention_op", "attention_lse_op", "attention_backward_op", "attention_features_op",
               "attention_varlen", "attention_varlen_op",
               "dispatch", "dispatch_backward", "explain", "explain_backward", "compile_all", "fallback_counts",
               "hf_attention", "register_hf", "set_deterministic", "BACKWARD", "BACKWARD_CONFIGS", "CONFIGS",
               "DISPATCH", "DISPATCH_RULE", "GQA", "KERNELS", "OP_NAMESPACE", "LOG2E"]
