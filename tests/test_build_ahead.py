"""The search's compiles ahead of the devices: the strategy's opening built while the search
starts, and lanes that take the first built candidate rather than wait behind a slow build."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from evoengineer.kernels import build_config
from evoengineer.search.loop import AheadBuilds, _Build, _Candidate, _Ready, build_ahead, compile_pool
from evoengineer.search.strategies import SAMPLERS
from evoengineer.space import load_space


def _candidate(name: str, futures: int = 2) -> _Candidate:
    space = load_space("l4")
    config = space.search.seeds[0]
    return _Candidate(trial=name, config=config, future=_Build(config, "sm_89", tuple(Future() for _ in range(futures))),  # type: ignore[arg-type]
                      slot=0, strategy_s=0.0)


def _finish(candidate: _Candidate) -> None:
    for f in candidate.future.futures:  # type: ignore[union-attr]
        f.set_result(None)


def test_a_lane_takes_the_first_built_candidate_not_the_first_asked() -> None:
    ready = _Ready()
    slow, fast = _candidate("slow"), _candidate("fast")
    ready.put(slow)
    ready.put(fast)
    _finish(fast)
    taken, idle, building = ready.get()
    assert taken is fast and idle == 0.0 and building == 0.0
    threading.Timer(0.2, _finish, args=(slow,)).start()
    taken, idle, building = ready.get()
    assert taken is slow
    assert idle == 0.0 and building >= 0.15  # waited for its build, not for a candidate


def test_a_half_built_candidate_waits_for_all_its_variants() -> None:
    ready = _Ready()
    candidate = _candidate("c")
    ready.put(candidate)
    candidate.future.futures[0].set_result(None)  # type: ignore[union-attr]
    got: list = []
    thread = threading.Thread(target=lambda: got.append(ready.get()))
    thread.start()
    time.sleep(0.2)
    assert not got
    candidate.future.futures[1].set_result(None)  # type: ignore[union-attr]
    thread.join(timeout=5)
    assert got and got[0][0] is candidate


def test_with_nothing_asked_a_lane_waits_idle_and_stops_on_none() -> None:
    ready = _Ready()
    threading.Timer(0.2, ready.put, args=(None,)).start()
    taken, idle, building = ready.get()
    assert taken is None and idle >= 0.15 and building == 0.0


def test_the_opening_is_evos_seeds_and_no_other_strategys() -> None:
    space = load_space("h100")
    assert SAMPLERS["evo"].opening(space) == tuple(space.search.seeds)
    assert len(SAMPLERS["evo"].opening(space)) > 10
    for name in set(SAMPLERS) - {"evo"}:
        assert SAMPLERS[name].opening(space) == ()


def test_built_ahead_the_searchs_own_build_is_a_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINEER_CACHE_DIR", str(tmp_path / "cache"))  # the pool's processes inherit it
    space = load_space("l4")
    config = next(c for c in space.search.seeds if c["PATH"] == "scalar")
    arch = space.target.arch
    pool = compile_pool(1)
    try:
        futures = build_ahead(pool, space, [config], arch)
        assert len(futures) == len(space.variants)
        reports = [f.result(timeout=300) for f in futures]
    finally:
        pool.shutdown(wait=True)
    assert all(b.ok and not b.compiled.cached for r in reports for b in r.builds)
    again = build_config(space.template, config, space.variants, arch, space.target.smem_per_block)
    assert [b.variant for b in again.builds] == list(space.variants)
    assert all(b.ok and b.compiled.cached for b in again.builds)



def test_an_ask_reuses_a_build_under_way_and_the_loops_start_cancels_those_not_begun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINEER_CACHE_DIR", str(tmp_path / "cache"))
    space = load_space("l4")
    configs = list(dict.fromkeys(space.search.seeds))[:6]
    arch = space.target.arch
    ahead = AheadBuilds()
    pool = compile_pool(1)
    try:
        opening = build_ahead(pool, space, configs, arch, ahead, keep=True)
        assert len(opening) == len(configs) * len(space.variants)
        first = opening[0]
        first.result(timeout=300)  # one process: the rest wait behind it
        cancelled = ahead.start()
        assert cancelled >= len(opening) - 4  # the pool hands a few more to its process's queue
        assert sum(f.cancelled() for f in opening) == cancelled
        asked = build_ahead(pool, space, configs[:1], arch, ahead)
        assert asked[0] is first  # built ahead: reused, not compiled again
        last = build_ahead(pool, space, configs[-1:], arch, ahead)
        assert all(f not in opening for f in last)  # cancelled ahead: submitted anew, in the ask's order
        assert all(b.ok for f in last for b in f.result(timeout=300).builds)
        assert build_ahead(pool, space, configs[:1], arch, ahead)[0] is not first  # each build is taken once
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
