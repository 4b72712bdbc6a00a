"""The correctness gate, attacked on purpose; crash and hang isolation; timing stability.

Each adversarial kernel is a small CUDA source with the attention kernel's argument
list; the gate must reject each with its own reason.
"""
from __future__ import annotations

import pytest

from evoengineer.kernels import KERNEL_ARGS, Launch, Rendered, compile_source
from evoengineer.space import Case, Config, Variant

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

NAIVE = r"""
typedef unsigned short half_t;
__device__ __forceinline__ float h2f(half_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ half_t f2h(float f) { half_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
// LAUNCH {"kernel": "attn_fwd", "block": [64, 1, 1], "smem": 0, "rows_per_cta": 64, "grid_z": 1}
extern "C" __global__ void attn_fwd(ARGS) {
    const int row = blockIdx.x * 64 + threadIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    PRELUDE
    if (row >= S_q) return;
    const half_t* q = Q + b * q_sb + h * q_sh + row * q_ss;
    float acc[DIM], m = -1e30f, l = 0.f;
    for (int d = 0; d < DIM; ++d) acc[d] = 0.f;
    const int last = CAUSAL ? min(S_k, row + 1) : S_k;
    for (int j = 0; j < last; ++j) {
        const half_t* k = K + b * k_sb + h * k_sh + j * k_ss;
        const half_t* v = V + b * v_sb + h * v_sh + j * v_ss;
        float s = 0.f;
        for (int d = 0; d < DIM; ++d) s += h2f(q[d]) * h2f(k[d]);
        s *= scale_log2;
        const float mn = fmaxf(m, s), c = exp2f(m - mn), p = exp2f(s - mn);
        l = l * c + p;
        for (int d = 0; d < DIM; ++d) acc[d] = acc[d] * c + p * h2f(v[d]);
        m = mn;
    }
    half_t* o = O + b * o_sb + h * o_sh + row * o_ss;
    for (int d = 0; d < DIM; ++d) o[d] = f2h(EPILOGUE);
    POSTLUDE
}
"""


def naive(prelude: str = "", epilogue: str = "acc[d] / l", postlude: str = "", dim: int = 64, causal: bool = False) -> Rendered:
    source = (NAIVE.replace("ARGS", KERNEL_ARGS).replace("PRELUDE", prelude).replace("EPILOGUE", epilogue)
              .replace("POSTLUDE", postlude).replace("DIM", str(dim)).replace("CAUSAL", "1" if causal else "0"))
    variant = Variant(dim, causal)
    return Rendered(Config(NAME=f"naive-{abs(hash(source))}"), variant, "adversarial", source, (Launch("attn_fwd", (64, 1, 1), 0, 64),))


def load(rendered: Rendered):
    from evoengineer.gpu import AttentionKernel

    res = compile_source(rendered.source, "sm_90")
    assert res.ok, res.log
    return AttentionKernel(rendered, res.cubin_path), res


CASE = Case(1, 4, 200, 64, False)


def gate(launcher, case: Case = CASE):
    from evoengineer.gpu.evaluate import gate_launcher

    return gate_launcher(launcher, case, None, 2e-2, 2e-2, seed=1234, trials=2)


def test_naive_reference_kernel_passes() -> None:
    kernel, _ = load(naive())
    for case in (CASE, Case(2, 3, 77, 64, False)):
        assert gate(kernel, case).status == "ok"
    kernel, _ = load(naive(causal=True))
    assert gate(kernel, Case(1, 2, 131, 64, True)).status == "ok"


