"""``ProcessPoolExecutor``: concurrent.futures' executor over our Pool (adapts concurrent/futures/process.py).

The stdlib's executor is a manager thread over private classes (``_SafeQueue``, ``_ExecutorManagerThread``,
``_process_worker``) whose signatures change in patch releases (3.13.x's ``_SafeQueue`` takes no
``shutdown_lock``). This one uses none of them: it keeps the futures and hands their calls to an
``mp_reductions.Pool``, which does the rest::

    submit ─▶ pending (PENDING, cancellable) ─▶ running (RUNNING) ─apply_async─▶ Pool ─▶ workers
                   ▲  at most max_workers + 1 running      │                       │
                   └──── the next pending ones ◀── _settle ◀── its result handler ─┘ result, or error

What changed from the stdlib, and why:

- Arguments and results move by shared memory, as the Pool moves them: a fresh big result the worker keeps no
  reference to comes back with no copy, any other as a copy (results are snapshots).
- A worker that dies running a call breaks the executor, as in the stdlib, and the ``BrokenProcessPool`` says
  which worker and how (its cause, the Pool's ``WorkerLostError``); an initializer that fails breaks it with the
  Pool's ``WorkerStartError`` as the cause. A worker that dies idle is replaced, as the Pool replaces it (the
  stdlib's breaks). A call that cannot be pickled, or a result that cannot be unpickled, fails its own future (the
  stdlib breaks the executor for the second: it cannot tell whose result it was).
- ``task_timeout`` (and ``submit(..., task_timeout=)`` for one call): a call still running after that many seconds
  has its worker ended and replaced (mp_reductions Note [task timeouts]); its future fails with
  ``TaskTimeoutError`` (a ``TimeoutError``) and the executor goes on: a deliberate loss breaks nothing. The
  per-call keyword is ``task_timeout``, not ``timeout``: submit passes its other keywords to the function, and
  ``submit(requests.get, url, timeout=5)`` must keep meaning what it means with the stdlib's executor.
- Workers retired at ``max_tasks_per_child`` are replaced (the stdlib's hangs there up to 3.13, gh-115634).
- Python 3.14's API on every version: ``map(..., buffersize=)`` (``mp_reductions.executor_map``),
  ``terminate_workers()``, ``kill_workers()``.
- The workers start at the first ``submit``, all ``max_workers`` of them (the stdlib's start one per ``submit``
  while none is idle, except under fork); they are not daemonic, as the stdlib's, so they may start processes.
- An executor never shut down is ended with its Pool when it is collected or the interpreter exits (the Pool's
  finalizer), calls still running or not; the stdlib's waits for them at exit. After ``shutdown(wait=False)`` the
  interpreter waits for the queued work, as the stdlib's (the closer thread is not a daemon).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from mp_reductions import Pool, WorkerLostError, WorkerStartError, executor_map
from mp_reductions._pool import check_timeout

from ._context import default_context

_R = TypeVar("_R")

EXTRA_QUEUED_CALLS = 1  # running futures beyond max_workers, as the stdlib's call queue holds
_BROKEN = "A child process terminated abruptly, the process pool is not usable anymore"  # the stdlib's messages
_LOST = "A process in the process pool was terminated abruptly while the future was running or pending."


class ProcessPoolExecutor(futures.ProcessPoolExecutor):
    """``concurrent.futures.ProcessPoolExecutor`` over ``mp_reductions.Pool``, with Python 3.14's API everywhere.

    ``mp_context`` defaults to ``arraymp.get_context()`` ("spawn" when ``max_tasks_per_child`` is given, as the
    stdlib's). Arguments and results travel by shared memory; ``shared_results`` (default True): arrays of 1 MiB or
    more that the workers make are born in shared memory, so a fresh result comes back with no copy
    (``mp_reductions.shared_allocation``). A worker that dies breaks the executor (``BrokenProcessPool``, whose
    cause is the ``WorkerLostError`` naming the worker and its exit code); workers retired at
    ``max_tasks_per_child`` are replaced. ``map`` takes ``buffersize``, and ``terminate_workers()`` /
    ``kill_workers()`` exist, on every Python version (new in 3.14's). ``task_timeout`` (seconds; None: no
    limit), or ``submit(fn, *args, task_timeout=s, **kwargs)`` for one call: a call running longer has its worker
    ended and replaced, and its future fails with ``TaskTimeoutError``; the executor goes on. See Note [executor
    dispatch].
    """

    def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                 initializer: Callable[..., object] | None = None, initargs: Iterable[Any] = (), *,
                 max_tasks_per_child: int | None = None, shared_results: bool = True,
                 task_timeout: float | None = None) -> None:
        task_timeout = check_timeout(task_timeout, "task_timeout")
        # The stdlib's checks and messages; never its __init__, which builds the private classes this replaces.
        if max_workers is None:
            max_workers = getattr(os, "process_cpu_count", os.cpu_count)() or 1
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is None:
            mp_context = default_context.get_context("spawn" if max_tasks_per_child is not None else None)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
            if mp_context.get_start_method(allow_none=False) == "fork":
                raise ValueError("max_tasks_per_child is incompatible with the 'fork' multiprocessing start method; "
                                 "supply a different mp_context.")
        self._max_workers = max_workers  # the stdlib's attribute names, read by third-party code
        self._mp_context = mp_context
        self._initializer, self._initargs = initializer, initargs  # type: ignore[assignment]  # (typeshed's)
        self._max_tasks_per_child = max_tasks_per_child
        self._shared_results = shared_results
        self._task_timeout = task_timeout
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when nothing is pending or running
        self._pending: collections.deque = collections.deque()  # (future, fn, args, kwargs, limit): not in the Pool
        self._running: dict = {}  # future -> None: given to the Pool, not settled
        self._pool: Pool | None = None  # made at the first submit
        self._shutdown = False
        # the message of BrokenProcessPool for a later submit (typeshed's is a bool)
        self._broken: str | None = None  # type: ignore[assignment]
        self._closer: threading.Thread | None = None

    @property  # the stdlib's attribute, read-only here
    def _processes(self) -> dict:  # type: ignore[override]
        """The pool's workers by pid, as the stdlib's attribute (third-party code reads it)."""
        pool = self._pool
        return {} if pool is None else {p.pid: p for p in list(pool._pool)}

    def submit(self, fn: Callable[..., _R], /, *args: Any, task_timeout: float | None = None,  # type: ignore[override]
               **kwargs: Any) -> futures.Future[_R]:  # (override: task_timeout, which the base's has not)
        task_timeout = check_timeout(task_timeout, "task_timeout")
        with self._lock:
            if self._broken:
                raise BrokenProcessPool(self._broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._pool is None:
                self._pool = Pool(self._max_workers, self._initializer, self._initargs, self._max_tasks_per_child,
                                  context=self._mp_context, shared_results=self._shared_results,
                                  daemon=False,  # as the stdlib's workers: they may start processes
                                  task_timeout=self._task_timeout)
            f: futures.Future[_R] = futures.Future()
            self._pending.append((f, fn, args, kwargs, task_timeout))
            self._dispatch()
        return f

    submit.__doc__ = (futures.Executor.submit.__doc__ or "") + """
        ``task_timeout`` (seconds): this call's limit instead of the executor's: a call running longer has its
        worker ended and replaced, and the future fails with ``TaskTimeoutError``. It is not passed to ``fn``.
        """

    def map(self, fn: Callable[..., _R], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1,
            buffersize: int | None = None, progress: bool | dict[str, Any] | None = None) -> Iterator[_R]:
        """Python 3.14's ``ProcessPoolExecutor.map``, ``buffersize`` included, on every version: an iterator of
        ``fn(*args)`` for the arguments of ``zip(*iterables)``, in order, the calls sent ``chunksize`` to a task;
        with ``buffersize``, at most that many tasks submitted and not yet yielded (the iterables read lazily).
        ``TimeoutError`` if the whole iteration takes longer than ``timeout`` seconds. ``progress=True`` (or a
        dict of tqdm's options, e.g. ``{"desc": "fit"}``) draws a progress bar on stderr where it is a terminal."""
        return executor_map(self, fn, *iterables, timeout=timeout, chunksize=chunksize, buffersize=buffersize,
                            progress=progress)

    def shutdown(self, wait=True, *, cancel_futures=False):
        with self._lock:
            self._shutdown = True
            cancelled = list(self._pending) if cancel_futures else []
            if cancel_futures:
                self._pending.clear()
                self._notify_idle()
            closer = self._start_closer()
        for f, *_ in cancelled:  # outside the lock: their done-callbacks may call submit
            f.cancel()
        if wait:
            pool = self._pool
            if pool is not None and threading.current_thread() is pool._result_handler:
                # a done-callback (the Pool's result handler sets the futures): the closer's join of the Pool
                # would wait for this thread, as the stdlib's join of its manager thread would, which raises this
                raise RuntimeError("cannot join current thread")
            closer.join()

    shutdown.__doc__ = futures.Executor.shutdown.__doc__

    def terminate_workers(self):
        """Python 3.14's: shut the executor down (the pending futures cancelled), send each live worker SIGTERM;
        the running futures fail with ``BrokenProcessPool``. The executor is then broken."""
        self._force_shutdown("terminate")

    def kill_workers(self):
        """Python 3.14's: as ``terminate_workers``, with SIGKILL."""
        self._force_shutdown("kill")

    def _force_shutdown(self, how: str) -> None:
        self.shutdown(wait=False, cancel_futures=True)
        for p in self._processes.values():
            try:
                if p.is_alive():
                    getattr(p, how)()
            except (ValueError, ProcessLookupError):  # closed, or just ended
                pass
        self._break(None)

    def _dispatch(self) -> None:
        """Give the Pool pending calls while fewer than max_workers + 1 run (the lock held)."""
        while self._pending and len(self._running) < self._max_workers + EXTRA_QUEUED_CALLS:
            f, fn, args, kwargs, limit = self._pending.popleft()
            if not f.set_running_or_notify_cancel():  # cancelled while pending
                continue
            self._running[f] = None
            self._pool.apply_async(fn, args, kwargs, functools.partial(self._settle, f, True),
                                   functools.partial(self._settle, f, False), timeout=limit)

    def _settle(self, f, ok: bool, value) -> None:
        """The Pool's callback for ``f`` (its result handler's thread, or its task handler's when the call could
        not be pickled)."""
        if not ok and isinstance(value, (WorkerLostError, WorkerStartError)):
            self._break(value, f)
            return
        with self._lock:
            if f not in self._running:  # failed when the executor broke
                return
            del self._running[f]
            self._dispatch()
            self._notify_idle()
        if ok:
            f.set_result(value)
        else:
            f.set_exception(value)

    def _break(self, cause: BaseException | None, f=None) -> None:
        """A worker died (``cause``, for ``f``), or they were stopped: every pending and running future fails with
        BrokenProcessPool, later submits raise it, and the closer terminates the pool."""
        with self._lock:
            if self._broken or (f is not None and f not in self._running):
                return
            self._broken = _BROKEN
            self._shutdown = True
            doomed = [*self._running, *(item[0] for item in self._pending)]
            self._running.clear()
            self._pending.clear()
            self._notify_idle()
            self._start_closer()
        for future in doomed:
            # one each, as the stdlib's (gh-101267): no shared traceback; the cause says which worker died how
            error = BrokenProcessPool(f"{_LOST} The first: {cause.death()}" if isinstance(cause, WorkerLostError)
                                      else _LOST)
            error.__cause__ = cause
            try:
                future.set_exception(error)
            except futures.InvalidStateError:  # cancelled meanwhile
                pass

    def _notify_idle(self) -> None:
        if not self._pending and not self._running:
            self._idle.notify_all()

    def _start_closer(self) -> threading.Thread:
        """The thread that ends the pool once nothing is pending or running (the lock held): not a daemon, so the
        interpreter waits at exit for the work queued before ``shutdown(wait=False)``, as the stdlib's."""
        if self._closer is None:
            self._closer = threading.Thread(target=self._close, name="ProcessPoolExecutor closer")
            self._closer.start()
        return self._closer

    def _close(self) -> None:
        with self._lock:
            while self._pending or self._running:
                self._idle.wait()
            pool, broken = self._pool, self._broken
        if pool is None:
            return
        if broken:
            pool.terminate()
        else:
            pool.close()
            pool.join()


# Note [executor dispatch]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A future is in exactly one place, under the executor's lock: pending (the deque: PENDING, cancellable, not given
# to the Pool), running (the dict: RUNNING, given to the Pool with apply_async, not settled), or neither (settled,
# or cancelled). submit() appends to pending; _dispatch() moves the oldest pending ones to running, calling
# set_running_or_notify_cancel() (a cancelled one is dropped there), while fewer than max_workers + 1 run: the
# stdlib's call queue, so a future is cancellable until a worker is about to take it. _dispatch runs under the lock
# from submit() and from _settle(), so the calls reach the Pool in submission order.
#
# Who fails a future, and in what order: the future's own Pool result, through _settle() (its value or exception:
# the call raised, could not be pickled, or its result could not be unpickled), takes it out of running first, then
# sets it outside the lock (its done-callbacks may submit); the Pool's WorkerLostError or WorkerStartError goes to
# _break() instead, which fails every running and pending future with BrokenProcessPool (cause: that error), once;
# kill_workers()/terminate_workers() cancel the pending ones (shutdown(cancel_futures=True)), signal the workers,
# then _break(None) fails the running ones. Whoever takes a future out of running under the lock is the only one to
# set it: a result that comes after _break finds it gone and is dropped; a future cancelled by its user while
# pending is skipped by _dispatch, and _break's set_exception on it raises InvalidStateError, ignored.
#
# The closer thread (started by the first shutdown() or _break) waits under the lock until nothing is pending or
# running, then ends the pool: close() and join() (the workers finish and exit), or terminate() once broken (the
# pool's state is not trusted, as the stdlib's _terminate_broken). Nothing is dispatched to a pool being ended: the
# lock orders _dispatch before the closer's wait ends, and the closer's wait ends only with nothing pending.
