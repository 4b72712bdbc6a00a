"""The backward searched on the GPU: the gradient gate refuses wrong, unwritten and
nondeterministic gradients; a backward space's search ranks its candidates against SDPA's
backends' backward timed by the same harness (TF/s at 2.5 times the forward's FLOPs); and an
export of a forward run beside the backward run dispatches the backward run's winners, whose
gradients meet flash-attn's rule."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from evoengineer.space import Case, Config, Variant

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                       reason="needs a CUDA GPU with sm_80 or newer"),
]

FORWARD = Config(PATH="mma", BLOCK_M=64, BLOCK_N=64, WARPS=4, VEC=8, STAGES=2, SPLITS=1)


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _kernel(config: Config, causal: bool = False):
    from evoengineer.gpu.backward import load_backward

    return load_backward(config, Variant(64, causal), "cuda")


def test_the_gate_refuses_wrong_unwritten_and_nondeterministic_gradients() -> None:
    from evoengineer.gpu.backward_jobs import gate_backward
    from evoengineer.kernels.backward_rules import default_config

    case = Case(1, 4, 77, 64, True, heads_kv=2, seq_kv=130)
    atomic, separate = _kernel(default_config(64), True), _kernel(default_config(64, deterministic_dq=True), True)
    assert gate_backward(atomic, True, case, None, 7, 2).status == "ok"
    assert gate_backward(separate, False, case, None, 7, 2).status == "ok"

    def nudged(*args, **buffers):
        atomic(*args, **buffers)
        buffers["dq"][0, 0, 3, 5] += 0.25

    def half_written(*args, **buffers):
        atomic(*args, **buffers)
        buffers["dk"][:, :, 100:].fill_(float("nan"))   # as a kernel that stops short of the last key tile

    calls = []

    def drifting(*args, **buffers):
        separate(*args, **buffers)
        calls.append(1)
        if len(calls) % 2 == 0:  # the second run on the same inputs differs in the last bit of one gradient
            buffers["dq"].view(torch.int16)[0, 1, 2, 3] ^= 1

    for launcher, atomic_dq, fragment in ((nudged, True, "dq:"), (half_written, True, "dk:"),
                                          (drifting, False, "differs between two runs")):
        result = gate_backward(launcher, atomic_dq, case, None, 7, 1)
        assert result.status == "incorrect" and fragment in result.reason, result.reason


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A backward search over a tiny space (six configurations) and a replayed forward run, exported together."""
    root = tmp_path_factory.mktemp("bwd_search")
    target = {"name": "this GPU", "arch": _arch(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "smem_per_block": 232448 if _arch() >= "sm_90" else 101376}
    backward = {
        "name": "tiny-backward", "target": target,
        "problem": {"dtype": "fp16", "shapes": [{"B": 2, "H": 4, "H_KV": 2, "S": 300, "D": 64, "causal": [False, True]}]},
        "template": "flash_attention_bwd",
        "paths": {"mma": {"params": {"DKDV": ["strips", "tiles"], "BLOCK_M": [32, 64], "BLOCK_N": [64], "STAGES": [2],
                                     "DQ_MODE": ["atomic", "separate"], "DQ_BLOCK_M": [64], "DQ_BLOCK_N": [64]}}},
        "timing": {"warmup": 2, "repetitions": 10, "timeout_s": 30},
        "search": {"strategy": "grid", "budget": 8, "top_k": 3},
    }
    forward = {
        "name": "tiny-forward", "target": target,
        "problem": {"dtype": "fp16", "shapes": [{"B": 2, "H": 4, "H_KV": 2, "S": 300, "D": 64, "causal": [False, True]}]},
        "template": "flash_attention", "params": {k: [v] for k, v in FORWARD.items()},
        "search": {"strategy": "grid", "budget": 1, "top_k": 1},
    }
    (root / "bwd.yaml").write_text(yaml.safe_dump(backward, sort_keys=False))
    (root / "fwd.yaml").write_text(yaml.safe_dump(forward, sort_keys=False))
    (root / "rec.jsonl").write_text(json.dumps({"header": {"space_inline": forward}}) + "\n" + json.dumps(
        {"config": FORWARD.to_dict(), "key": FORWARD.key(), "status": "ok", "reason": "", "objective_us": 10.0}) + "\n")
    out: dict = {"root": root}
    steps = (("search", "--space", "bwd.yaml", "--run-dir", "bwd", "--json", "--retime-rounds", "1"),
             ("search", "--space", "fwd.yaml", "--replay", "rec.jsonl", "--run-dir", "fwd", "--quiet"),
             ("export", "fwd", "bwd", "--out", "best"))
    for args in steps:
        done = subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=root,
                              timeout=900)
        assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}{done.stdout[-2000:]}"
        if args[0] == "search" and "--json" in args:
            out["search"] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_a_backward_search_ranks_its_candidates_against_sdpas_backward(searched: dict) -> None:
    root = searched["root"]
    results = [json.loads(line) for line in (root / "bwd" / "results.jsonl").read_text().splitlines() if line.strip()]
    assert len(results) == 6 and all(r["status"] == "ok" for r in results), [r["reason"] for r in results]
    for r in results:   # every case gated: the space's two and the backward's edge shapes, each twice
        gated = {c["label"] for c in r["cases"]}
        assert {"B2 H4/2 S300 D64", "B2 H4/2 S300 D64 causal", "B2 H3 S77/257 D64 causal"} <= gated
    baseline = json.loads((root / "bwd" / "baseline.json").read_text())
    for rows in baseline.values():
        assert rows["flash"]["status"] == "ok" and "math" not in rows
    entries = searched["search"]["leaderboard"]
    assert entries and all(e["tflops"] > 0 and e["speedup"].get("flash") for e in entries)
    board = json.loads((root / "bwd" / "leaderboard.json").read_text())
    sdpa_rows = {row["backend"]: row for row in board.get("sdpa", [])}
    assert "flash" in sdpa_rows and sdpa_rows["flash"]["geomean_us"] > 0
    run = json.loads((root / "bwd" / "run.json").read_text())
    case = Case(2, 4, 300, 64, True, heads_kv=2)
    assert run["case_flops"][case.label()] == pytest.approx(case.backward_flops())


