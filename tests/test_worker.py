"""Crash-isolating workers: real child processes on the CPU, no mocks.

The handlers live in ``tests/worker_handlers.py``. Children start with the
parent's ``sys.path``, so this directory is put on it here (whatever pytest's
import mode) before any worker starts.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evoengineer.gpu import Worker, WorkerOutcome, WorkerPool  # noqa: E402

H = "worker_handlers:dispatch"


def _gone(pid: int | None) -> bool:
    """True once `pid` no longer exists (reaped, not a zombie)."""
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def worker():
    w = Worker(H)
    yield w
    w.close()


def test_ok_job(worker: Worker) -> None:
    out = worker.run({"do": "ok", "value": 7}, timeout_s=10)
    assert isinstance(out, WorkerOutcome)
    assert out.status == "ok" and out.ok
    assert out.value["value"] == 7
    assert out.value["pid"] == out.pid == worker.pid != os.getpid()
    assert out.elapsed_s >= 0
    assert worker.restarts == 0


def test_plain_function_handler() -> None:
    with Worker("worker_handlers:square") as w:
        assert [w.run(i, 10).value for i in range(4)] == [0, 1, 4, 9]
        assert w.restarts == 0


def test_handler_raises_then_next_job_ok(worker: Worker) -> None:
    out = worker.run({"do": "raise", "value": 42}, timeout_s=10)
    assert out.status == "crashed"
    assert "ValueError" in out.message and "bad candidate 42" in out.message
    assert "worker_handlers.py" in out.message  # traceback tail
    assert worker.restarts == 1
    nxt = worker.run({"do": "ok", "value": 1}, timeout_s=10)
    assert nxt.status == "ok" and nxt.value["value"] == 1
    assert nxt.pid != out.pid


def test_abort_reports_sigabrt(worker: Worker) -> None:
    out = worker.run({"do": "abort"}, timeout_s=10)
    assert out.status == "crashed"
    assert "SIGABRT" in out.message
    assert _gone(out.pid)
    assert worker.run({"do": "ok"}, 10).ok


def test_real_segfault_reports_sigsegv(worker: Worker) -> None:
    out = worker.run({"do": "segfault"}, timeout_s=10)
    assert out.status == "crashed"
    assert "killed by SIGSEGV" in out.message
    assert "Segmentation fault" in out.message  # faulthandler's report, from the child's stderr
    assert out.elapsed_s < 5  # noticed at once, not at the timeout
    assert worker.run({"do": "ok"}, 10).ok


def test_os_exit_reports_exit_code(worker: Worker) -> None:
    out = worker.run({"do": "exit", "code": 3}, timeout_s=10)
    assert out.status == "crashed"
    assert "exit code 3" in out.message or "code 3" in out.message
    assert worker.restarts == 1


def test_hang_times_out_and_child_is_killed(worker: Worker) -> None:
    assert worker.run({"do": "ok"}, 10).ok  # started and warm
    t0 = time.monotonic()
    out = worker.run({"do": "hang"}, timeout_s=1.0)
    wall = time.monotonic() - t0
    assert out.status == "timeout"
    assert out.message.startswith("no answer within 1 s")
    assert 1.0 <= out.elapsed_s < 1.5
    assert wall < 1.0 + 1.5
    assert "worker_handlers.py" in out.message  # where it hung, dumped before the kill
    assert _gone(out.pid)
    nxt = worker.run({"do": "ok", "value": 2}, timeout_s=10)
    assert nxt.ok and nxt.value["value"] == 2 and nxt.pid != out.pid


def test_stderr_tail_in_message(worker: Worker) -> None:
    out = worker.run({"do": "stderr_abort", "line": "cuda error: marker-1234"}, timeout_s=10)
    assert out.status == "crashed"
    assert "SIGABRT" in out.message
    assert "cuda error: marker-1234" in out.message


def test_unpicklable_answer_is_crashed(worker: Worker) -> None:
    out = worker.run({"do": "unpicklable"}, timeout_s=10)
    assert out.status == "crashed"
    assert "could not be pickled" in out.message
    assert worker.run({"do": "ok"}, 10).ok


def test_worker_must_restart(worker: Worker) -> None:
    first = worker.run({"do": "must_restart"}, timeout_s=10)
    assert first.status == "ok" and first.value["worker_must_restart"] is True
    assert worker.restarts == 1
    assert _gone(first.value["pid"])
    second = worker.run({"do": "ok"}, timeout_s=10)
    assert second.ok and second.value["pid"] != first.value["pid"]
    assert worker.restarts == 1


def test_a_batch_is_answered_in_order_by_one_child(worker: Worker) -> None:
    out = worker.run_many([{"do": "ok", "value": i} for i in range(3)], timeout_s=10)
    assert [o.value["value"] for o in out] == [0, 1, 2]
    assert len({o.pid for o in out}) == 1 and worker.run({"do": "ok"}, 10).pid == out[0].pid


def test_a_batch_ends_at_the_first_answer_whose_status_is_not_ok(worker: Worker) -> None:
    out = worker.run_many([{"do": "ok"}, {"do": "status", "status": "incorrect"}, {"do": "ok", "value": 9}], 10)
    assert [o.value.get("status") for o in out] == [None, "incorrect"]  # the third never ran
    nxt = worker.run({"do": "ok", "value": 1}, 10)  # the child answers the next job, not the third
    assert nxt.value["value"] == 1 and nxt.pid == out[0].pid and worker.restarts == 0


def test_each_job_of_a_batch_has_its_own_timeout(worker: Worker) -> None:
    assert worker.run({"do": "ok"}, 10).ok  # started and warm
    out = worker.run_many([{"do": "sleep", "s": 0.6}] * 3, timeout_s=1.0)  # 1.8 s in all
    assert [o.status for o in out] == ["ok"] * 3
    out = worker.run_many([{"do": "sleep", "s": 0.1}, {"do": "hang"}, {"do": "ok"}], timeout_s=1.0)
    assert [o.status for o in out] == ["ok", "timeout"] and 1.0 <= out[1].elapsed_s < 1.5
    assert _gone(out[1].pid) and worker.run({"do": "ok"}, 10).ok


def test_a_crash_in_a_batch_keeps_the_answers_before_it(worker: Worker) -> None:
    out = worker.run_many([{"do": "ok", "value": 1}, {"do": "segfault"}, {"do": "ok"}], timeout_s=10)
    assert [o.status for o in out] == ["ok", "crashed"] and "SIGSEGV" in out[1].message
    assert out[0].value["value"] == 1
    nxt = worker.run({"do": "ok"}, 10)
    assert nxt.ok and nxt.pid != out[0].pid


def test_a_batch_ends_where_a_job_asks_for_a_fresh_child(worker: Worker) -> None:
    out = worker.run_many([{"do": "must_restart"}, {"do": "ok"}], timeout_s=10)
    assert len(out) == 1 and worker.restarts == 1 and _gone(out[0].value["pid"])
    assert worker.run({"do": "ok"}, 10).ok and worker.restarts == 1


def test_device_sets_cuda_visible_devices_before_start() -> None:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with Worker(H, device=3, env={"EVO_TEST_EXTRA": "x"}) as w:
        out = w.run({"do": "env"}, timeout_s=10)
    assert out.ok
    assert out.value == {"now": "3", "at_start": "3", "extra": "x"}
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the parent's is untouched


def test_no_device_leaves_cuda_visible_devices_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with Worker(H) as w:
        out = w.run({"do": "env"}, timeout_s=10)
    assert out.ok and out.value["now"] is None and out.value["at_start"] is None


def test_init_runs_once_in_child() -> None:
    with Worker(H, init="worker_handlers:init_state", init_args=("warm", 2)) as w:
        assert w.run({"do": "state"}, 10).value == ("warm", 2)


def test_failing_init_reported_on_first_run() -> None:
    with Worker(H, init="worker_handlers:init_fails") as w:
        out = w.run({"do": "ok"}, timeout_s=10)
        assert out.status == "crashed"
        assert "init" in out.message and "warm-up failed on purpose" in out.message


def test_unknown_handler_is_crashed() -> None:
    with Worker("worker_handlers:no_such_function") as w:
        out = w.run(1, timeout_s=10)
        assert out.status == "crashed" and "no_such_function" in out.message


def test_close_is_idempotent_and_reaps(worker: Worker) -> None:
    out = worker.run({"do": "ok"}, 10)
    pid = out.pid
    worker.close()
    worker.close()
    assert _gone(pid)
    assert worker.pid is None
    with pytest.raises(RuntimeError):
        worker.run({"do": "ok"}, 10)


def test_close_while_job_in_flight_kills_child() -> None:
    w = Worker(H)
    assert w.run({"do": "ok"}, 10).ok
    pid = w.pid
    result: list[WorkerOutcome] = []
    t = threading.Thread(target=lambda: result.append(w.run({"do": "hang"}, timeout_s=30)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    w.close()
    t.join(timeout=5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert result and result[0].status == "crashed"
    assert _gone(pid)


def test_pool_runs_jobs_concurrently() -> None:
    with WorkerPool(H, devices=[None, None]) as pool:
        pool.start()
        # Warm both children so the timing below measures the jobs only.
        warm = list(pool.map_unordered([{"do": "ok"}, {"do": "ok"}], timeout_s=10))
        assert all(o.ok for _, o in warm)
        t0 = time.monotonic()
        results = list(pool.map_unordered([{"do": "sleep", "s": 1.0}] * 2, timeout_s=10))
        wall = time.monotonic() - t0
        assert wall < 1.8
        assert len(results) == 2 and all(o.ok for _, o in results)
        assert len({o.pid for _, o in results}) == 2
        pids = [w.pid for w in pool.workers]
    assert all(_gone(p) for p in pids)


def test_pool_survives_crashes_and_thread_safe_run() -> None:
    jobs = [{"do": "ok", "value": i} for i in range(6)] + [{"do": "segfault"}, {"do": "hang"}]
    with WorkerPool(H, devices=[0, 1]) as pool:
        results = list(pool.map_unordered(jobs, timeout_s=1.0))
        assert len(results) == len(jobs)
        by_kind: dict[str, list[str]] = {}
        for job, out in results:
            by_kind.setdefault(job["do"], []).append(out.status)
        assert by_kind["ok"] == ["ok"] * 6
        assert by_kind["segfault"] == ["crashed"] and by_kind["hang"] == ["timeout"]
        assert pool.restarts == 2
        # run() from several threads at once shares the two workers safely.
        outs: list[WorkerOutcome] = []
        threads = [threading.Thread(target=lambda: outs.append(pool.run({"do": "env"}, 10))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outs) == 4 and {o.value["now"] for o in outs} <= {"0", "1"}
        pids = [w.pid for w in pool.workers]
    assert all(p is None or _gone(p) for p in pids)


def test_evaluators_of_one_search_race_against_each_others_best(space_yaml: Path) -> None:
    """With several GPUs each lane's timing stops early against the best time of every lane
    (one racing table), as with one GPU; a lone evaluator keeps its own."""
    from evoengineer.gpu import Evaluator
    from evoengineer.space import load_space

    space = load_space(space_yaml)
    first, second = space.sample(2)
    shared: dict[str, float] = {}
    lanes = [Evaluator(space, arch="sm_90", worker=Worker("worker_handlers:fake_gpu"), best_case_us=shared) for _ in range(2)]
    alone = Evaluator(space, arch="sm_90", worker=Worker("worker_handlers:fake_gpu"))
    try:
        assert lanes[0].evaluate(first).ok
        raced = lanes[1].evaluate(second)
        solo = alone.evaluate(second)
    finally:
        for ev in (*lanes, alone):
            ev.close()
    race = space.timing.race
    assert race > 0 and raced.ok and solo.ok
    assert [c["time"]["give_up_above_us"] for c in raced.cases if "time" in c] == [pytest.approx(100.0 * race)] * len(space.cases)
    assert [c["time"]["give_up_above_us"] for c in solo.cases if "time" in c] == [None] * len(space.cases)


def test_an_evaluation_is_one_round_trip_and_stops_at_a_failed_gate(space_yaml: Path) -> None:
    """Every variant's gate and every case's timing go to the worker at once; a gate that fails
    ends them there (no case is timed)."""
    from evoengineer.gpu import Evaluator
    from evoengineer.space import load_space

    space = load_space(space_yaml)
    config = space.sample(1)[0]
    ev = Evaluator(space, arch="sm_90", worker=Worker("worker_handlers:fake_gpu"))
    failing = Evaluator(space, arch="sm_90", worker=Worker("worker_handlers:fake_gpu", env={"EVO_TEST_FAIL_GATE": "1"}))
    try:
        ev.info()  # the worker started
        batches: list[int] = []
        run_many = ev.worker.run_many
        ev.worker.run_many = lambda jobs, timeout_s: (batches.append(len(jobs)), run_many(jobs, timeout_s))[1]  # type: ignore[method-assign]
        assert ev.evaluate(config).ok
        assert batches == [len(space.variants) + len(space.cases)]
        assert ev._run({"kind": "jobs_run"}, 10) == {"status": "ok", "gate": len(space.variants), "time": len(space.cases)}
        result = failing.evaluate(config)
        assert result.status == "incorrect"
        assert failing._run({"kind": "jobs_run"}, 10) == {"status": "ok", "gate": 1}
    finally:
        ev.close()
        failing.close()
