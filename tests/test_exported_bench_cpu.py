"""An export timed as a user calls it (evoengineer.bench.calls, .targets): target verdicts, loop
sizes, the order of the rounds, on hand-made rows and recorded calls (no GPU)."""
from __future__ import annotations

import pytest

from evoengineer.bench import calls, targets
from evoengineer.bench.exported import PAIRED


def measured(impl: str, device: float, eager: float, graph: float, *, eager_spread: float = 0.2,
             device_spread: float = 0.05, shape: str = "B1 H8 S512 D64", dtype: str = "fp16",
             causal: bool = False) -> dict:
    return {"shape": shape, "dtype": dtype, "causal": causal, "impl": impl, "status": "ok", "device_us": device,
            "eager_us": eager, "overhead_us": eager - device, "graph_us": graph, "eager_spread_us": eager_spread,
            "device_spread_us": device_spread}


def pair(ours: tuple, sdpa: tuple, **kw) -> list[dict]:
    return [measured("evo", *ours, **kw), measured("sdpa", *sdpa, **kw)]


def test_a_row_that_meets_every_target() -> None:
    # device 10/6 = 1.67, eager 18/10 = 1.8, overhead 4 < 8, graph 10.1/6.1 = 1.66 (-0.7% off the device's)
    v = targets.target_verdicts(*pair((6.0, 10.0, 6.1), (10.0, 18.0, 10.1)))
    assert v["a"]["applies"] and v["a"]["met"] is True
    assert v["b"]["verdict"] == "lower" and v["b"]["met"] and v["b"]["difference_us"] == pytest.approx(-4.0)
    assert v["b"]["noise_us"] == pytest.approx(2 * (0.2 + 0.05))
    assert v["c"]["met"] and v["c"]["deviation"] == pytest.approx(10.1 / 6.1 / (10 / 6) - 1)


def test_each_target_can_fail() -> None:
    # (a): device speedup 1.01, eager 0.997; (b) still holds: 0.5 against -0.8 µs, within a noise of 1.4
    a = targets.target_verdicts(*pair((100.0, 100.5, 100.0), (101.0, 100.2, 101.0), eager_spread=0.5, device_spread=0.2))
    assert a["a"]["applies"] and a["a"]["met"] is False
    assert a["b"]["verdict"] == "equal" and a["c"]["met"]
    # (a) does not apply where the device speedup is below 1, whatever eager reads
    na = targets.target_verdicts(*pair((100.0, 150.0, 100.0), (90.0, 91.0, 90.0)))
    assert not na["a"]["applies"] and na["a"]["met"] is None
    # (b): overhead 20 µs against 2, far past a noise of 0.5
    b = targets.target_verdicts(*pair((100.0, 120.0, 100.0), (100.0, 102.0, 100.0)))
    assert b["b"]["verdict"] == "higher" and b["b"]["met"] is False
    assert b["a"]["applies"] and b["a"]["met"] is False and b["c"]["met"]
    # (c): device 1.57, graph 1.38 (-12%: a graph launch per call dilutes it)
    c = targets.target_verdicts(*pair((6.4, 10.0, 7.25), (10.0, 15.0, 10.0)))
    assert c["c"]["met"] is False and c["c"]["deviation"] == pytest.approx(10.0 / 7.25 / (10.0 / 6.4) - 1)
    assert c["a"]["met"] and c["b"]["met"]
    # (c)'s bound is 5% either way
    assert targets.target_verdicts(*pair((10.0, 10.0, 10.0), (10.0, 10.0, 10.4)))["c"]["met"]
    assert not targets.target_verdicts(*pair((10.0, 10.0, 10.0), (10.0, 10.0, 10.6)))["c"]["met"]
    assert not targets.target_verdicts(*pair((10.0, 10.0, 10.0), (10.0, 10.0, 9.4)))["c"]["met"]


def test_overhead_within_noise_counts_as_equal() -> None:
    # ours 5 µs, SDPA's 4: 1 µs higher; noise 0.5 + 0.5 + 0.1 + 0.1 = 1.2 µs covers it
    noisy = pair((50.0, 55.0, 50.0), (50.0, 54.0, 50.0), eager_spread=0.5, device_spread=0.1)
    v = targets.target_verdicts(*noisy)
    assert v["b"]["noise_us"] == pytest.approx(1.2)
    assert v["b"]["verdict"] == "equal" and v["b"]["met"] is True
    # the same 1 µs with steadier loops (noise 0.2 + 0.2 + 0.1 + 0.1 = 0.6 µs) is higher
    steady = pair((50.0, 55.0, 50.0), (50.0, 54.0, 50.0), eager_spread=0.2, device_spread=0.1)
    v = targets.target_verdicts(*steady)
    assert v["b"]["noise_us"] == pytest.approx(0.6)
    assert v["b"]["verdict"] == "higher" and v["b"]["met"] is False
    # lower by less than the noise is equal too, not lower
    v = targets.target_verdicts(*pair((50.0, 54.0, 50.0), (50.0, 55.0, 50.0), eager_spread=0.5, device_spread=0.1))
    assert v["b"]["verdict"] == "equal" and v["b"]["met"]