def test_the_export_dispatches_the_backward_runs_winners_and_their_gradients_meet_the_rule(searched: dict) -> None:
    from run_fixtures import load_module

    from evoengineer.gpu.backward import rule_check, sdpa_gradients

    root = searched["root"]
    info = json.loads((root / "best" / "kernel.json").read_text())["backward"]
    measured = {(v["head_dim"], v["causal"]): v for v in info["variants"] if v["dtype"] == "fp16"}
    assert measured[(64, False)]["measured_cases"] == 1 and measured[(64, True)]["measured_cases"] == 1
    results = [json.loads(line) for line in (root / "bwd" / "results.jsonl").read_text().splitlines() if line.strip()]
    for causal in (False, True):
        label = "B2 H4/2 S300 D64" + (" causal" if causal else "")
        best = min(results, key=lambda r: next(c["time"]["median_us"] for c in r["cases"] if c["label"] == label))
        assert measured[(64, causal)]["cases"][0]["config"] == best["key"]
    module = load_module(root / "best")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(2, h, 300, 64, generator=gen, device="cuda", dtype=torch.float16) for h in (4, 2, 2, 4))
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module.attention(*leaves, is_causal=causal, enable_gqa=True)
        out.backward(do)
        ref, low = sdpa_gradients(q, k, v, do, causal, None, torch.float32), sdpa_gradients(q, k, v, do, causal, None)
        for name, ours, r32, rlow in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref, low):
            check = rule_check(name, ours, r32, rlow)
            assert check.ok, f"{'causal' if causal else 'full'}: {check}"
