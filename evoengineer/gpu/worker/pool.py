"""Several workers, one per GPU: run a job on whichever is free, or map jobs over all."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from .protocol import WorkerOutcome
from .supervisor import Worker


@dataclass
class _MapState:
    """Shared state of one `WorkerPool.map_unordered` call."""

    jobs: Iterator[Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: "queue.Queue[tuple[str, Any, Any]]" = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)


class WorkerPool:
    """One Worker per device; `run(job, timeout_s)` uses a free worker (thread-safe), `map_unordered(jobs, timeout_s)` yields (job, outcome) as they finish."""

    def __init__(
        self,
        handler: str,
        devices: Sequence[int | None],
        *,
        init: str | None = None,
        init_args: tuple = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
        kill_grace_s: float = 1.0,
    ) -> None:
        if not devices:
            raise ValueError("a WorkerPool needs at least one device")
        self.workers: list[Worker] = [
            Worker(
                handler,
                device=d,
                init=init,
                init_args=init_args,
                env=env,
                start_timeout_s=start_timeout_s,
                kill_grace_s=kill_grace_s,
            )
            for d in devices
        ]
        self._idle: "queue.Queue[Worker]" = queue.Queue()
        for w in self.workers:
            self._idle.put(w)
        self._closed = False

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def restarts(self) -> int:
        """Child replacements over all workers."""
        return sum(w.restarts for w in self.workers)

    def start(self) -> None:
        """Spawn every worker's child now, so their inits overlap."""
        for w in self.workers:
            w.start()

    def run(self, job: Any, timeout_s: float) -> WorkerOutcome:
        """Run one job on the first free worker (blocks while all are busy)."""
        worker = self._acquire()
        try:
            return worker.run(job, timeout_s)
        finally:
            self._idle.put(worker)

    def map_unordered(self, jobs: Iterable[Any], timeout_s: float) -> Iterator[tuple[Any, WorkerOutcome]]:
        """Yield (job, outcome) pairs in completion order, keeping every worker busy."""
        state = _MapState(jobs=iter(jobs))
        threads = [
            threading.Thread(target=self._feed, args=(state, timeout_s), daemon=True, name=f"evoengineer-pool-{i}")
            for i in range(len(self.workers))
        ]
        for t in threads:
            t.start()
        done = 0
        try:
            while done < len(threads):
                kind, a, b = state.out.get()
                if kind == "done":
                    done += 1
                elif kind == "exc":
                    raise a
                else:
                    yield a, b
        finally:
            state.stop.set()

    def _feed(self, state: _MapState, timeout_s: float) -> None:
        try:
            while not state.stop.is_set():
                with state.lock:
                    try:
                        job = next(state.jobs)
                    except StopIteration:
                        return
                outcome = self.run(job, timeout_s)
                state.out.put(("item", job, outcome))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            state.stop.set()
            state.out.put(("exc", exc, None))
        finally:
            state.out.put(("done", None, None))

    def _acquire(self) -> Worker:
        while True:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            try:
                return self._idle.get(timeout=0.1)
            except queue.Empty:
                continue

    def close(self) -> None:
        """Close every worker; idempotent."""
        self._closed = True
        for w in self.workers:
            w.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