def test_rows_are_grouped_counted_and_listed() -> None:
    results = [
        *pair((6.0, 10.0, 6.1), (10.0, 18.0, 10.1), shape="B1 H8 S512 D64"),
        measured("sdpa flash", 9.0, 30.0, 9.0, shape="B1 H8 S512 D64"),  # a forced backend: not SDPA's choice
        *pair((100.0, 100.5, 100.0), (101.0, 100.2, 101.0), eager_spread=0.5, device_spread=0.2,
              shape="B2 H32/8 S2048 D128 GQA", dtype="bf16", causal=True),
        *pair((100.0, 120.0, 100.0), (100.0, 102.0, 100.0), shape="B4 H16 S2048 D64"),
        *pair((6.4, 10.0, 7.25), (10.0, 15.0, 10.0), shape="B1 H8 S512 D64", dtype="bf16"),
        measured("evo", 6.0, 10.0, 6.0, shape="B8 H32 S1/4096 D128"),
        {"shape": "B8 H32 S1/4096 D128", "dtype": "fp16", "causal": False, "impl": "sdpa", "status": "unsupported"},
    ]
    entries = targets.evaluate_targets(results)
    assert [e["row"] for e in entries] == ["B1 H8 S512 D64 fp16", "B2 H32/8 S2048 D128 GQA causal bf16",
                                          "B4 H16 S2048 D64 fp16", "B1 H8 S512 D64 bf16", "B8 H32 S1/4096 D128 fp16"]
    assert entries[0]["a"]["eager_speedup"] == pytest.approx(1.8)  # against "sdpa", not "sdpa flash"
    assert entries[-1]["missing"] == "no sdpa measurement" and "a" not in entries[-1]
    summary = targets.summarize_targets(entries)
    assert summary["a"] == {"rows": 4, "met": 2, "not_met": ["B2 H32/8 S2048 D128 GQA causal bf16",
                                                             "B4 H16 S2048 D64 fp16"]}
    assert (summary["b"]["rows"], summary["b"]["met"], summary["b"]["not_met"]) == (4, 3, ["B4 H16 S2048 D64 fp16"])
    assert summary["b"]["equal"] == 1
    assert summary["c"]["not_met"] == ["B1 H8 S512 D64 bf16"] and summary["c"]["met"] == 3
    assert summary["missing"]["labels"] == ["B8 H32 S1/4096 D128 fp16"]

    lines = targets.target_lines(entries)
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    text = "\n".join(lines)
    assert "(a) eager ×sdpa >= 1 where device ×sdpa >= 1: 2 of 4 rows" in text
    assert "(c) graph ×sdpa within 5% of device ×sdpa: 3 of 4 rows" in text
    assert "    not met: B4 H16 S2048 D64 fp16: 20.0 vs 2.0 µs, +18.0 > noise 0.5" in text
    assert "    not met: B1 H8 S512 D64 bf16: graph 1.38, device 1.56 (-11.7%)" in text
    assert "    not met: B2 H32/8 S2048 D128 GQA causal bf16: device 1.010, eager 0.997" in text
    assert "(b) overhead <= sdpa's, or equal within noise: 3 of 4 rows (1 of them equal)" in text
    assert text.endswith("not evaluated: 1 row without an evo or sdpa measurement")
    row = next(line for line in lines if line.startswith("  B4 H16 S2048 D64 fp16 "))
    assert row.split()[-9:] == ["1.00", "0.85", "NO", "20.0", "2.0", "0.5", ">", "1.00", "ok"]


def test_loop_sizes() -> None:
    # at least --calls, at least ~30 ms of device time, whole rotations over the sets
    assert calls.loop_calls(200, 6.0, 30.0, 50) == 5000
    assert calls.loop_calls(200, 3000.0, 30.0, 1) == 200
    assert calls.loop_calls(200, 3000.0, 30.0, 3) == 201
    assert calls.loop_calls(50, 100.0, 10.0, 8) == 104
    assert calls.half_range([10.0, 12.0, 11.0]) == pytest.approx(1.0)
    assert calls.half_range([]) == 0.0


def a_round(device: float, eager: float, graph: float, *, spread: float = 0.1, loops: tuple = ()) -> dict:
    return {"impl": "x", "status": "ok", "device_us": device, "device_spread_us": spread, "eager_us": eager,
            "overhead_us": eager - device, "host_us": 5.0, "sync_us": device + 10, "graph_us": graph,
            "graph_per_device": graph / device, "graph1_us": graph + 1,
            "eager_loops_us": list(loops or (eager - 0.5, eager + 0.5)), "eager_calls": 200, "graph_calls": 8,
            "input_sets": 4}


