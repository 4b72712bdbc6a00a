"""benchmarks/sass_sample.py and evoengineer.kernels.sass without a GPU: a stratified sample
of the l4 space compiles to the same SASS with the base revision's templates as with the
working tree's, and a comparison tells a template change that leaves the SASS alone from one
that does not."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.kernels import sass
from evoengineer.resources import templates_dir
from evoengineer.space import Variant, load_space

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "sass_sample.py"
BASE_REVISION = "fb5a84c"


def _script_module():
    spec = importlib.util.spec_from_file_location("sass_sample", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_revision(revision: str) -> bool:
    found = subprocess.run(["git", "cat-file", "-e", f"{revision}^{{commit}}"], cwd=REPO, capture_output=True)
    return found.returncode == 0


def test_the_sample_is_shared_out_in_proportion_to_each_paths_configurations() -> None:
    allocation = _script_module().allocation
    assert allocation({"scalar": 256, "wmma": 112, "mma": 2754, "wgmma": 6444}, 200) == \
        {"scalar": 5, "wmma": 2, "mma": 58, "wgmma": 135}
    assert allocation({"scalar": 252, "wmma": 104, "mma": 1250}, 3) == {"scalar": 1, "wmma": 0, "mma": 2}
    assert allocation({"a": 2, "b": 1}, 10) == {"a": 2, "b": 1}


def test_a_stratified_sample_cycles_the_variants_within_each_path() -> None:
    space = load_space("l4")
    pairs, counts, shares = _script_module().stratified_sample(space, 12, seed=0)
    assert len(pairs) == 12 == sum(shares.values()) and counts == {"scalar": 252, "wmma": 104, "mma": 1250}
    assert [str(c["PATH"]) for c, _ in pairs] == [p for p in counts for _ in range(shares[p])]
    assert all(space.contains(c) for c, _ in pairs)
    mma = [v for c, v in pairs if c["PATH"] == "mma"]
    assert mma == [space.variants[i % len(space.variants)] for i in range(len(mma))]
    assert pairs == _script_module().stratified_sample(space, 12, seed=0)[0] != _script_module().stratified_sample(space, 12, seed=1)[0]


@pytest.mark.skipif(not _has_revision(BASE_REVISION), reason=f"git history without revision {BASE_REVISION}")
def test_the_script_finds_a_small_l4_sample_identical_to_the_base_revision(tmp_path: Path) -> None:
    if sass.nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    done = subprocess.run([sys.executable, str(SCRIPT), "--space", "l4", "--before", BASE_REVISION, "--sample", "3",
                           "--seed", "0", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "sass_sample.json").read_text())
    assert report["sample"] == 3 and report["arch"] == "sm_89" and report["sampled_per_path"] == {"scalar": 1, "wmma": 0, "mma": 2}
    assert report["different"] == [] and [c["verdict"] for c in report["comparisons"]] == ["identical"] * 3
    assert [c["variant"] for c in report["comparisons"]] == ["D64", "D64", "D64-causal"]
    total = report["table"][-1]
    assert (total["path"], total["sampled"], total["identical"], total["different"], total["broken"]) == ("all", 3, 3, 0, 0)
    assert "scalar" in done.stdout and "identical" in done.stdout


def test_a_bad_revision_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--space", "l4", "--before", "no-such-revision", "--sample", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "no-such-revision" in done.stderr


def test_a_comment_leaves_the_sass_identical_and_a_code_change_does_not(tmp_path: Path) -> None:
    tool = sass.nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    anchor = "    extern __shared__ __align__(16) unsigned char smem[];\n"
    before = tmp_path / "before"
    shutil.copytree(templates_dir(), before)
    assert anchor in (before / "_attn_scalar.cuh.j2").read_text()

    def changed(name: str, line: str) -> Path:
        into = tmp_path / name
        shutil.copytree(templates_dir(), into)
        scalar = into / "_attn_scalar.cuh.j2"
        scalar.write_text(scalar.read_text().replace(anchor, anchor + line, 1))
        return into

    config = load_space("l4").config({"PATH": "scalar", "BLOCK_M": 32, "BLOCK_N": 32, "WARPS": 1, "VEC": 1})
    case = [(config, Variant(64, False, "fp16"))]
    same = sass.compare(case, before, before, "sm_89", tool, workers=1)
    comment = sass.compare(case, before, changed("comment", "    // nothing but a comment\n"), "sm_89", tool, workers=1)
    code = sass.compare(case, before, changed("code", "    if (S_k < 0) { return; }\n"), "sm_89", tool, workers=1)
    assert [c.verdict for c in same + comment + code] == ["identical", "identical", "different"]
    assert same[0].why == "same source" and comment[0].why == "same SASS"
    assert code[0].delta("instructions") > 0 and code[0].delta("smem") == 0 and code[0].before == comment[0].before
    assert "instructions" in code[0].why
