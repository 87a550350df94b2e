"""The receive-side import cache: one open per (device, allocation) per process.

CUDA refuses to open the same memory handle twice in one context, so every
array received over one block must share one mapping. The cache holds the
mapping weakly; each array holds it strongly (as the owner of its
``UnownedMemory``). When the last array dies, the mapping's finalizer closes
the handle and runs its release callbacks (which drop this process's counts in
the producer's registry). The opener and closer are plain functions, so the
logic is tested without a device.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable


class Mapping:
    """One opened allocation in this process: ``ptr`` is its base address."""

    def __init__(self, key: Hashable, ptr: int, size: int):
        self.key, self.ptr, self.size = key, ptr, size
        self.holds: set = set()  # what this process holds through the mapping (registry slots)
        self.info: dict = {}  # things to keep with the mapping (e.g. the handle, opened events)

    def __repr__(self) -> str:
        return f"<shm_cuda Mapping ptr={self.ptr:#x} size={self.size}>"


def _finalize(closer, ptr, callbacks, pid):
    if os.getpid() != pid:  # a forked child inherited the object, not the mapping's ownership
        return
    try:
        closer(ptr)
    finally:
        for cb in callbacks:
            cb()


class ImportCache:
    """``get(key, size)`` returns the live Mapping for ``key``, opening it at most once while it lives."""

    def __init__(self, opener: Callable[[Hashable], int], closer: Callable[[int], None]):
        self.opener, self.closer = opener, closer
        self._live: dict[Hashable, weakref.ref] = {}
        self.lock = threading.Lock()
        self.opens = self.closes = 0
        weakref_self = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (c := weakref_self()) and c._after_fork())

    def _after_fork(self) -> None:
        self.lock = threading.Lock()
        self._live.clear()

    def lookup(self, key: Hashable) -> Mapping | None:
        with self.lock:
            ref = self._live.get(key)
            return ref() if ref is not None else None

    def get(self, key: Hashable, size: int) -> tuple[Mapping, bool]:
        """(mapping, opened_now)."""
        with self.lock:
            ref = self._live.get(key)
            m = ref() if ref is not None else None
            if m is not None:
                return m, False
            ptr = self.opener(key)
            self.opens += 1
            m = Mapping(key, ptr, size)
            callbacks: list = []
            m.on_close = callbacks
            weakref.finalize(m, _finalize, self._closed, ptr, callbacks, os.getpid())
            self._live[key] = weakref.ref(m, lambda r, key=key: self._forget(key, r))
            return m, True

    def _closed(self, ptr: int) -> None:
        self.closes += 1
        self.closer(ptr)

    def _forget(self, key, r) -> None:
        # runs when the mapping dies; a new mapping for the key may already be there
        if self._live.get(key) is r:
            del self._live[key]

    def __len__(self) -> int:
        with self.lock:
            return sum(1 for r in self._live.values() if r() is not None)