def test_rounds_combine_into_medians_and_a_spread_over_them() -> None:
    rounds = [a_round(10.0, 12.0, 10.0, loops=(11.0, 12.0)), a_round(20.0, 23.0, 21.0, loops=(22.0, 24.0)),
              a_round(12.0, 14.0, 13.0, spread=0.3, loops=(13.5, 14.5))]
    row = calls.combine_rounds("evo", rounds)
    assert (row["device_us"], row["eager_us"], row["graph_us"]) == (12.0, 14.0, 13.0)
    assert row["overhead_us"] == pytest.approx(2.0) and len(row["rounds"]) == 3
    assert row["eager_spread_us"] == pytest.approx((24.0 - 11.0) / 2)         # over every loop of every round
    assert row["device_spread_us"] == pytest.approx((20.0 - 10.0) / 2)        # the rounds' own spread, > 0.1 .. 0.3
    # one round is a row as measured; a failed round fails the row
    assert calls.combine_rounds("evo", rounds[:1]) is rounds[0]
    failed = {"impl": "evo", "status": "unsupported", "reason": "no"}
    assert calls.combine_rounds("evo", [rounds[0], failed]) is failed


def test_speedups_pair_the_rounds() -> None:
    """The GPU's clock drifts between rounds (10, 20, 30 µs); each round's SDPA is 1.1x ours on
    the device and in the graph, except round 2's graph (+20 %). Paired per round, (c) holds (the
    median deviation is 0); the medians of the figures alone would make it +20 %."""
    ours = calls.combine_rounds("evo", [a_round(t, t + 2, t) for t in (10.0, 20.0, 30.0)])
    sdpa = calls.combine_rounds("sdpa", [a_round(1.1 * t, 1.1 * t + 2, g) for t, g in ((10.0, 11.0), (20.0, 26.4),
                                                                                        (30.0, 33.0))])
    v = targets.target_verdicts(ours, sdpa)
    assert v["a"]["device_speedup"] == pytest.approx(1.1) and v["c"]["graph_speedup"] == pytest.approx(1.1)
    assert v["c"]["deviation"] == pytest.approx(0.0) and v["c"]["met"]
    unpaired = {k: x for k, x in sdpa.items() if k not in ("rounds", "graph_per_device")}
    assert not targets.target_verdicts(ours, unpaired)["c"]["met"]                  # 26.4 / 20 against 22 / 20
    assert calls.speedups([ours, sdpa])["graph_us"] == pytest.approx(1.1)


def test_graph_deviation_comes_from_each_sides_graph_over_its_own_device_samples() -> None:
    """The clock moves between the device column and the graph column of a round: SDPA's graph
    reads 1.1x ours, its device time 1.2x (round 1) or 1.0x (round 2). Each side's graph samples
    over the device samples taken beside them are 1.0 and 1.02: (c)'s deviation is 1.02 / 1.0 - 1,
    where the device and graph medians alone would put it at -8 % and +10 %."""
    ours = calls.combine_rounds("evo", [{**a_round(10.0, 12.0, 10.0), "graph_per_device": 1.0},
                                        {**a_round(10.0, 12.0, 10.0), "graph_per_device": 1.0}])
    sdpa = calls.combine_rounds("sdpa", [{**a_round(12.0, 14.0, 11.0), "graph_per_device": 1.02},
                                         {**a_round(10.0, 12.0, 11.0), "graph_per_device": 1.02}])
    v = targets.target_verdicts(ours, sdpa)
    assert v["c"]["graph_speedup"] == pytest.approx(1.1) and v["c"]["device_speedup"] == pytest.approx(1.1)
    assert v["c"]["deviation"] == pytest.approx(0.02) and v["c"]["met"]
    assert ours["graph_per_device"] == 1.0 and len(ours["rounds"]) == 2
    # a graph that costs SDPA nothing and ours 7 % more than our device time fails, rounds or not
    slow = {**a_round(10.0, 12.0, 10.7), "graph_per_device": 1.07}
    single = targets.target_verdicts(slow, {**a_round(11.0, 13.0, 11.0), "graph_per_device": 1.0})
    assert single["c"]["deviation"] == pytest.approx(1 / 1.07 - 1) and not single["c"]["met"]
    both = targets.target_verdicts(calls.combine_rounds("evo", [slow, slow]), sdpa)
    assert both["c"]["deviation"] == pytest.approx(1.02 / 1.07 - 1) and both["c"]["met"]
    worse = calls.combine_rounds("evo", [{**slow, "graph_per_device": 1.09}] * 2)
    assert not targets.target_verdicts(worse, sdpa)["c"]["met"]


class Recorder:
    """Stands in for the measuring functions: records (what, impl) in call order and answers with
    made-up figures (device 10 µs, eager 12, graph 10.5); ``fail`` = (what, impl, round) raises there."""

    def __init__(self, fail: tuple[str, str, int] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def _record(self, what: str, fn) -> str:
        impl = fn.name
        self.calls.append((what, impl))
        if self.fail and (what, impl, self.calls.count((what, impl))) == self.fail:
            raise RuntimeError(f"{impl} does not take the shape\nmore")
        return impl

    def heat_up(self, fns, sets, ms) -> int:
        self.calls.append(("heat", "+".join(fn.name for fn in fns)))
        self.heat_ms = ms
        return 1

    def device_times(self, fn, sets, repetitions) -> dict:
        self._record("device", fn)
        return {"device_us": 10.0, "device_spread_us": 0.1}

    def eager_times(self, fn, sets, calls, device_us) -> dict:
        assert device_us == 10.0                    # sized by its own device time of the round
        self._record("eager", fn)
        return {"eager_us": 12.0, "eager_spread_us": 0.5, "eager_loops_us": [11.5, 12.0, 12.5], "host_us": 5.0,
                "sync_us": 20.0, "eager_calls": 200}

    def graph_times(self, fn, sets, calls, device_us) -> dict:
        self._record("graph", fn)
        return {"graph_us": 10.5, "graph_calls": 8, "graph_per_device": 1.05, "graph1_us": 11.0}


class Impl:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args) -> None:
        pass


