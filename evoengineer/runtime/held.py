"""Results computed from tensors, held while those tensors live and nobody wrote them.

A model's layers call attention with the same mask or the same sequence offsets: what is read
from them (a copy to the host, which waits for the GPU) is read once. A result is held while
every tensor it was computed from lives and torch's version counter says none was written
since. Inference tensors keep no version counter: their results are computed on every call.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")


class HeldResults:
    """The last ``size`` results of ``get``, each keyed by the tensors it was computed from and a
    stamp of whatever else it depends on (shapes, lengths)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[tuple[int, ...], tuple[tuple[Any, ...], tuple, Any]] = {}
        self._lock = threading.Lock()

    def get(self, tensors: Sequence[Any], stamp: tuple[Hashable, ...], compute: Callable[[], T]) -> T:
        """``compute()``, or its result for these tensors and ``stamp`` while it holds; an
        exception from ``compute`` is raised and nothing is held."""
        if any(t.is_inference() for t in tensors):
            return compute()
        key = tuple(id(t) for t in tensors)
        stamp = (*(t._version for t in tensors), *stamp)
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors)) and entry[1] == stamp:
            return entry[2]
        result = compute()
        with self._lock:
            self._entries.pop(key, None)
            while len(self._entries) >= self.size:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = (tuple(weakref.ref(t) for t in tensors), stamp, result)
        return result
