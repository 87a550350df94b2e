"""Time limits on a pool's tasks, kept by the worker that runs them (Note [Dask task timeouts]).

Note [Dask task timeouts]
~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a task run past its time limit (a pool's ``task_timeout``, or a call's own: ``apply_async(timeout=)``,
``submit(task_timeout=)``) fails with ``TaskTimeoutError`` and is not sent again; its worker process ends, and the other
tasks lost with it go again as a lost worker's (Note [Lost workers]).

How: each such task carries its limit and a token of its own (a task sent again gets a new one). ``run`` starts the
clock as the task starts on the worker (waiting for a worker thread uses none of it) and stops it as it ends. A watchdog
thread, started with the worker process's first limited task, sleeps until the nearest deadline of those running (woken
as one starts). Past a limit, the worker logs an event on ``TOPIC`` with the tokens of every task past its limit and,
``FLUSH`` seconds later (the event reaches the scheduler first), ends its own process: SIGTERM, then SIGKILL ``GRACE``
seconds later (a thread cannot be stopped; a process can, as the local pool ends a worker). The nanny starts a new
worker. Before sending a lost task again, the pool looks for its token in the events (``timed_out``): found, the task
fails with ``TaskTimeoutError``; the others go again, each loss counted toward Dask's allowed failures.

Not covered: with several threads per worker, a task timed out costs those running beside it their progress (a local
pool's worker loses only its own). Without a nanny, the ended worker is not replaced; the pool goes on with the others.
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
