"""Static checks without a GPU: every path of every shipped space compiles for sm_89 and
sm_90; `check` reports spills; packaging ships templates and spaces."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from evoengineer.kernels import build_config
from evoengineer.kernels.compile import compile_source, parse_ptxas_log
from evoengineer.space import Config, load_space

REPO = Path(__file__).resolve().parent.parent


def _per_path_sample(space, per_path: int, seed: int = 0) -> list[Config]:
    rng = random.Random(seed)
    by_path: dict[str, list[Config]] = {}
    for config in space.valid_configs():
        by_path.setdefault(config["PATH"], []).append(config)
    arch_specific = {"wgmma"} if space.target.arch != "sm_90a" else set()  # sm_90a's own instructions
    assert set(by_path) == set(space.param("PATH").values) - arch_specific, "every path has valid configurations"
    picked = []
    for configs in by_path.values():
        picked += rng.sample(configs, min(per_path, len(configs)))
    return picked


@pytest.mark.parametrize("space_name", ["l4", "h100"])
@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_90a"])
def test_every_path_of_shipped_spaces_compiles(space_name: str, arch: str) -> None:
    space = load_space(space_name).for_arch(arch)  # as check --arch: sm_90a-only paths need sm_90a
    for config in _per_path_sample(space, 2, seed=hash((space_name, arch)) % 1000):
        report = build_config(space.template, config, space.variants, arch)
        assert report.status == "compiled", (config.label(), report.error)
        assert report.registers > 0 and report.smem > 0


def test_check_json_summary_and_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", "spaces/l4.yaml", "--limit", "4", "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["summary"]) >= {"valid", "compiled", "failed", "spilling", "wgmma_serialized"}
    assert data["summary"]["compiled"] == 4 and data["summary"]["failed"] == 0
    assert len(data["configs"]) == 4 and all(c["registers"] > 0 for c in data["configs"])
    # not a terminal: progress as plain lines (on stderr beside --json), no bar
    assert proc.stderr.splitlines()[0] == "compiling l4 for sm_89: 4 configurations", proc.stderr


def test_check_progress_lines_for_a_log() -> None:
    """Where stdout is a log, check prints a line at the start and then one per period: done,
    total, share, elapsed and the time left."""
    import io

    from rich.console import Console

    from evoengineer.cli.space_commands import ProgressLines

    out = io.StringIO()
    lines = ProgressLines(Console(file=out, width=80), "compiling h100 for sm_90a", 400, period_s=0.0)
    for done in (1, 100, 400):
        lines.update(done)
    text = out.getvalue().splitlines()
    assert text[0] == "compiling h100 for sm_90a: 400 configurations"
    assert text[1].startswith("compiling h100 for sm_90a: 1/400 (0%) in 0:00, about ")
    assert text[2].startswith("compiling h100 for sm_90a: 100/400 (25%) in 0:00") and len(text) == 3


D64_ONLY = ("PATH == 'wgmma' and CONSUMER_WGS == 3 and BLOCK_N == 128 and REG_PRODUCER == 24 and SPLIT_TAIL == 2 "
            "and INTRA_WG_OVERLAP == 1 and PINGPONG == 1 and SOFTMAX_PIN == 3 and O_TMA == 1 and STAGES == 2")


def test_check_shape_narrows_the_space_as_search_does(tmp_path: Path) -> None:
    """The h100 space's 192x128 tiles with 160 consumer registers are valid at D64 only: a check of the
    whole space has none of them, one narrowed by --shape to a D64 shape compiles them for D64 alone."""
    def check(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", "h100", "--where", D64_ONLY,
                               "--json", "--quiet", *extra], capture_output=True, text=True, cwd=tmp_path, timeout=600)

    whole = check()
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["summary"]["valid"] == 0
    narrowed = check("--shape", "4,16,2048,64")
    assert narrowed.returncode == 0, narrowed.stderr
    data = json.loads(narrowed.stdout)
    assert data["summary"]["variants"] == ["D64", "D64-causal"]
    assert data["summary"]["valid"] == data["summary"]["compiled"] >= 1 and data["summary"]["failed"] == 0
    assert {c["config"]["BLOCK_M"] for c in data["configs"]} == {192}
    assert all(c["registers"] <= 160 and c["spill_bytes"] == 0 for c in data["configs"]), data["configs"]
    wrong = check("--shape", "4,16,2048,96")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "--shape" in wrong.stderr, wrong.stderr


SPILLING = r"""
extern "C" __global__ void __launch_bounds__(THREADS) spill(const float* in, float* out, int n) {
    float acc[160];
    #pragma unroll
    for (int i = 0; i < 160; ++i) acc[i] = in[(threadIdx.x * 7 + i * 13) % n];
    #pragma unroll
    for (int r = 0; r < 8; ++r)
        #pragma unroll
        for (int i = 0; i < 160; ++i) acc[i] = acc[i] * acc[(i + r + 1) % 160] + acc[(i * 3 + r) % 160];
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 160; ++i) s += acc[i];
    out[threadIdx.x] = s;
}
"""


def test_a_spilling_kernel_is_reported_as_spilling() -> None:
    capped = compile_source(SPILLING.replace("THREADS", "1024"), "sm_90")  # at most 64 registers per thread
    assert capped.ok, capped.log
    assert capped.spill_bytes > 0 and capped.registers <= 64
    roomy = compile_source(SPILLING.replace("THREADS", "128"), "sm_90")
    assert roomy.ok and roomy.spill_bytes == 0


SPILLING_SPACE = """
name: spilling
target: {name: NVIDIA L4, arch: sm_89, sms: 58, smem_per_block: 101376}
problem: {shapes: [{B: 1, H: 8, S: 512, D: 64}]}
template: flash_attention
params:
  PATH: [wmma]
  BLOCK_M: [128]
  BLOCK_N: [64, 32]
  WARPS: [1, 4]
  VEC: [8]