def test_kernel_that_writes_nothing_is_rejected_even_over_a_stale_result() -> None:
    import torch

    good, _ = load(naive())
    q, k, v = (torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    good(q, k, v, out)  # a correct result now sits in memory the allocator will hand out again
    torch.cuda.synchronize()
    del out
    lazy, _ = load(naive(prelude="return;"))
    result = gate(lazy)
    assert result.status == "incorrect" and "never written" in result.reason


def test_kernel_that_writes_only_the_first_tile_is_rejected() -> None:
    kernel, _ = load(naive(prelude="if (blockIdx.x != 0 || blockIdx.y != 0) return;"))
    result = gate(kernel)
    assert result.status == "incorrect" and "never written" in result.reason


def test_kernel_that_overwrites_its_inputs_is_rejected() -> None:
    kernel, _ = load(naive(postlude="((half_t*)K)[b * k_sb + h * k_sh + row * k_ss] = 0;"))
    result = gate(kernel)
    assert result.status == "incorrect" and "input k was modified" in result.reason


def test_kernel_with_one_nan_row_is_rejected() -> None:
    kernel, _ = load(naive(epilogue="(row == 3 ? __int_as_float(0x7fc00000) : acc[d] / l)"))
    result = gate(kernel)
    assert result.status == "incorrect" and "not finite" in result.reason


def test_kernel_slightly_wrong_is_rejected_with_its_error() -> None:
    kernel, _ = load(naive(epilogue="acc[d] / l + 0.1f"))
    result = gate(kernel)
    assert result.status == "incorrect" and "exceeds atol" in result.reason and result.max_abs_err > 2e-2


# -- crash isolation through the worker -----------------------------------------------


def _job(rendered: Rendered, cubin: str, case: Case) -> dict:
    return {"kind": "gate", "rendered": rendered, "cubin_path": cubin, "cases": [(case, 1)], "key": "adv", "seed": 0,
            "scale": None, "atol": 2e-2, "rtol": 2e-2}


def test_illegal_address_and_hang_are_survived() -> None:
    from evoengineer.gpu import HANDLER, Worker

    good = naive()
    oob = naive(postlude="O[(long long)1 << 40] = 1;")
    hang = naive(prelude='for (;;) { asm volatile("nanosleep.u32 1000;"); }')
    cubins = {name: compile_source(r.source, "sm_90").cubin_path for name, r in (("good", good), ("oob", oob), ("hang", hang))}
    with Worker(HANDLER, device=0) as worker:
        assert worker.run({"kind": "info"}, 180).status == "ok"
        first = worker.run(_job(good, cubins["good"], CASE), 60)
        assert first.status == "ok" and first.value["status"] == "ok", first

        crashed = worker.run(_job(oob, cubins["oob"], CASE), 60)
        assert (crashed.status == "ok" and crashed.value["status"] == "launch_failed") or crashed.status == "crashed", crashed
        after = worker.run(_job(good, cubins["good"], CASE), 120)
        assert after.status == "ok" and after.value["status"] == "ok", after

        hung = worker.run(_job(hang, cubins["hang"], CASE), 8)
        assert hung.status == "timeout", hung
        again = worker.run(_job(good, cubins["good"], CASE), 120)
        assert again.status == "ok" and again.value["status"] == "ok", again
        assert worker.restarts >= 2


# -- timing ------------------------------------------------------------------------------


@pytest.mark.timing
def test_timing_one_kernel_twice_agrees_within_3_percent() -> None:
    import torch

    from evoengineer.gpu.evaluate import sdpa_op
    from evoengineer.gpu.timing import time_graph

    case = Case(4, 16, 2048, 64, False)
    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    op = sdpa_op("flash", q, k, v, False, None)
    time_graph([op], repetitions=100, warmup=10)  # settles the clocks after whatever ran before
    # At the power limit the SM clock can step between two measurements (seen after the whole suite:
    # 235.0 then 242.4 us): two back-to-back measurements must agree in one of three attempts.
    pairs = []
    for _ in range(3):
        first = time_graph([op], repetitions=100, warmup=10)
        second = time_graph([op], repetitions=100, warmup=10)
        pairs.append((first.median_us, second.median_us))
        if abs(first.median_us - second.median_us) / first.median_us < 0.03:
            break
    else:
        raise AssertionError(f"no two back-to-back measurements within 3% in three attempts: {pairs}")
    assert case.flops() / (first.median_us * 1e-6) / 1e12 > 50  # a real FlashAttention rate, not launch overhead


@pytest.mark.timing
def test_adaptive_repetitions_stop_early_and_agree_with_all_of_them() -> None:
    import torch

    from evoengineer.gpu.evaluate import sdpa_op
    from evoengineer.gpu.timing import time_graph

    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    op = sdpa_op("flash", q, k, v, False, None)
    time_graph([op], repetitions=300, warmup=10)  # settles the clocks
    # After long suites the GPU's clock drifts between measurements (seen: 235 µs with all 100
    # repetitions, then 248 µs, p20 241, adaptively; and 238, then 255 over the 10 ms of an early
    # stop, then 241): the early stop must agree, within 2%, with the full measurements taken just
    # before and just after it, not with one of them alone, in one of three bracketed attempts.
    attempts = []
    for _ in range(3):
        every = time_graph([op], repetitions=100, warmup=10)
        for _ in range(3):  # a clock change mid-run may keep one attempt from converging
            early = time_graph([op], repetitions=100, warmup=10, min_repetitions=20, precision=0.002)
            if early.repetitions < 100:
                break
        again = time_graph([op], repetitions=100, warmup=10)
        assert every.repetitions == 100 and 20 <= early.repetitions < 100, (every, early)
        assert early.rel_stderr <= 0.002
        low, high = min(every.median_us, again.median_us), max(every.median_us, again.median_us)
        attempts.append((every.median_us, early.median_us, again.median_us))
        if 0.98 * low <= early.median_us <= 1.02 * high:
            break
    else:
        raise AssertionError(f"early stop outside its brackets in every attempt (before, early, after): {attempts}")


@pytest.mark.timing
def test_a_candidate_far_behind_the_best_stops_at_five_samples() -> None:
    import torch

    from evoengineer.gpu.evaluate import sdpa_op
    from evoengineer.gpu.timing import time_graph

    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    op = sdpa_op("math", q, k, v, False, None)   # slow: several ms
    full = time_graph([op], repetitions=20, warmup=3)
    raced = time_graph([op], repetitions=100, warmup=10, min_repetitions=20, precision=0.002,
                       give_up_above_us=full.median_us / 2)
    assert raced.raced and raced.repetitions == 5, raced
    assert abs(raced.median_us - full.median_us) / full.median_us < 0.05, (full, raced)
    kept = time_graph([op], repetitions=100, warmup=3, min_repetitions=20, precision=0.002,
                      give_up_above_us=full.median_us * 2)
    assert not kept.raced and kept.repetitions >= 20, kept


@pytest.mark.timing
def test_graph_time_of_sdpa_agrees_with_profiler_within_10_percent() -> None:
    import torch

    from evoengineer.gpu.evaluate import sdpa_op
    from evoengineer.gpu.timing import profiler_kernel_us, time_graph

    q, k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    op = sdpa_op("flash", q, k, v, False, None)
    time_graph([op], repetitions=300, warmup=20)  # settles the clocks (seen from idle: 12.5 us, then 10.1 profiled)
    before = time_graph([op], repetitions=200, warmup=20).median_us
    profiled_us = profiler_kernel_us(op, calls=200)
    after = time_graph([op], repetitions=200, warmup=20).median_us
    # the profiler's figure within 10% of the graph's, bracketed by a measurement on either side of it
    assert 0.9 * min(before, after) <= profiled_us <= 1.1 * max(before, after), (before, profiled_us, after)
    assert max(before, after) < 30, (before, after)  # device time, not the 12-40 µs of Python dispatch


def test_work_on_another_stream_is_rejected() -> None:
    """Run in a fresh process: a refused graph capture can leave torch's capture state unusable."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import torch
from test_gate import CASE, gate, load, naive
from evoengineer.gpu.evaluate import _KernelFault, time_launcher
kernel, _ = load(naive())
side = torch.cuda.Stream()
def sneaky(q, k, v, out, scale):
    with torch.cuda.stream(side):  # the timer's stream sees none of this work
        torch.cuda._sleep(2_000_000)
        kernel(q, k, v, out, scale)
print("EAGER", gate(sneaky).status)
torch.cuda.synchronize()
TIMING = {"flush_l2": True, "repetitions": 20, "warmup": 2, "min_repetitions": 5, "precision": 0.002}
print("HONEST", time_launcher(kernel, CASE, None, TIMING, seed=7, tolerance=(2e-2, 2e-2))["status"])
try:
    print("TIMED", time_launcher(sneaky, CASE, None, TIMING, seed=7, tolerance=(2e-2, 2e-2)))
except _KernelFault as exc:  # the capture refused the foreign stream: rejected as launch_failed
    print("TIMED launch_failed", exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EAGER incorrect" in proc.stdout, proc.stdout
    assert "HONEST ok" in proc.stdout, proc.stdout
    timed = next(line for line in proc.stdout.splitlines() if line.startswith("TIMED"))
    assert "launch stream" in timed or "launch_failed" in timed, timed