def recorded(monkeypatch, fail: tuple[str, str, int] | None = None) -> tuple[Recorder, dict]:
    rec = Recorder(fail)
    for name in ("heat_up", "device_times", "eager_times", "graph_times"):
        monkeypatch.setattr(calls, name, getattr(rec, name))
    monkeypatch.setattr(calls, "synchronize", lambda: rec.calls.append(("sync", "")))
    impls = {name: Impl(name) for name in ("evo", "sdpa", "sdpa flash")}
    return rec, calls.measure_rounds(impls, [(1,), (2,)], 200, 10, 2, PAIRED)


def test_rounds_go_column_by_column_after_a_heat_up(monkeypatch) -> None:
    rec, per_round = recorded(monkeypatch)
    assert rec.calls == [("heat", "evo+sdpa"),
                         ("device", "evo"), ("device", "sdpa"), ("eager", "evo"), ("eager", "sdpa"),
                         ("graph", "evo"), ("graph", "sdpa"),
                         ("device", "sdpa"), ("device", "evo"), ("eager", "sdpa"), ("eager", "evo"),
                         ("graph", "sdpa"), ("graph", "evo"),
                         ("device", "sdpa flash"), ("eager", "sdpa flash"), ("graph", "sdpa flash")]
    assert rec.heat_ms == calls.HEAT_MS == 300.0 and calls.EAGER_LOOPS == 3
    assert [len(per_round[k]) for k in ("evo", "sdpa", "sdpa flash")] == [2, 2, 1]
    first = per_round["evo"][0]
    assert first["status"] == "ok" and first["overhead_us"] == pytest.approx(2.0) and first["input_sets"] == 2
    assert list(first)[:2] == ["impl", "device_us"] and list(first)[-2:] == ["input_sets", "status"]
    row = calls.combine_rounds("evo", per_round["evo"])
    assert set(calls.ROUND_FIGURES) <= set(row["rounds"][0]) and len(row["rounds"]) == 2


def test_a_failed_column_fails_that_round_only(monkeypatch) -> None:
    rec, per_round = recorded(monkeypatch, fail=("eager", "sdpa", 2))   # sdpa's eager loops of round 2
    round2 = rec.calls[7:13]
    assert round2 == [("device", "sdpa"), ("device", "evo"), ("eager", "sdpa"), ("sync", ""), ("eager", "evo"),
                      ("graph", "evo")]                                          # no graph for sdpa after it
    assert [r["status"] for r in per_round["sdpa"]] == ["ok", "unsupported"]
    assert per_round["sdpa"][1] == {"impl": "sdpa", "status": "unsupported", "reason": "sdpa does not take the shape"}
    assert [r["status"] for r in per_round["evo"]] == ["ok", "ok"]
    assert per_round["sdpa flash"][0]["status"] == "ok"
    assert calls.combine_rounds("sdpa", per_round["sdpa"])["status"] == "unsupported"


def test_heat_up_calls_in_turn_for_its_time(monkeypatch) -> None:
    seen: list[tuple[str, int]] = []
    waited: list[int] = []

    class Event:
        def __init__(self, n: int) -> None:
            self.n = n

        def synchronize(self) -> None:
            waited.append(self.n)

    monkeypatch.setattr(calls, "_recorded_event", lambda: Event(len(seen)))
    monkeypatch.setattr(calls, "synchronize", lambda: seen.append(("sync", 0)))

    def impl(name: str, raises: bool = False):
        def call(x: int) -> None:
            seen.append((name, x))
            if raises:
                raise RuntimeError("no")
        return call

    passes = calls.heat_up([impl("a"), impl("b"), impl("c", raises=True)], [(0,), (1,), (2,)], 20.0)
    assert seen[-1] == ("sync", 0) and seen[:3] == [("a", 0), ("b", 0), ("c", 0)]
    body = seen[3:-1]                                   # c left after its failure; a and b alternate on the sets
    assert body == [(n, i % 3) for i in range(1, passes) for n in "ab"] and passes > calls.HEAT_IN_FLIGHT
    assert len(waited) == passes - calls.HEAT_IN_FLIGHT  # at most HEAT_IN_FLIGHT passes ahead


# -- the feature rows (--features): rows, the SDPA side on the CPU, the kernel serving each, flags ---

