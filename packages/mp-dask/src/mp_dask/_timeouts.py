"""Time limits on a pool's tasks, kept by the worker that runs them (Note [Dask task timeouts]).

Note [Dask task timeouts]
~~~~~~~~~~~~~~~~~~~~~~~~~
A task of a pool with ``task_timeout`` (or of a call with its own limit:
``apply_async(timeout=)``, ``submit(task_timeout=)``) carries its limit and a
token of its own (one per sending: a task sent again gets a new one). ``run``
starts the clock as the task starts on the worker (a task waiting for a worker
thread uses none of it) and stops it as it ends. A watchdog thread of the
worker process, started with its first limited task, wakes every ``TICK``
seconds while any runs; a task past its limit has the worker log an event on
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

from ._deaths import event

TOPIC = "arraymp-task-timeouts"
TICK = 0.05  # seconds between the watchdog's looks at the running tasks
FLUSH = 0.25  # seconds between the event and the worker's end
GRACE = 0.5  # seconds between SIGTERM and SIGKILL (as mp_reductions.Pool's)

_lock = threading.Lock()
_running: dict[str, tuple[float, float]] = {}  # token -> (deadline by time.monotonic, limit)
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
        with _lock:
            _running[self.token] = (time.monotonic() + self.limit, self.limit)
            if _watchdog is None:
                _watchdog = threading.Thread(target=_watch, args=(worker,), name="arraymp-task-timeouts",
                                             daemon=True)
                _watchdog.start()
        return self

    def __exit__(self, *exc):
        if self.limit is not None:
            with _lock:
                _running.pop(self.token, None)


def _watch(worker) -> None:
    while True:
        now = time.monotonic()
        with _lock:
            late = [(token, limit) for token, (deadline, limit) in _running.items() if deadline <= now]
            nearest = min((deadline for deadline, _ in _running.values()), default=now + TICK)
        if late:
            break
        time.sleep(min(TICK, max(0.0, nearest - now)))
    worker.log_event(TOPIC, {"tokens": [token for token, _ in late], "limits": [limit for _, limit in late],
                             "pid": os.getpid(), "address": worker.address})
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
