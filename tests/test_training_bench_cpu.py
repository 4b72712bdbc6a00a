"""The training benchmark's arithmetic and rows without a GPU (``evoengineer.bench.training``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evoengineer.bench.training import SHAPES, TrainShape, backward_flops, backward_row, summary_lines

REPO = Path(__file__).resolve().parent.parent


def test_the_shapes_and_backward_flops_of_the_issue() -> None:
    assert [s.label() for s in SHAPES] == ["B4 H16 S2048 D64", "B4 H16 S2048 D128", "B8 H16 S4096 D128",
                                          "B2 H32/8 S4096 D128", "B1 H32 S8192 D128"]
    shape = TrainShape(4, 16, 16, 2048, 128)
    assert backward_flops(shape, False) == pytest.approx(2.5 * 4 * 4 * 16 * 2048 * 2048 * 128)
    assert backward_flops(shape, True) == backward_flops(shape, False) / 2


def test_a_row_pairs_rounds_and_skips_sides_that_did_not_run() -> None:
    shape = TrainShape(1, 1, 1, 1000, 100)   # 1e9 backward FLOPs when full
    row = backward_row(shape, "fp16", False, {"evo": [100.0, 110.0, 90.0], "flash": [200.0, 200.0, 100.0],
                                              "fa4": "No module named 'flash_attn'"})
    assert row["sides"]["evo"]["median_us"] == 100.0 and row["sides"]["evo"]["tflops"] == pytest.approx(10.0)
    assert row["sides"]["fa4"] == {"skipped": "No module named 'flash_attn'"}
    assert row["evo_time_over"] == {"flash": pytest.approx(0.55)}   # median of 0.5, 0.55, 0.9
    assert summary_lines([row]) == ["evo time / flash time, geomean over 1 rows: 0.550 (worst 0.550)"]


def test_the_script_describes_itself() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "training_vs_sdpa.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and "--module" in done.stdout and "cuDNN" in done.stdout


def test_the_padded_llama_batch_is_right_padded_as_transformers_takes_it() -> None:
    from evoengineer.bench.training import PADDED_LENGTHS, right_padding_mask

    mask = right_padding_mask(PADDED_LENGTHS, 2048)
    assert mask.shape == (4, 2048) and mask.sum(dim=1).tolist() == [2048, 1536, 1024, 512]
    assert mask[1, :1536].all() and not mask[1, 1536:].any()   # tokens first, then padding
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "training_vs_sdpa.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert "--padded" in done.stdout
