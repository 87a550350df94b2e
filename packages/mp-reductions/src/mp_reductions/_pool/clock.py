"""The task each pool worker is running, and since when, in shared memory: what the watchdog reads to end a task
past its time limit (watchdog Note [task timeouts]).

Note [task clock]
~~~~~~~~~~~~~~~~~
Invariant: a worker's result is sent only if the worker, not the watchdog, ended its task's row; a row the
watchdog ended is never ended by the worker, which then exits without sending the result or taking another
task. One row per slot, four int64 words in a memfd mapped by the parent and its workers (no name: nothing to
leak): the state, the job, the index, the start (``time.monotonic_ns``, one clock for every process of the
machine). The state is ``generation << 2 | phase``, phase 0 idle, 1 being written, 2 running, 3 ended by the
watchdog. The worker alone moves a row from 0 to 1 to 2 (a new generation each task); from 2 both race, each
with one compare-and-swap on the state word: the worker's to 0 as its task returns, the watchdog's to 3 when the
task is past its limit. Exactly one wins. The watchdog signals the worker only if it won, so a task whose
worker won (its result on its way) is never timed out, and one the watchdog won is, even if its own SIGTERM
handler returned or raised: no later task of that worker is hit by the signal meant for this one (the first
version let such a worker take its next task and killed it half a second later). The parent resets a dead
worker's row before its replacement starts (nothing else writes it then).
"""

from __future__ import annotations

import os
import time
from multiprocessing import reduction

import shm_core

IDLE, WRITING, RUNNING, ENDED = 0, 1, 2, 3
_ROW = 32  # bytes per row: state, job, index, start


class Clock:
    """The rows of a pool's slots (Note [task clock]), mapped by the parent."""

    def __init__(self, slots: int):
        self.size = max(1, slots) * _ROW
        self.fd = os.memfd_create("mp-pool-clock", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = shm_core.Mapping(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise

    def reset(self, k: int) -> None:
        """Slot ``k`` idle: its worker is dead, or not started (a dead one may have left it in any phase)."""
        b = k * _ROW
        self.map.store(b, ((self.map.load(b) >> 2) + 1) << 2 | IDLE)

    def running(self, k: int) -> tuple | None:
        """(state, job, index, start) of slot ``k``'s task while it runs, else None."""
        m, b = self.map, k * _ROW
        state = m.load(b)
        if state & 3 != RUNNING:
            return None
        job, i, t0 = m.load(b + 8), m.load(b + 16), m.load(b + 24)
        return (state, job, i, t0) if m.load(b) == state else None

    def end(self, k: int, state: int) -> bool:
        """End slot ``k``'s task if it is still the one of ``state`` (Note [task clock]): whether the watchdog won."""
        return self.map.compare_exchange(k * _ROW, state, state | ENDED)[0]

    def row(self, k: int) -> Row:
        return Row(self, k)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Row:
    """A worker's row: passed to it as is under fork, by a duplicate of the memfd otherwise."""

    def __init__(self, clock, k: int):
        self.map, self.base = clock.map, k * _ROW
        self.fd, self.size = getattr(clock, "fd", -1), getattr(clock, "size", 0)
        self.state = 0

    def __reduce__(self):
        return _rebuild_row, (reduction.DupFd(self.fd), self.size, self.base // _ROW)

    def start(self, job: int, i: int) -> None:
        """The worker starts task (job, i) (the parent reset the row before it started this worker)."""
        m, b = self.map, self.base
        gen = (m.load(b) >> 2) + 1
        m.store(b, gen << 2 | WRITING)
        m.store(b + 8, job)
        m.store(b + 16, i)
        m.store(b + 24, time.monotonic_ns())
        self.state = gen << 2 | RUNNING
        m.store(b, self.state)

    def finish(self) -> bool:
        """The task returned: whether its result may go (False: the watchdog ended it, Note [task clock])."""
        return self.map.compare_exchange(self.base, self.state, self.state & ~3)[0]


class _Mapped:
    def __init__(self, fd: int, size: int):
        try:
            self.map = shm_core.Mapping(fd, size)
        finally:
            os.close(fd)


def _rebuild_row(dupfd, size: int, k: int) -> Row:
    return Row(_Mapped(dupfd.detach(), size), k)
