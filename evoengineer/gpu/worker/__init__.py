"""Crash-isolating evaluation workers: one child process per GPU, supervised by the parent.

Evaluating a CUDA kernel can hit an illegal memory access (which poisons the CUDA
context of its process for good), a launch failure, an endless loop or a segfault.
Each of these must cost one candidate, never the search. So every evaluation runs
in a child process (``multiprocessing`` *spawn* context) bound to one GPU, and the
parent turns whatever happens to it into a :class:`WorkerOutcome`:

* ``ok``: the handler returned; ``value`` holds its (picklable) return value.
* ``crashed``: the handler raised, or the child died (signal, ``os._exit``,
  abort), or its answer could not be pickled. ``message`` says how, followed by
  the tail of the child's stderr (fd 2 of the child goes to a temp file, so
  messages written by native code and ``faulthandler`` tracebacks are kept).
* ``timeout``: no answer within the time limit; the child is dumped
  (``faulthandler`` on SIGUSR1), sent SIGTERM, then SIGKILL after a short grace.

After anything but ``ok`` the child is replaced, since its state is suspect. An
``ok`` value carrying a truthy ``worker_must_restart`` attribute or mapping key
(for instance a sticky CUDA error was seen) is delivered, and the child is
replaced before the next job.

Handlers are named ``"package.module:function"`` (``"module:Class.method"`` also
works) and imported by the child itself. The child starts with the parent's
``sys.path`` and working directory as they are when it starts (the spawn context
copies both), so any module importable in the parent at that time is importable
in the child; put a directory on ``sys.path`` (or ``PYTHONPATH``) before the
worker starts to make handlers living there reachable. As with any spawn-based
``multiprocessing``, a script that starts workers must guard its entry point with
``if __name__ == "__main__":``.

``device`` binds the child to one GPU: ``CUDA_VISIBLE_DEVICES`` is in the
environment the child's interpreter is started with (the parent sets it around
the spawn, under a lock, and restores its own environment right after), so it is
in place before the child imports anything; the child sets it again on entry.
"""
from __future__ import annotations

from .pool import WorkerPool
from .protocol import WorkerOutcome, resolve_callable
from .supervisor import Worker

__all__ = ["Worker", "WorkerOutcome", "WorkerPool", "resolve_callable"]
