"""The pool's watchdog thread: ends the workers of tasks past their time limit, and keeps what explains a
worker's death (its last resident size, its memory cgroup's OOM count when it started: _deaths Note [deaths
explained]).

Note [task timeouts]
~~~~~~~~~~~~~~~~~~~~
Invariant: a task fails with TaskTimeoutError exactly when the watchdog ended its clock row (clock Note [task
clock]), and then no other task is lost by that ending. The watchdog reads the rows every ``TICK`` seconds
while the pool has a ``task_timeout`` or a call with a ``timeout`` is unfinished (else every ``RSS_INTERVAL``,
to sample memory). A task past its limit, measured from its start as its worker saw it (a worker still
importing, or a task queued behind another, uses none of it), is ended under the slots' lock, with the worker
not reaped (its pid is still its own: the worker handler reaps under the same lock): the row's
compare-and-swap, then SIGTERM, then SIGKILL ``GRACE`` seconds later if it has not died. A worker whose row
was ended exits as soon as the task returns, without its result, so its own SIGTERM handler cannot make it
run on. From there it is a worker loss like any other (slots Note [lost tasks]); only the error differs: the
death record carries ``(job, i, limit)``. The unit is the pool's task: an ``apply`` call, an ``imap`` item at
chunksize 1, a chunk of ``map`` (its items fail together). ``AsyncResult.get``'s ``timeout`` only stops
waiting, as the stdlib's.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from .. import _deaths

GRACE = 0.5  # seconds a timed-out task's worker has between SIGTERM and SIGKILL
TICK = 0.05  # seconds between the watchdog's checks of the running tasks while any has a limit


class Watchdog:
    """Time limits and what explains deaths, for one pool's ``slots`` (Note [task timeouts])."""

    def __init__(self, slots, task_timeout: float | None):
        self.slots = slots
        self.task_timeout = task_timeout  # the pool's limit on a task's seconds
        self.timed: set[int] = set()  # jobs with a limit of their own (apply_async's timeout), unfinished
        self.timed_out: dict[int, tuple] = {}  # pid -> (job, i, limit): ended by the watchdog, death not recorded
        self.ending: dict[int, tuple] = {}  # pid -> (Process, when it was sent SIGTERM): SIGKILL after GRACE
        self.wake = threading.Event()  # set: look now (a call with a limit came) or stop
        self.stopped = False
        self.sampler = _deaths.Sampler()
        self.oom = _deaths.OomCounter()
        self.oom_base: dict[int, tuple] = {}  # pid -> (its cgroup's OomCounter, the count when it started)

    def limit(self, job: int, limit: float | None) -> None:
        """Job ``job`` has a limit of its own: look every TICK from now."""
        if limit is not None:
            self.timed.add(job)
            self.wake.set()

    def run(self) -> None:
        """The thread's body (its failure breaks the pool: core Note [helper threads])."""
        while not self.stopped:
            limited = self.task_timeout is not None or self.timed or self.ending
            self.wake.wait(TICK if limited else _deaths.RSS_INTERVAL)
            self.wake.clear()
            if self.stopped:
                return
            now = time.monotonic()
            if limited:
                self._time_out(time.monotonic_ns())
                self._kill_late(now)
            if self.sampler.due(now):
                self.sampler.sample([w.pid for w in list(self.slots.workers) if w is not None], now)

    def _time_out(self, now_ns: int) -> None:
        """End each task past its limit, as its row says (Note [task clock])."""
        slots, clock = self.slots, self.slots.clock
        for k, w in enumerate(list(slots.workers)):
            if w is None or w.pid in self.timed_out:
                continue
            got = clock.running(k)
            if got is None:
                continue
            state, job, i, t0 = got
            result = slots.cache.get(job)
            limit = getattr(result, "_limit", None) or self.task_timeout
            if limit is None or now_ns - t0 < limit * 1e9:
                continue
            with slots.lock:  # the worker handler reaps under it: the pid is still this worker's
                if slots.workers[k] is not w or w.exitcode is not None or not clock.end(k, state):
                    continue  # dead, or its task returned first
                self.timed_out[w.pid] = (job, i, limit)
                self.ending[w.pid] = (w, time.monotonic())
                _signal(w.pid, signal.SIGTERM)

    def _kill_late(self, now: float) -> None:
        """SIGKILL to each worker sent SIGTERM GRACE seconds ago and not dead yet."""
        for pid, (w, when) in list(self.ending.items()):
            if now - when < GRACE:
                continue
            with self.slots.lock:
                if self.ending.pop(pid, None) is not None and w.exitcode is None:
                    _signal(pid, signal.SIGKILL)

    def done(self, job: int) -> None:
        self.timed.discard(job)

    def started(self, w, oom_base) -> None:
        """Worker ``w`` started, the OOM count having been ``oom_base`` before (_deaths Note [OOM counts])."""
        pid = getattr(w, "pid", None)  # (a Process class of the caller's may have none: the stdlib's suite's)
        if pid is not None:
            counter = self.oom.of(pid)  # its cgroup's: the pool's as a rule
            self.oom_base[pid] = (counter, oom_base if counter is self.oom else counter.read())

    def death(self, w) -> tuple:
        """How worker ``w`` (reaped, the slots' lock held) died: (the task the watchdog ended, whether the OOM
        killer did it, its last resident sample)."""
        self.ending.pop(w.pid, None)
        timed = self.timed_out.pop(w.pid, None)
        counter, base = self.oom_base.pop(w.pid, (self.oom, None))
        oom = counter.claim(base) if w.exitcode == -signal.SIGKILL and timed is None else None
        return timed, oom, self.sampler.forget(w.pid)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
