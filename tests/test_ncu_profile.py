"""The summary of Nsight Compute's source page (evoengineer.bench.ncu, benchmarks/ncu_profile.py) of Nsight Compute's source page, on a recorded excerpt
(ncu 2025 on an H100: a zero-fill kernel, then 60 instructions of the dtmao kernel at B4 H16 S2048 D128)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from evoengineer.bench import ncu as ncu_profile

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "ncu_profile.py"
EXCERPT = REPO / "tests" / "data" / "ncu_source_attn_fwd.csv"



def test_kernels_are_read_in_order_with_their_instructions() -> None:
    kernels = ncu_profile.read_source_csv(EXCERPT.read_text())
    names = list(kernels)
    assert len(names) == 2 and "FillFunctor" in names[0] and names[1] == "attn_fwd"
    fill, attn = kernels.values()
    assert len(fill) == 6 and len(attn) == 60
    assert sum(i.samples for i in attn) == 12519
    assert sum(i.not_issued for i in attn) == 7496


def test_opcodes_drop_predicates_and_keep_the_shape_of_hgmma() -> None:
    ins = ncu_profile.Instruction
    assert ins("@!P0  BRA 0x7fedbf7b9420", 1, 1, 1).opcode == "BRA"
    assert ins("HGMMA.64x128x16.F32 R24, R152, gdesc[UR16].tnspB, R24", 1, 1, 1).opcode == "HGMMA.64x128x16"
    assert ins("WARPGROUP.DEPBAR.LE gsb0, 0x1", 1, 1, 1).opcode == "WARPGROUP.DEPBAR"
    assert ins("MUFU.EX2 R3, R3", 1, 1, 1).opcode == "MUFU"


def test_the_loop_body_is_the_execution_count_with_most_samples() -> None:
    attn = ncu_profile.read_source_csv(EXCERPT.read_text())["attn_fwd"]
    groups = ncu_profile.by_execution_count(attn)
    executed, instructions, samples = groups[0]
    # 1024 work tiles x 15 loop iterations (the first tile of each runs outside it) x 8 consumer warps
    assert executed == 1024 * 15 * 8
    assert samples == sum(i.samples for i in attn if i.executed == executed) > sum(s for _, _, s in groups[1:])
    ops = ncu_profile.by_opcode(attn)
    assert ops[0][0] == "WARPGROUP.DEPBAR" and [s for _, s, _, _ in ops] == sorted((s for _, s, _, _ in ops), reverse=True)


def test_summary_cli_filters_kernels_and_reports_a_missing_file(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "summary", str(EXCERPT), "--kernel", "attn", "--rows", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "attn_fwd" in done.stdout and "FillFunctor" not in done.stdout
    assert "12519 samples" in done.stdout and "78.8%" in done.stdout
    assert all(len(line) <= 80 for line in done.stdout.splitlines())
    missing = subprocess.run([sys.executable, str(SCRIPT), "summary", str(tmp_path / "none.csv")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
