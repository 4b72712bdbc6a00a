"""The templates compile to the same machine code as those of a base revision.

For every listed seed of every built-in space (the scalar, wmma and mma ones at each of the
space's dtypes and head dims, full and causal; the h100 space's wgmma ones at D64 causal and
D128 full), the kernel is rendered from the base revision's templates (``git archive``) and from
the working tree's, both are compiled by NVRTC for sm_90a and their SASS (``nvdisasm``) is
compared (``evoengineer.kernels.sass``; ``benchmarks/sass_sample.py`` does the same over a
stratified sample of a space). The scalar, wmma and mma kernels must be identical. The wgmma template was split by
role since the base revision, and ptxas orders its kernels' instructions and names their
registers differently: there the test asks for the same launches and a compile on both sides
and reports the SASS differences (tests/test_tma.py checks spills and asynchronous wgmma; their
speed is measured by ``evoengineer ab --before``: docs/performance.md). ``EVOENGINEER_SASS_SAMPLE=N`` adds a fixed
sample of N wgmma configurations of the h100 space.

Slow (about a hundred compiles; the compile cache makes a rerun cheap): ``pytest -m slow``.
Set ``EVOENGINEER_SASS_BASE`` to compare against another revision, ``EVOENGINEER_SASS_REPORT``
to a path to get the comparison as JSON.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from evoengineer.kernels import sass
from evoengineer.resources import builtin_spaces
from evoengineer.space import Config, Variant, load_space

REPO = Path(__file__).resolve().parent.parent
BASE_REVISION = os.environ.get("EVOENGINEER_SASS_BASE", "fb5a84c")
"""The revision before the wgmma template was split along its roles."""
ARCH = "sm_90a"
SAMPLE_SIZE, SAMPLE_SEED = int(os.environ.get("EVOENGINEER_SASS_SAMPLE", "0")), 32
REMOVED = {"CROSS_TILE": 0, "LAZY_RESCALE": 0, "EXP2_FMA": 0, "P_SMEM": 0, "Q_STAGES": 1}
"""Template parameters the base revision took and the working tree no longer does (their
defaults: what the working tree does), besides PINGPONG 2."""

BASE_HEAD_DIMS = (64, 128)
"""The head dims the base revision's spaces held (others compare nothing it was made for)."""

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    """One kernel to compare: where it comes from, its configuration and variant."""

    origin: str
    config: Config
    variant: Variant

    @property
    def label(self) -> str:
        return f"{self.origin}: {self.config.short_label()} {self.variant.label()} [{self.config.label()}]"


def _uses_removed(config: Config) -> bool:
    return any(config.get(name, default) != default for name, default in REMOVED.items()) or config.get("PINGPONG") == 2


def cases() -> list[Case]:
    """Every listed seed of every built-in space at each dtype x head dim x {full, causal}, then a
    fixed sample of the h100 space's wgmma configurations, each at a variant drawn with it."""
    out: list[Case] = []
    for name, path in builtin_spaces().items():
        space = load_space(path)
        dtypes = sorted({v.dtype for v in space.variants})
        dims = sorted({v.head_dim for v in space.variants} & set(BASE_HEAD_DIMS))
        for seed in space.search.listed_seeds:
            if seed.get("SPLITS") == 0:   # the split count chosen per call: none in the base revision
                continue
            if seed["PATH"] != "wgmma":
                out += [Case(f"{name} seed", seed, Variant(d, causal, dtype))
                        for dtype in dtypes for d in dims for causal in (False, True)]
            elif name == "h100":
                out += [Case(f"{name} seed", seed, Variant(d, causal, "fp16")) for d, causal in ((64, True), (128, False))
                        if d in dims]
    h100 = load_space("h100")
    wgmma = [c for c in h100.valid_configs() if c["PATH"] == "wgmma" and not _uses_removed(c)]
    rng = random.Random(SAMPLE_SEED)
    variants = [Variant(v.head_dim, causal, v.dtype) for v in h100.variants for causal in (False, True)]
    variants = list(dict.fromkeys(variants))
    for config in rng.sample(wgmma, min(SAMPLE_SIZE, len(wgmma))):
        out.append(Case("h100 sample", config, rng.choice(variants)))
    return out


def compare(all_cases: list[Case], base: Path, tool: str) -> dict[str, list]:
    """Each case as identical (same source or same SASS), refused alike, or different (with why):
    ``evoengineer.kernels.sass.compare``, a broken comparison counted as different."""
    workers = int(os.environ.get("EVOENGINEER_SASS_WORKERS", "2"))
    compared = sass.compare([(c.config, c.variant) for c in all_cases], base, None, ARCH, tool, workers=workers)
    result: dict[str, list] = {"identical": [], "refused": [], "different": []}
    for case, done in zip(all_cases, compared, strict=True):
        if done.verdict in ("identical", "refused"):
            result[done.verdict].append(case.label)
        else:
            result["different"].append((case.label, done.why))
    return result


def test_every_seed_and_a_sample_of_wgmma_configurations_compile_to_the_base_revisions_sass(tmp_path: Path) -> None:
    tool = sass.nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    base = sass.revision_templates(BASE_REVISION, tmp_path / "base", REPO)
    if base is None:
        pytest.skip(f"git history without revision {BASE_REVISION}")
    all_cases = cases()
    result = compare(all_cases, base, tool)
    report = os.environ.get("EVOENGINEER_SASS_REPORT")
    if report:
        Path(report).write_text(json.dumps({"base": BASE_REVISION, "compared": len(all_cases),
                                            **{k: len(v) for k, v in result.items()}, "details": result}, indent=1))
    assert len(result["identical"]) + len(result["refused"]) + len(result["different"]) == len(all_cases)
    wgmma = {c.label for c in all_cases if c.config["PATH"] == "wgmma"}
    broken = [(label, why) for label, why in result["different"]
              if label not in wgmma or why.startswith(("render", "launch", "compile"))]
    assert not broken, "\n".join(f"{label}: {why}" for label, why in broken)
