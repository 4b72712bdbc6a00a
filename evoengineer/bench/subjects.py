"""What a benchmark times besides a search's candidates: one configuration's kernel compiled for
the GPU present, SDPA with one backend forced, flash-attn-4; each a call returning (B, H, S, D)."""
from __future__ import annotations

from typing import Any, Callable

from ..gpu.evaluate import sdpa_op
from ..space import Config, Variant, load_space

MAX_ERROR = 2e-2
"""Largest |error| against fp32 SDPA of a kernel worth timing (fp16 outputs of about unit size)."""


def reference_op(name: str, q: Any, k: Any, v: Any, causal: bool, scale: float | None = None) -> Callable[[], Any]:
    """``gpu.evaluate.sdpa_op`` (an SDPA backend, SDPA's own choice ``default``, or ``fa4``),
    whose call returns the output as (B, H, S, D) (fa4's, computed on (B, S, H, D) copies, is
    transposed back: a view, no extra kernel)."""
    op = sdpa_op(name, q, k, v, causal, scale)
    if name != "fa4":
        return op

    def call() -> Any:
        out = op()
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return call


def seed_config(overrides: str | None = None, space: str = "h100") -> Config:
    """The space's wgmma TMA seed with ``overrides`` (NAME=VALUE,...)."""
    loaded = load_space(space)
    seed = next(c for c in loaded.search.seeds if c.get("PATH") == "wgmma" and c.get("LOAD") == "tma")
    return Config({**dict(seed), **dict(Config.parse(overrides))}) if overrides else seed


def compiled_kernel(config: Config, head_dim: int, causal: bool, space: str = "h100") -> Any:
    """``config``'s kernel for one variant, compiled for the GPU present (an ``AttentionKernel``);
    SystemExit with one line where it does not compile."""
    import torch

    from ..gpu import AttentionKernel
    from ..kernels import arch_for_device, compile_many, render

    rendered = render("flash_attention", config, Variant(head_dim, causal))
    arch = arch_for_device("sm_%d%d" % torch.cuda.get_device_capability(), load_space(space).target.arch)
    (build,) = compile_many([rendered.source], arch)
    if not build.ok:
        raise SystemExit(f"compile failed: {build.error.splitlines()[0] if build.error else config.label()}")
    return AttentionKernel(rendered, build.cubin_path)