import importlib.util  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from run_fixtures import LARGE128, MMA, load_module, make_run, space_doc  # noqa: E402

from evoengineer.bench import features as fb  # noqa: E402
from evoengineer.results import export_runs  # noqa: E402
from evoengineer.results.per_shape import short_config  # noqa: E402
from evoengineer.space import Config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "exported_vs_sdpa.py"


def test_feature_rows_are_the_issue_shapes_one_feature_each() -> None:
    rows = {r.name: r for r in fb.FEATURE_ROWS}
    assert len(rows) == len(fb.FEATURE_ROWS) and all(len(name) <= 40 for name in rows)
    by = {(r.feature, r.dims, r.window_left, r.softcap, r.lengths) for r in fb.FEATURE_ROWS}
    assert ("window", (1, 32, 8, 8192, 8192, 128), 4095, 0.0, ()) in by                   # Mistral 7B's local layers
    assert ("softcap", (4, 16, 8, 2048, 2048, 256), -1, 50.0, ()) in by                   # Gemma-2's global layers
    assert ("plain", (4, 32, 32, 2048, 2048, 96), -1, 0.0, ()) in by                      # Phi-3 mini
    assert ("plain", (4, 16, 8, 2048, 2048, 256), -1, 0.0, ()) in by
    padded = next(r for r in fb.FEATURE_ROWS if r.feature == "padding")
    assert padded.dims == (4, 32, 8, 2048, 2048, 128) and len(set(padded.lengths)) == 4 and max(padded.lengths) == 2048
    packed = [r for r in fb.FEATURE_ROWS if r.feature == "varlen"]
    assert [r.lengths for r in packed][0] == (1, 17, 1000, 4099) and len(packed[1].lengths) == 16
    assert packed[0].offsets == [0, 1, 18, 1018, 5117] and packed[0].tokens == 5117 and packed[0].seq == 4099
    assert {r.feature: r.needed for r in fb.FEATURE_ROWS} == {"window": ("window",), "softcap": ("softcap",),
                                                             "padding": ("seqlens",), "varlen": ("varlen",), "plain": ()}
    assert [r.floor for r in fb.FEATURE_ROWS] == [True, True, True, False, False, False, False]
    assert next(r for r in fb.FEATURE_ROWS if r.feature == "softcap").sdpa == ""     # SDPA cannot soft-cap
    with pytest.raises(ValueError, match="lengths"):
        fb.FeatureRow("x", "varlen", 2, 4, 4, 10, 16, lengths=(3, 9))               # the longest must be seq
    with pytest.raises(ValueError, match="feature"):
        fb.FeatureRow("x", "alibi", 1, 4, 4, 10, 16)


def naive(row: fb.FeatureRow, q, k, v):
    """The row's result by its definition, one (batch, head, query) at a time in fp64 (a padded
    batch's padded query rows 0, as ours and flash-attn-4 skip them)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(row.head_dim)
    group = row.heads // row.heads_kv
    out = torch.zeros_like(q)
    if row.feature == "varlen":
        spans = list(zip(row.offsets[:-1], row.offsets[1:]))
    else:
        spans = [(b, row.seq) for b in range(row.batch)]
    for b, (first, end) in enumerate(spans):
        n = end - first if row.feature == "varlen" else row.seq
        keys = row.lengths[b] if row.feature == "padding" else n
        for h, i in itertools.product(range(row.heads), range(n)):
            if row.feature == "padding" and i >= keys:
                continue
            seen = [j for j in range(n) if j <= i and j < keys and (row.window_left < 0 or j >= i - row.window_left)]
            if row.feature == "varlen":
                qi, ks, vs = q[first + i, h], k[first:end, h // group][seen], v[first:end, h // group][seen]
            else:
                qi, ks, vs = q[b, h, i], k[b, h // group][seen], v[b, h // group][seen]
            s = ks @ qi * scale
            if row.softcap:
                s = torch.tanh(s / row.softcap) * row.softcap
            w = torch.softmax(s, dim=0) @ vs
            if row.feature == "varlen":
                out[first + i, h] = w
            else:
                out[b, h, i] = w
    return out


def used_rows(row: fb.FeatureRow, out):
    """``out`` with a padded batch's padded query rows zeroed (SDPA computes them)."""
    if row.feature != "padding":
        return out
    keep = torch.arange(row.seq).view(1, row.seq) < torch.tensor(row.lengths).view(row.batch, 1)
    return out * keep.view(row.batch, 1, row.seq, 1)


SMALL_ROWS = [  # each feature at a size the CPU computes by definition in a second
    fb.FeatureRow("window", "window", 2, 4, 2, 40, 16, window_left=7),
    fb.FeatureRow("softcap", "softcap", 2, 4, 2, 24, 16, softcap=1.5),
    fb.FeatureRow("padding", "padding", 3, 4, 2, 32, 16, lengths=(32, 19, 4)),
    fb.FeatureRow("varlen", "varlen", 4, 4, 2, 21, 16, lengths=(1, 17, 6, 21)),
    fb.FeatureRow("plain", "plain", 2, 4, 4, 24, 16),
]


