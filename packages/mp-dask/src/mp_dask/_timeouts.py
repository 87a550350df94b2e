"""Time limits on a pool's tasks, kept by the worker that runs them (Note [Dask task timeouts]).

Note [Dask task timeouts]
~~~~~~~~~~~~~~~~~~~~~~~~~
A task of a pool with ``task_timeout`` (or of a call with its own limit:
``apply_async(timeout=)``, ``submit(task_timeout=)``) carries its limit and a
token of its own (one per sending: a task sent again gets a new one). ``run``
starts the clock as the task starts on the worker (a task waiting for a worker
thread uses none of it) and stops it as it ends. A watchdog thread of the
worker process, started with its first limited task, sleeps until the nearest
deadline of the tasks running (woken as one starts), and while none runs until
one does; a task past its limit has the worker log an event on
``TOPIC`` with the tokens of every task past its limit, and, ``FLUSH`` seconds
later (the event reaches the scheduler first), end its own process: SIGTERM,
then SIGKILL ``GRACE`` seconds later (a thread cannot be stopped; the process
can, as the local pool ends a worker). The nanny starts a new worker. From
there it is a lost worker (Note [Lost workers]): every task that ran on it or
held an argument there is lost, and the pool, before it sends a lost task
again, looks for its token in the events (``timed_out``): one found fails the
task with ``TaskTimeoutError``; the others go again, each loss counted toward
Dask's allowed failures. So with several threads per worker, a task timed out
costs the tasks running beside it their progress (the local pool's worker runs
one task, and loses only it). A cluster without nannies does not replace the
ended worker; the pool goes on with the others.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from mp_reductions import GRACE  # seconds between SIGTERM and SIGKILL, as the local pool's

from ._deaths import event

TOPIC = "arraymp-task-timeouts"
FLUSH = 0.25  # seconds between the event and the worker's end

_changed = threading.Condition()  # guards _running and _watchdog; notified as a limited task starts
_running: dict[str, float] = {}  # token -> deadline by time.monotonic
_watchdog: threading.Thread | None = None


class Limited:
    """``with Limited(token, limit):`` around a task run on a worker (limit None: no limit)."""

    def __init__(self, token: str | None, limit: float | None):
        self.token, self.limit = token, limit

    def __enter__(self):
        global _watchdog
        if self.limit is None:
            return self
        from distributed import get_worker

        worker = get_worker()
        with _changed:
            _running[self.token] = time.monotonic() + self.limit
            if _watchdog is None:
                _watchdog = threading.Thread(target=_watch, args=(worker,), name="arraymp-task-timeouts",
                                             daemon=True)
                _watchdog.start()
            _changed.notify()
        return self

    def __exit__(self, *exc):
        if self.limit is not None:
            with _changed:
                _running.pop(self.token, None)


def _watch(worker) -> None:
    with _changed:
        while True:
            now = time.monotonic()
            late = [token for token, deadline in _running.items() if deadline <= now]
            if late:
                break
            nearest = min(_running.values(), default=None)
            _changed.wait(None if nearest is None else nearest - now)
    worker.log_event(TOPIC, {"tokens": late, "pid": os.getpid()})
    time.sleep(FLUSH)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE)
    os.kill(os.getpid(), signal.SIGKILL)


def timed_out(client, token: str | None) -> dict | None:
    """The event of the worker that ended itself for the task of ``token``, or None. Not waited for: it reached the
    scheduler before the worker's end (``FLUSH``), which the loss follows; and a lost task with a limit looks, so
    a wait would delay every task lost beside a timed-out one."""
    if token is None:
        return None
    return event(client, TOPIC, lambda msg: token in msg.get("tokens", ()), 0.0)