"""


def test_a_spilling_configuration_is_flagged_by_check(tmp_path: Path) -> None:
    """One WMMA warp for a 128-row tile holds eight row groups of accumulators: it spills,
    and `check` says so; four warps on the same tile do not."""
    (tmp_path / "spilling.yaml").write_text(SPILLING_SPACE)
    proc = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", "spilling.yaml", "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_warps = {(c["config"]["WARPS"], c["config"]["BLOCK_N"]): c for c in data["configs"]}
    assert by_warps[(1, 64)]["spilling"] and by_warps[(1, 64)]["spill_bytes"] > 1000
    assert not by_warps[(4, 64)]["spilling"]
    assert data["summary"]["spilling"] == sum(c["spilling"] for c in data["configs"]) >= 2
    table = subprocess.run([sys.executable, "-m", "evoengineer", "check", "--space", "spilling.yaml", "--quiet"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert "spills" in table.stdout and f"spilling {data['summary']['spilling']} in" in " ".join(table.stdout.split()), table.stdout


def test_ptxas_log_parsing() -> None:
    log = """ptxas info    : Compiling entry function 'attn_fwd' for 'sm_90'
ptxas info    : Function properties for attn_fwd
ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
"""
    res = parse_ptxas_log(log)["attn_fwd"]
    assert (res.registers, res.static_smem, res.stack_bytes, res.spill_stores, res.spill_loads) == (255, 4096, 8, 12, 16)


def test_compile_cache_hits_and_key_changes() -> None:
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n'
    first = compile_source(src, "sm_90")
    again = compile_source(src, "sm_90")
    assert again.cached and again.key == first.key
    assert compile_source(src, "sm_89").key != first.key
    assert compile_source(src + "// changed\n", "sm_90").key != first.key


def test_wheel_ships_templates_and_spaces(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("evoengineer-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "evoengineer/templates/flash_attention.cu.j2" in names
    assert "evoengineer/templates/_attn_scalar.cuh.j2" in names
    assert "evoengineer/search_spaces/l4.yaml" in names and "evoengineer/search_spaces/h100.yaml" in names
    assert {"evoengineer/recordings/h100_mma_seed.jsonl", "evoengineer/recordings/h100_mma_seed.yaml"} <= set(names)


def test_compiled_image_is_a_complete_elf_file() -> None:
    """The cubin written to disk is as long as its ELF header says (tools such as nvdisasm read it)."""
    import struct

    result = compile_source('extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }', "sm_90")
    assert result.ok, result.error
    image = result.cubin()
    assert image[:4] == b"\x7fELF"
    ph_off, sh_off = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_num, sh_size, sh_num = struct.unpack_from("<HHHH", image, 0x36)
    assert len(image) >= max(ph_off + ph_size * ph_num, sh_off + sh_size * sh_num)