@pytest.mark.parametrize("row", SMALL_ROWS, ids=lambda r: r.name)
def test_the_sdpa_calls_and_the_reference_compute_the_row_on_the_cpu(row) -> None:
    """``sdpa`` is the same computation as the export's call (its mask, the packed sequences one
    by one), checked against the definition; ``sdpa floor`` is not (it drops the window, cap or
    padding); the error's reference is the definition too."""
    sets = fb.feature_inputs(row, torch.float32, 2, device="cpu")
    shared = fb.row_tensors(row, "cpu")
    calls = fb.sdpa_calls(row, sets, shared)
    q, k, v = sets[1]
    exact = naive(row, q, k, v)
    assert float((fb.reference(row, q, k, v, shared).double() - exact).abs().max()) < 1e-5
    assert ("sdpa" in calls) == (row.feature != "softcap") and (fb.FLOOR in calls) == row.floor
    if "sdpa" in calls:
        out = calls["sdpa"](q, k, v)
        assert out.shape == q.shape and float((used_rows(row, out.double()) - exact).abs().max()) < 1e-5
    if row.floor:
        assert float((calls[fb.FLOOR](q, k, v).double() - exact).abs().max()) > 1e-2
    # the calls map each set to its own repeated K/V
    if "sdpa" in calls:
        assert float((used_rows(row, calls["sdpa"](*sets[0]).double()) - naive(row, *sets[0])).abs().max()) < 1e-5


def test_flash_attn_4_keywords_are_checked_against_its_signature() -> None:
    def takes(q, k, v, causal=False, window_size=(None, None)):
        return None

    assert fb.accepts(takes, "window_size") and not fb.accepts(takes, "softcap")
    assert fb.accepts(lambda *a, **kw: None, "softcap")
    row = next(r for r in fb.FEATURE_ROWS if r.feature == "window")
    call, why = fb.fa4_call(row, [], fb.RowTensors())
    if importlib.util.find_spec("flash_attn") is None:
        assert call is None and why == "flash-attn-4 is not installed"


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory):
    """Two exports: the hand-made run's (wmma and mma, fp16 D64 and D128; mma the fallback, with
    every feature) and one of a single wgmma configuration (its kernels with every feature too)."""
    root = tmp_path_factory.mktemp("featbench")
    export_runs([make_run(root / "run")], root / "mixed")
    wgmma = Config({"PATH": "wgmma", "CONSUMER_WGS": 2, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PRODUCER": 1,
                    "REG_PRODUCER": 24, "REG_CONSUMER": 240, "INTRA_WG_OVERLAP": 1, "PINGPONG": 1, "LOAD": "tma"})
    export_runs([make_run(root / "wg-run", {LARGE128: {wgmma: 400.0}}, sdpa={LARGE128: 500.0}, space=space_doc())],
                root / "wgmma")
    return root, load_module(root / "mixed"), load_module(root / "wgmma"), wgmma


def test_the_kernel_serving_each_row_or_one_line_why_none(exports) -> None:
    _, mixed, wgmma_only, wgmma = exports
    window = fb.FeatureRow("B4 H16 S2048 D128 window 255", "window", 4, 16, 16, 2048, 128, window_left=255)
    packed = fb.FeatureRow("varlen D128", "varlen", 2, 16, 16, 900, 128, lengths=(100, 900))
    plain64 = fb.FeatureRow("B4 H16 S2048 D64", "plain", 4, 16, 16, 2048, 64)
    assert fb.serving_kernel(mixed, "fp16", window) == ("", MMA.key())      # the fallback's kernel with every feature
    assert fb.serving_kernel(mixed, "fp16", packed) == ("", MMA.key())
    assert fb.serving_kernel(mixed, "fp16", plain64) == ("", mixed.dispatch("fp16", 64, True, 4, 16, 2048, 2048))
    d256 = next(r for r in fb.FEATURE_ROWS if r.name == "B4 H16/8 S2048 D256")
    assert fb.serving_kernel(mixed, "fp16", d256) == ("no fp16 D256 causal kernel in this export", "")
    assert fb.serving_kernel(mixed, "bf16", window) == ("no bf16 kernels in this export", "")
    assert fb.serving_kernel(wgmma_only, "fp16", window) == ("", wgmma.key())
    assert fb.serving_kernel(wgmma_only, "fp16", packed) == ("", wgmma.key())   # the wgmma kernel with varlen
    lines = fb.list_lines([window, packed, d256], ["fp16"], wgmma_only)
    assert lines[0] == f"B4 H16 S2048 D128 window 255 fp16: {wgmma_only.CONFIGS[wgmma.key()]['short']}"
    assert f"varlen D128 fp16: {wgmma_only.CONFIGS[wgmma.key()]['short']}" in lines
    assert any(line.startswith("B4 H16/8 S2048 D256 fp16: no fp16 D256") for line in lines), lines
    assert all(len(line) <= 80 for line in lines)


