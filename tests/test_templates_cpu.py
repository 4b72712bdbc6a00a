"""Render and compile the scalar and wmma attention paths with NVRTC (no GPU needed)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from evoengineer import paths
from evoengineer.kernels import CompileResult, Rendered, RenderError, compile_many, render
from evoengineer.space import Config, Variant

ARCHS = ("sm_90", "sm_89")
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class Case:
    path: str
    block_m: int
    block_n: int
    warps: int
    vec: int
    head_dim: int
    causal: bool

    @property
    def config(self) -> Config:
        return Config(PATH=self.path, BLOCK_M=self.block_m, BLOCK_N=self.block_n, WARPS=self.warps, VEC=self.vec)

    @property
    def variant(self) -> Variant:
        return Variant(head_dim=self.head_dim, causal=self.causal)

    def id(self) -> str:
        return f"{self.path}-m{self.block_m}n{self.block_n}w{self.warps}v{self.vec}-{self.variant.label()}"


# Each path: tile extremes, 1 and 8 warps, VEC 1..8, and every (D, causal) pair twice.
CASES = [
    Case("scalar", 16, 16, 1, 1, 64, False),
    Case("scalar", 16, 16, 1, 1, 128, True),
    Case("scalar", 128, 128, 8, 8, 64, True),
    Case("scalar", 128, 128, 8, 8, 128, False),
    Case("scalar", 64, 32, 4, 4, 64, False),
    Case("scalar", 64, 32, 4, 4, 128, True),
    Case("scalar", 128, 16, 1, 2, 64, True),
    Case("scalar", 32, 64, 2, 8, 128, False),
    Case("wmma", 16, 16, 1, 1, 64, True),
    Case("wmma", 16, 16, 1, 1, 128, False),
    Case("wmma", 128, 128, 8, 8, 64, False),
    Case("wmma", 128, 128, 8, 8, 128, True),
    Case("wmma", 64, 32, 4, 2, 64, True),
    Case("wmma", 64, 32, 4, 2, 128, False),
    Case("wmma", 32, 128, 2, 8, 64, False),
    Case("wmma", 128, 64, 8, 4, 128, True),
]


def expected_smem(case: Case) -> int:
    """Dynamic shared memory of each path: its rules' (evoengineer/paths)."""
    return paths.get(case.path).smem(case.config, case.head_dim)


@pytest.fixture(scope="module")
def rendered() -> dict[Case, Rendered]:
    return {case: render("flash_attention", case.config, case.variant) for case in CASES}


@pytest.fixture(scope="module")
def compiled(rendered: dict[Case, Rendered]) -> dict[tuple[Case, str], CompileResult]:
    jobs = [(case, arch) for arch in ARCHS for case in CASES]
    results: dict[tuple[Case, str], CompileResult] = {}
    workers = max(1, min(8, os.cpu_count() or 1))
    for arch in ARCHS:
        sources = [rendered[case].source for case in CASES]
        for case, res in zip(CASES, compile_many(sources, arch, workers=workers)):
            results[(case, arch)] = res
    assert len(results) == len(jobs)
    return results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_compiles(case: Case, arch: str, compiled: dict[tuple[Case, str], CompileResult]) -> None:
    res = compiled[(case, arch)]
    assert res.ok, f"{case.id()} {arch}: {res.error}\n{res.log[-2000:]}"
    assert "attn_fwd" in res.kernels
    assert res.static_smem == 0, "the kernels use dynamic shared memory only"


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_launch_metadata(case: Case, rendered: dict[Case, Rendered]) -> None:
    r = rendered[case]
    assert len(r.launches) == 1
    launch = r.launches[0]
    assert launch.kernel == "attn_fwd"
    assert launch.block == (32 * case.warps, 1, 1)
    assert launch.rows_per_cta == case.block_m
    assert launch.grid_z == 1
    assert 0 < launch.smem <= SMEM_LIMIT
    assert launch.smem == expected_smem(case)
    assert r.workspace_floats_per_row == 0
    assert launch.grid(2, 3, 77) == (-(-77 // case.block_m), 6, 1)
    assert "#include" not in r.source


def test_render_is_deterministic() -> None:
    for case in (CASES[0], CASES[8]):
        a = render("flash_attention", case.config, case.variant)
        b = render("flash_attention", case.config, case.variant)
        assert a.source == b.source
        assert a.source_hash == b.source_hash


def test_different_configs_render_differently(rendered: dict[Case, Rendered]) -> None:
    sources = [r.source for r in rendered.values()]
    assert len(set(sources)) == len(sources)
    base = CASES[4]
    variants = [
        base.config,
        base.config.replace(VEC=8),
        base.config.replace(WARPS=2),
        base.config.replace(BLOCK_N=64),
        base.config.replace(BLOCK_M=32),
        base.config.replace(PATH="wmma"),
    ]
    texts = {render("flash_attention", c, base.variant).source for c in variants}
    texts.add(render("flash_attention", base.config, Variant(base.head_dim, not base.causal)).source)
    assert len(texts) == len(variants) + 1


@pytest.mark.parametrize("path", ["scalar", "wmma"])
@pytest.mark.parametrize(
    "changes, head_dim",
    [
        ({"BLOCK_M": 48}, 64),
        ({"BLOCK_N": 24}, 64),
        ({"WARPS": 3}, 64),
        ({"WARPS": 16, "BLOCK_M": 16}, 64),
        ({"VEC": 3}, 64),
        ({}, 96),
    ],
)
def test_unsupported_config_raises(path: str, changes: dict[str, int], head_dim: int) -> None:
    config = Config(PATH=path, BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8).replace(**changes)
    with pytest.raises(RenderError, match="UNSUPPORTED"):
        render("flash_attention", config, Variant(head_dim=head_dim, causal=False))


def test_wmma_needs_whole_row_groups_per_warp() -> None:
    """A WMMA warp owns whole 16-row groups: 8 warps cannot share 64 rows; the scalar path can."""
    config = Config(PATH="wmma", BLOCK_M=64, BLOCK_N=64, WARPS=8, VEC=8)
    with pytest.raises(RenderError, match="UNSUPPORTED"):
        render("flash_attention", config, Variant(head_dim=64, causal=False))
    assert render("flash_attention", config.replace(PATH="scalar"), Variant(head_dim=64, causal=False)).launches


def test_render_from_another_template_directory(tmp_path) -> None:
    """``render(..., directory)`` reads that directory, not the installed templates (template A/B)."""
    import shutil

    from evoengineer.kernels import render
    from evoengineer.resources import templates_dir
    from evoengineer.space import Config, Variant

    for f in templates_dir().glob("*.j2"):
        shutil.copy(f, tmp_path / f.name)
    marker = "// a changed copy of the template"
    main = tmp_path / "flash_attention.cu.j2"
    main.write_text(marker + "\n" + main.read_text())
    config = Config(PATH="scalar", BLOCK_M=16, BLOCK_N=32, WARPS=4, VEC=8)
    assert marker in render("flash_attention", config, Variant(64, False), tmp_path).source
    assert marker not in render("flash_attention", config, Variant(64, False)).source
