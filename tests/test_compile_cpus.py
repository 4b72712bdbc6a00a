"""The cores a search keeps for its GPU workers and own threads, and the compile processes
kept off them."""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
import multiprocessing

import pytest

from evoengineer.search.cpus import compile_cpus, compile_plan, parse_cpu_list, physical_cores
from evoengineer.search.loop import _compile_process_init


def _two_threads_a_core(cores: int):
    """A host of ``cores`` physical cores, CPU n and n + cores their two hyper-threads."""
    return lambda cpu: {cpu % cores, cpu % cores + cores}


def test_cpu_lists_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0,32\n") == {0, 32}
    assert parse_cpu_list("0-3,8-9") == {0, 1, 2, 3, 8, 9}
    assert parse_cpu_list("5") == {5}


def test_hyper_threads_group_into_their_physical_core() -> None:
    cores = physical_cores(range(8), _two_threads_a_core(4))
    assert cores == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # a sibling outside the allowed CPUs is not listed
    assert physical_cores([0, 1, 4], _two_threads_a_core(4)) == [(0, 4), (1,)]


def test_four_gpus_keep_five_whole_cores_of_a_large_host() -> None:
    cpus = compile_cpus([0, 1, 2, 3], range(64), _two_threads_a_core(32))
    kept = set(range(64)) - cpus
    assert kept == {c for core in range(5) for c in (core, core + 32)}  # both threads of cores 0-4: a GPU each, the search


def test_a_second_search_on_the_upper_gpus_keeps_their_cores_too() -> None:
    # two searches of two GPUs on one host: the one on GPUs 2, 3 keeps off the cores of both
    assert set(range(64)) - compile_cpus([2, 3], range(64), _two_threads_a_core(32)) == \
        {c for core in range(5) for c in (core, core + 32)}
    assert set(range(64)) - compile_cpus([0, 1], range(64), _two_threads_a_core(32)) == \
        {c for core in range(3) for c in (core, core + 32)}


def test_keeping_no_cores_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINEER_KEEP_CORES", "0")
    assert compile_cpus([0, 1, 2, 3], range(64), _two_threads_a_core(32)) == set(range(64))


def test_keeping_as_many_cores_as_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOENGINEER_KEEP_CORES", "10")
    kept = set(range(64)) - compile_cpus([0, 1, 2, 3], range(64), _two_threads_a_core(32))
    assert kept == {c for core in range(10) for c in (core, core + 32)}
    assert compile_plan([0, 1, 2, 3], range(1000, 1064))[1] == 54  # one thread a core: 64 - 10
    monkeypatch.setenv("EVOENGINEER_KEEP_CORES", "40")  # more than half the cores: none kept
    assert compile_cpus([0, 1, 2, 3], range(64), _two_threads_a_core(32)) == set(range(64))
    monkeypatch.setenv("EVOENGINEER_KEEP_CORES", "many")  # not a number: the default
    assert len(set(range(64)) - compile_cpus([0, 1, 2, 3], range(64), _two_threads_a_core(32))) == 10


def test_a_small_host_keeps_nothing() -> None:
    assert compile_cpus([0], range(2), lambda cpu: {cpu}) == {0, 1}
    assert compile_cpus([0, 1, 2, 3], range(16), _two_threads_a_core(8)) == set(range(16))  # 8 cores < 2 * 5
    assert compile_cpus([0], range(16), _two_threads_a_core(8)) == set(range(16)) - {0, 8, 1, 9}


def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_a_compile_process_runs_on_its_cpus_only() -> None:
    mine = sorted(os.sched_getaffinity(0))
    one = {mine[-1]}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_compile_process_init,
                             initargs=(one,)) as pool:
        assert pool.submit(_affinity).result(timeout=60) == sorted(one)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_compile_process_init) as pool:
        assert pool.submit(_affinity).result(timeout=60) == mine  # none given: every CPU this process has


def test_the_pool_takes_one_process_a_cpu_left_or_all_but_one_where_none_is_kept() -> None:
    host = range(1000, 1064)  # no such CPUs in sysfs: one thread a core
    cpus, workers = compile_plan([0, 1, 2, 3], host)
    assert cpus == set(range(1005, 1064)) and workers == 59
    assert compile_plan([0], range(1000, 1002)) == (None, 1)