def script():
    spec = importlib.util.spec_from_file_location("exported_vs_sdpa", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, error", [
    (["--features", "--decode", "--list"], "--features and --decode: pick one set of rows"),
    (["--features", "--shape", "B4 H16 S2048 D64"], "--shape 'B4 H16 S2048 D64': not one of B1 H32/8 S8192 D128 window"),
    (["--shape", "B4 H32 S2048 D96"], "--shape 'B4 H32 S2048 D96': not one of B1 H8 S512 D64, "),
    (["--features"], "--module: required"),
    (["--features", "--module", "nowhere"], "nowhere: no kernel.json"),
    (["--features", "--list", "--launch-paths"], "--launch-paths: the raw launch calls go with the default rows"),
])
def test_flags_that_do_not_combine_are_one_line_and_exit_2(argv, error, capsys) -> None:
    assert script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {error}") and err.count("\n") == 1


def test_list_prints_the_feature_rows_and_the_kernel_serving_each_without_a_gpu(exports) -> None:
    root = exports[0]
    names = [r.name for r in fb.FEATURE_ROWS]
    mod = script()
    args = mod.parse_args(["--features", "--shape", names[0], "--shape", names[5]])
    assert args.features and mod.check_args(args) == "--module: required (an export directory: evoengineer export "\
                                                      "... --out DIR)"
    done = subprocess.run([sys.executable, str(SCRIPT), "--features", "--list", "--module", str(root / "mixed"),
                           "--dtype", "fp16", "--shape", names[0], "--shape", names[5]], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    # the hand-made export (fp16 only; bf16 is --features' default): the window on mma's kernel
    # with every feature, its fallback's; no D96 kernel
    assert done.stdout.splitlines() == [
        f"{names[0]} fp16: {short_config(MMA.to_dict())}",
        "  sdpa: the window as a boolean mask, K/V repeated to the query heads",
        "  sdpa floor: SDPA's plain causal call (not the same computation)",
        f"{names[5]} fp16: no fp16 D96 causal kernel in this export",
        "  sdpa: is_causal"]


def feature_result(shape: str, sdpa: float | None, floor: float | None, fa4: float | None, err: float = 2e-3) -> dict:
    row = {"shape": shape, "dtype": "bf16", "causal": True, "impl": "evo", "status": "ok", "max_abs_err": err}
    for tag, value in (("sdpa", sdpa), ("floor", floor), ("fa4", fa4)):
        if value is not None:
            row[f"speedup_{tag}_device_us"] = value
    return row


def test_the_feature_summary_counts_rows_against_sdpa_or_its_floor_and_fa4() -> None:
    results = [feature_result("B1 H32/8 S8192 D128 window 4095", 3.2, 0.97, 1.02),
               {"shape": "B1 H32/8 S8192 D128 window 4095", "impl": "sdpa", "status": "ok"},
               feature_result("B4 H16/8 S2048 D256 softcap 50", None, 0.91, None),
               feature_result("varlen 1,17,1000,4099 H32/8 D128", 1.8, None, 0.8)]
    lines = fb.feature_summary_lines(results)
    assert all(len(line) <= 80 for line in lines)
    assert lines[2].split() == ["B1", "H32/8", "S8192", "D128", "window", "4095", "bf16", "3.20", "0.97", "1.02",
                                "2.0e-03"]
    assert lines[3].split()[-4:] == ["-", "0.91", "-", "2.0e-03"]
    assert lines[-2] == "  ×sdpa >= 1.0 (the floor where SDPA has no such call): 2 of 3 rows"
    assert lines[-1] == "  ×fa4 >= 1.0: 1 of 2 rows"
    assert fb.feature_summary_lines([]) == []


def test_a_feature_rows_block_shows_each_ratio_within_80_columns() -> None:
    # ours 10 and 11 µs (eager 13, 14) in two rounds; the floor 9 (12), fa4 8 (60): paired medians
    # 0.86 (9/10, 9/11) and 0.89 eager, fa4 0.76 and 4.45
    ours = calls.combine_rounds("evo", [a_round(t, t + 3, t) for t in (10.0, 11.0)])
    floor = calls.combine_rounds(fb.FLOOR, [a_round(9.0, 12.0, 9.0)] * 2)
    fa4 = calls.combine_rounds("fa4", [a_round(8.0, 60.0, 8.0)] * 2)
    measured = [{**ours, "impl": "evo"}, {**floor, "impl": fb.FLOOR}, {**fa4, "impl": "fa4"}]
    softcap = next(r for r in fb.FEATURE_ROWS if r.feature == "softcap")
    versus = {theirs: calls.speedups(measured, theirs=theirs) for theirs in ("sdpa", fb.FLOOR, "fa4")}
    lines = fb.feature_block("B4 H16/8 S2048 D256 softcap 50 bf16: dtma 128x80 st2", softcap, measured, versus, 2.5e-3)
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "  sdpa: none, SDPA cannot soft-cap" in lines
    assert not any(line.startswith("  ×sdpa") for line in lines)
    assert "  ×floor device 0.86 eager 0.89 (SDPA plain causal: not the same computation)" in lines
    assert lines[-2] == "  ×fa4 device 0.76 eager 4.45" and lines[-1].endswith(": 2.5e-03")
    padded = next(r for r in fb.FEATURE_ROWS if r.feature == "padding")
    assert fb.feature_block("t", padded, measured, {**versus, "fa4": {}}, 1e-3, "flash-attn-4 is not installed")[-2] \
        == "  fa4: none, flash-attn-4 is not installed"


def test_feature_rows_measured_end_to_end_with_torch_in_place_of_the_kernels(exports, monkeypatch) -> None:
    """measure_features over a real export's tables, its calls answered on the CPU by the
    runtime's torch reference (what the kernels compute) and its timing by the Recorder: the
    rows' calls take the right arguments, a row without a kernel is one line, each measured row
    prints its block and gives a result per implementation with the ratios on evo's."""
    from types import SimpleNamespace

    from evoengineer.runtime.features import call_features, reference_attention
    from evoengineer.runtime.varlen import reference_varlen

    mixed = exports[1]
    asked: list[str] = []

    def attention(q, k, v, is_causal=False, enable_gqa=False, window_size=None, softcap=None, seqlens_k=None,
                  seqlens_q=None):
        asked.append(f"attention window={window_size} softcap={softcap} seqlens={seqlens_k is not None} "
                     f"queries={seqlens_q is not None}")
        return reference_attention(q, k, v, is_causal, None, enable_gqa,
                                   call_features(window_size, softcap, seqlens_k, seqlens_q=seqlens_q), seqlens_k,
                                   seqlens_q=seqlens_q)

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        asked.append(f"varlen {cu_q.tolist()} {max_q}")
        return reference_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), is_causal)

    module = SimpleNamespace(**{name: getattr(mixed, name) for name in ("DTYPES", "DISPATCH", "GQA", "KERNELS",
                                                                        "CONFIGS", "dispatch")},
                             attention=attention, attention_varlen=attention_varlen)
    rows = [fb.FeatureRow("window", "window", 1, 4, 2, 48, 128, window_left=9),
            fb.FeatureRow("padding", "padding", 2, 4, 2, 32, 128, lengths=(32, 7)),
            fb.FeatureRow("varlen", "varlen", 3, 4, 2, 20, 128, lengths=(1, 20, 5)),
            fb.FeatureRow("softcap", "softcap", 2, 4, 2, 16, 256, softcap=20.0)]
    class Calling(Recorder):
        """The Recorder's figures; each measurement calls the implementation once on a set."""

        def _record(self, what: str, fn) -> str:
            q = self.sets[len(self.calls) % len(self.sets)][0]
            out = fn(*self.sets[len(self.calls) % len(self.sets)])
            self.calls.append((what, tuple((out[0] if isinstance(out, tuple) else out).shape) == tuple(q.shape)))
            return what

        def heat_up(self, fns, sets, ms) -> int:
            self.sets = sets
            self.calls.append(("heat", len(fns)))
            return 1

    rec = Calling()
    for name in ("heat_up", "device_times", "eager_times", "graph_times"):
        monkeypatch.setattr(calls, name, getattr(rec, name))
    monkeypatch.setattr(calls, "synchronize", lambda: None)
    said: list[str] = []
    results, notes = fb.measure_features(module, rows, ["fp16"], 200, 10, 2, say=said.append, peers=False,
                                         device="cpu", l2_bytes=40_000)
    assert list(dict.fromkeys(asked)) == ["attention window=(9, 0) softcap=None seqlens=False queries=False",
                                          "attention window=None softcap=None seqlens=True queries=True",
                                          "varlen [0, 1, 21, 26] 20"]
    assert notes == ["softcap fp16: no fp16 D256 causal kernel in this export"] and notes[0] in said
    assert [(r["shape"], r["impl"]) for r in results] == [
        ("window", "evo"), ("window", "sdpa"), ("window", fb.FLOOR), ("padding", "evo"), ("padding", "sdpa"),
        ("padding", fb.FLOOR), ("varlen", "evo"), ("varlen", "sdpa")]
    # per row a heat-up of its 3, 3 and 2 implementations, then two rounds of device, eager and
    # graph of each; every call's output has q's shape
    assert [c for c in rec.calls if c[0] == "heat"] == [("heat", 3), ("heat", 3), ("heat", 2)]
    assert len(rec.calls) == 3 + 2 * 3 * (3 + 3 + 2) and all(ok for what, ok in rec.calls if what != "heat")
    evo = [r for r in results if r["impl"] == "evo"]
    assert all(r["max_abs_err"] < 1e-2 and r["status"] == "ok" for r in evo)   # fp16 against fp32
    assert evo[0]["speedup_sdpa_device_us"] == 1.0 and evo[0]["speedup_floor_device_us"] == 1.0
    assert "speedup_floor_device_us" not in evo[2] and evo[2]["lengths"] == [1, 20, 5]
    assert f"window fp16: {short_config(MMA.to_dict())}" in said
    assert all(len(line) <= 80 for line in said), [line for line in said if len(line) > 80]
    assert fb.feature_summary_lines(results)[-2].endswith(": 3 of 3 rows")
