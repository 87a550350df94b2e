"""``ProcessPoolExecutor`` on a Dask cluster (adapts ``concurrent/futures/process.py``).

Returns real ``concurrent.futures.Future`` objects, set from the callbacks of
our tasks (see _tasks.py); ``map`` is Python 3.14's on every version, chunks
and ``buffersize`` (``mp_reductions.executor_map``). ``max_workers`` is what
``_max_workers`` reports (Dask decides where tasks run); ``max_tasks_per_child``
is checked, and not applied, with a warning (see ``_tasks.not_applied``).
``task_timeout``, and ``submit(..., task_timeout=)`` for one call, as arraymp's
executor (Note [Dask task timeouts] in _timeouts.py).
"""

from __future__ import annotations

import functools
import threading
from concurrent import futures

from mp_reductions import check_timeout, executor_map

from ._tasks import Tasks, apply_star, not_applied


class ProcessPoolExecutor(futures.Executor):
    """``concurrent.futures.ProcessPoolExecutor`` whose calls run on the workers of a Dask cluster."""

    def __init__(self, max_workers=None, initializer=None, initargs=(), max_tasks_per_child=None, *, context,
                 task_timeout=None):
        task_timeout = check_timeout(task_timeout, "task_timeout")
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_tasks_per_child is not None and (not isinstance(max_tasks_per_child, int) or max_tasks_per_child <= 0):
            raise ValueError("max_tasks_per_child must be >= 1")
        if max_tasks_per_child is not None:
            not_applied("max_tasks_per_child")
        self._tasks = Tasks(context, initializer, initargs, task_timeout)
        self._max_workers = max_workers or context.cpu_count()
        self._lock = threading.Lock()
        self._futures: dict = {}  # our Future -> its job (_tasks.Job)
        self._shutdown = False

    def submit(self, fn, /, *args, task_timeout=None, **kwargs):
        """The stdlib's; ``task_timeout`` (seconds): this call's limit instead of the executor's (not passed to
        ``fn``: ``timeout=`` would be ``fn``'s own keyword, as with the stdlib's executor)."""
        limit = check_timeout(task_timeout, "task_timeout")
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            f = futures.Future()
            self._futures[f] = None
            (self._futures[f],) = self._tasks.submit(apply_star, fn, [(args, kwargs)],
                                                     functools.partial(self._finished, f), "submit", limit)
        return f

    def _finished(self, f, _i, success, value) -> None:
        with self._lock:
            self._futures.pop(f, None)
        if f.set_running_or_notify_cancel():  # False: cancelled meanwhile, nothing to set
            if success:
                f.set_result(value)
            else:
                f.set_exception(value)

    def map(self, fn, *iterables, timeout=None, chunksize=1, buffersize=None, progress=None):
        return executor_map(self, fn, *iterables, timeout=timeout, chunksize=chunksize, buffersize=buffersize,
                            progress=progress)

    def shutdown(self, wait=True, *, cancel_futures=False):
        with self._lock:
            self._shutdown = True
            pending = list(self._futures.items()) if cancel_futures else []
        self._tasks.cancel([job for f, job in pending if job is not None and f.cancel()])
        if wait:
            self._tasks.wait()
            self._tasks.close()
