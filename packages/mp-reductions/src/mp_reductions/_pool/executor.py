"""``ProcessPoolExecutor``: concurrent.futures' executor over the pool core (adapts concurrent/futures/process.py,
3.11-3.15, PSF License Agreement: its checks, messages and semantics, none of its private classes)::

    submit ─▶ pending (PENDING, cancellable) ─▶ running (RUNNING) ─▶ core's slots ─▶ workers
                  ▲   at most max_workers + 1 running      │                          │
                  └──── the next pending ones ◀── settle ◀── the core's result handler ─┘ result, or error

What changed from the stdlib's, and why:

- Arguments and results move by shared memory, as the Pool moves them.
- A worker that dies running a call breaks the executor, as in the stdlib, and the ``BrokenProcessPool`` says
  which worker and how (its cause, a ``WorkerLostError``); one that dies idle, or retires at
  ``max_tasks_per_child``, is replaced (the stdlib's breaks at the first, and hangs at the second up to 3.13,
  gh-115634). A failing initializer breaks it at once, logged to the ``concurrent.futures`` logger, as the
  stdlib's.
- A call whose arguments cannot be unpickled, or whose result cannot be (an Exception), fails its own future;
  the stdlib breaks the executor (it cannot tell whose it was). A result whose unpickling raises a
  BaseException (``SystemExit``) breaks it, as the stdlib's.
- ``task_timeout`` (and ``submit(..., task_timeout=)``): a call still running after that many seconds has its
  worker ended and replaced (watchdog Note [task timeouts]); its future fails with ``TaskTimeoutError`` and the
  executor goes on. The per-call keyword is ``task_timeout``, not ``timeout``: submit passes its other keywords
  to the function, and ``submit(requests.get, url, timeout=5)`` keeps its meaning.
- Python 3.14's API on every version: ``map(..., buffersize=)``, ``terminate_workers()``, ``kill_workers()``.
- Workers start on demand, one per call waiting while none is idle, up to ``max_workers`` (under fork: all at
  the first submit), started by ``submit`` before it returns, as the stdlib's; they are not daemonic, so they
  may start processes.
- An executor collected without ``shutdown`` shuts down as with ``shutdown(wait=False)``: its calls finish; at
  interpreter exit every executor not shut down finishes its calls first, and a later ``submit`` (in an
  ``atexit`` function) raises RuntimeError, as the stdlib's (its hook runs when the main thread is done, before
  the ``atexit`` functions, whenever they were registered).

Note [executor dispatch]
~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a future is, under the state's lock, in exactly one place: pending (PENDING, cancellable, not in the
core), running (RUNNING, its call in the core's cache: only its call settles it), or neither (settled, or
cancelled); and whoever takes it out of running is the only one to set it. ``submit`` appends to pending;
``dispatch`` (under the lock, from submit and from settle) moves the oldest pending ones to running while fewer than
max_workers + 1 run, calling ``set_running_or_notify_cancel`` (a cancelled one is dropped there); their calls are
then sent to the core outside the lock, in order (a send's pickling error settles its call, whose settle takes the
lock), after submit has grown the core to the calls running and pending (on demand: their workers started in
submit's thread). A call's result, through settle, takes its future out of running, then sets it outside the lock
(its done-callbacks may submit); a WorkerLostError, WorkerStartError, PoolBrokenError or ResultUnpicklingError goes
to ``break_`` instead, which fails every running and pending future with BrokenProcessPool once. The closer thread
(started by the first shutdown, break or collection) waits under the lock until nothing is pending or running, then
closes and joins the core, or tears it down once broken; nothing is dispatched after that wait ends, since it ends
only with nothing pending.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context, util
from typing import Any, TypeVar

from .._chunks import executor_map, process_chunk
from .core import Core
from .errors import PoolBrokenError, ResultUnpicklingError, WorkerLostError, WorkerStartError, check_timeout
from .results import call_repr, job_counter, short_repr

_R = TypeVar("_R")
log = logging.getLogger("mp_reductions.pool")

EXTRA_QUEUED_CALLS = 1  # running futures beyond max_workers, as the stdlib's call queue holds
_BROKEN = "A child process terminated abruptly, the process pool is not usable anymore"  # the stdlib's messages
_LOST = "A process in the process pool was terminated abruptly while the future was running or pending."
_BREAKS = (WorkerLostError, WorkerStartError, PoolBrokenError, ResultUnpicklingError)
_live: weakref.WeakSet = weakref.WeakSet()  # the states of executors not shut down
_global_shutdown = False


_map_inputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a map's chunk function -> its inputs table
_map_inputs_lock = threading.Lock()


class _Call:
    """A running future's call, as the core's cache holds it: the core sets it as it sets a Pool's result."""

    kind = "submit"
    _progress = None
    _limit: float | None = None
    _call: str | None = None
    call_inputs: dict | None = None  # shared by the calls of one ``map`` (_reductions Note [inputs once per call])

    def __init__(self, state: _State, core: Core, future: futures.Future, fn, args, kwargs, limit: float | None):
        self.state, self.future = state, future
        self.task: tuple | None = (fn, args, kwargs)
        self._job = next(job_counter)
        self._func = fn
        if type(fn) is functools.partial and fn.func is process_chunk:  # a chunk of a map: one partial per map
            with _map_inputs_lock:
                self.call_inputs = _map_inputs.setdefault(fn, {})
        if limit is not None or core.watchdog.task_timeout is not None:
            self._call = call_repr(args, kwargs)  # for its TaskTimeoutError
        if limit is not None:
            self._limit = limit
            core.watchdog.limit(self._job, limit)
        core.cache[self._job] = self

    def _set(self, i: int, obj) -> None:
        self.state.settle(self, obj)

    def _abort(self, error: BaseException) -> None:
        self.state.settle(self, (False, error))

    def describe(self, i: int) -> str | None:
        func = self._func
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or short_repr(func)
        return name if self._call is None else f"{name}{self._call}"


class _State:
    """What an executor's futures, calls and closer share: never the executor itself, so that it can be
    collected while its calls run (Note [executor dispatch])."""

    def __init__(self, max_workers: int, mp_context, initializer, initargs, max_tasks_per_child,
                 shared_results: bool, task_timeout: float | None):
        self.max_workers, self.mp_context = max_workers, mp_context
        self.options = (initializer, initargs, max_tasks_per_child, shared_results, task_timeout)
        self.on_demand = mp_context.get_start_method(allow_none=False) != "fork"  # as the stdlib's
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified when nothing is pending or running
        self.pending: collections.deque = collections.deque()  # (future, fn, args, kwargs, limit)
        self.running: dict[int, _Call] = {}  # job -> its call
        self.core: Core | None = None  # made at the first submit
        self.shutdown = False
        self.broken: str | None = None  # the message of BrokenProcessPool for a later submit ...
        self.cause: BaseException | None = None  # ... and its cause: what broke it
        self.closer: threading.Thread | None = None
        _live.add(self)

    @property
    def started(self) -> Core:
        """The core (made at the first submit: every caller comes after one)."""
        core = self.core
        assert core is not None
        return core

    def start(self) -> None:
        """The core, at the first submit (the lock held); BrokenProcessPool if its threads cannot start."""
        initializer, initargs, max_tasks_per_child, shared_results, task_timeout = self.options
        try:
            self.core = Core(self.max_workers, initializer, initargs, max_tasks_per_child, self.mp_context,
                             shared_results=shared_results, daemon=False, task_timeout=task_timeout, executor=True,
                             active=0 if self.on_demand else self.max_workers)
        except RuntimeError as exc:  # (a thread that cannot start: interpreter shutdown)
            self.broken = _BROKEN
            self.shutdown = True
            raise BrokenProcessPool(f"{_BROKEN}: the executor could not start ({exc})") from exc
        self.core.finalizer = util.Finalize(self, _end_core, (self.core, weakref.ref(self)), exitpriority=15)

    def submit(self, fn, args, kwargs, limit) -> futures.Future:
        with self.lock:
            core = self.core
            if self.broken or (core is not None and core.slots.broken is not None):
                # (no local holds it: the error's traceback would hold this frame, a cycle keeping the caller's
                # frame and what it holds, a Queue's semaphores, alive until a collection)
                raise BrokenProcessPool(self.broken or _BROKEN) from (
                    self.cause or (core.slots.broken if core is not None else None))
            if self.shutdown and not _global_shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _global_shutdown:  # (the stdlib's message, also for an executor the exit hook shut down)
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            if core is None:
                self.start()
            f: futures.Future = futures.Future()
            self.pending.append((f, fn, args, kwargs, limit))
            calls = self.dispatch()
            wanted = len(self.running) + len(self.pending)
        if self.on_demand:  # the workers it needs are started when it returns (outside the lock), as the stdlib's
            self.started.grow(wanted)
        self.send(calls)
        return f

    def dispatch(self) -> list[_Call]:
        """Move pending futures to running while fewer than max_workers + 1 run (the lock held)."""
        calls: list[_Call] = []
        while self.pending and len(self.running) < self.max_workers + EXTRA_QUEUED_CALLS:
            f, fn, args, kwargs, limit = self.pending.popleft()
            if not f.set_running_or_notify_cancel():  # cancelled while pending
                continue
            call = _Call(self, self.started, f, fn, args, kwargs, limit)
            self.running[call._job] = call
            calls.append(call)
        return calls

    def send(self, calls: list[_Call]) -> None:
        """Give the core the calls dispatched, in order (the lock not held: a failed send settles its call)."""
        if not calls:
            return
        put = self.started.slots.put
        for call in calls:
            fn, args, kwargs = call.task or (None, (), {})
            call.task = None  # the core holds its pickle now: the executor keeps no reference to its arguments
            try:
                put((call._job, 0, fn, args, kwargs))
            except Exception as e:
                call._set(0, (False, e))
            fn = args = kwargs = None

    def settle(self, call: _Call, obj) -> None:
        """The core's result for ``call`` (Note [executor dispatch])."""
        ok, value = obj
        core = self.started
        try:
            del core.cache[call._job]
        except KeyError:
            pass
        core.watchdog.done(call._job)
        if not ok and isinstance(value, _BREAKS):
            self.break_(value, call)
            return
        with self.lock:
            if self.running.pop(call._job, None) is None:  # failed when the executor broke
                return
            calls = self.dispatch()
            self.notify_idle()
        f = call.future
        try:
            if ok:
                f.set_result(value)
            else:
                f.set_exception(value)
        except futures.InvalidStateError:  # (never: only its call settles a running future)
            pass
        self.send(calls)

    def break_(self, cause: BaseException | None, call: _Call | None = None, message: str = _BROKEN) -> None:
        """Every pending and running future fails with BrokenProcessPool (``cause``), later submits raise it, and
        the closer tears the core down."""
        with self.lock:
            if self.broken or (call is not None and call._job not in self.running):
                return
            self.broken, self.cause = message, cause
            self.shutdown = True
            doomed = [c.future for c in self.running.values()] + [item[0] for item in self.pending]
            jobs = list(self.running)
            self.running.clear()
            self.pending.clear()
            self.notify_idle()
            inline = self.start_closer()
        for job in jobs:
            self.started.cache.pop(job, None)
        for future in doomed:
            # one each, as the stdlib's (gh-101267): no shared traceback; the cause says which worker died how
            error = BrokenProcessPool(f"{_LOST} The first: {cause.death()}" if isinstance(cause, WorkerLostError)
                                      else _LOST)
            error.__cause__ = cause
            try:
                future.set_exception(error)
            except futures.InvalidStateError:  # cancelled meanwhile
                pass
        if inline:
            self.close()

    def ended(self) -> None:
        """The core was torn down (its finalizer ran): calls still pending or running can never finish now, so the
        executor breaks, and the closer, which waits for them, ends (else it, and the interpreter's exit, would wait
        forever). The closer's own teardown finds none; multiprocessing's finalizers (``util._run_finalizers``: at
        exit, or a test's cleanup) can run it with calls waiting."""
        with self.lock:
            waiting = bool(self.pending or self.running)
        if waiting:
            self.break_(None, message=f"{_BROKEN} (its workers were ended while calls were pending or running)")

    def notify_idle(self) -> None:
        if not self.pending and not self.running:
            self.idle.notify_all()

    def start_closer(self) -> bool:
        """Start the thread that ends the core once nothing is pending or running (the lock held): not a daemon,
        so the interpreter waits for the work queued, as the stdlib's. True when no thread can start (the
        interpreter is finalizing): the caller then closes in its own thread, outside the lock."""
        _live.discard(self)
        if self.closer is None:
            closer = threading.Thread(target=self.close, name="ProcessPoolExecutor closer")
            try:
                closer.start()
            except RuntimeError:
                return True
            self.closer = closer
        return False

    def close(self) -> None:
        """The closer's body: once nothing is pending or running, close and join the core (tear it down if
        broken). A failure here is logged and the core torn down all the same (core Note [helper threads])."""
        with self.lock:
            while self.pending or self.running:
                self.idle.wait()
            core, broken = self.core, self.broken
        if core is None:
            return
        try:
            if not broken:
                core.close()
                core.join()
        except BaseException:
            log.critical("the executor's closer thread failed; its pool is torn down", exc_info=True)
        finally:
            core.finalizer()

    def end(self, wait: bool, cancel: bool) -> None:
        """shutdown(wait, cancel_futures=cancel)."""
        with self.lock:
            self.shutdown = True
            cancelled = list(self.pending) if cancel else []
            if cancel:
                self.pending.clear()
                self.notify_idle()
            inline = self.start_closer()
        for f, *_ in cancelled:  # outside the lock: their done-callbacks may call submit
            f.cancel()
        if inline:
            self.close()
            return
        if wait:
            core = self.core
            if core is not None and threading.current_thread() is core.threads.get("result handler"):
                # a done-callback (the result handler sets the futures): the closer's join of the core would
                # wait for this thread, as the stdlib's join of its manager thread would, which raises this
                raise RuntimeError("cannot join current thread")
            if self.closer is not None:
                self.closer.join()


class ProcessPoolExecutor(futures.ProcessPoolExecutor):
    """``concurrent.futures.ProcessPoolExecutor`` over mp_reductions' pool core, with Python 3.14's API everywhere.

    ``mp_context`` defaults to ``multiprocessing.get_context()`` ("spawn" when ``max_tasks_per_child`` is given,
    as the stdlib's). Arguments and results travel by shared memory; ``shared_results`` (default True): arrays of
    1 MiB or more that the workers make are born in shared memory. A worker that dies running a call breaks the
    executor (``BrokenProcessPool``, whose cause is the ``WorkerLostError`` naming the worker and its exit code);
    workers that die idle or retire at ``max_tasks_per_child`` are replaced. ``map`` takes ``buffersize``, and
    ``terminate_workers()`` / ``kill_workers()`` exist, on every Python version. ``task_timeout`` (seconds; None:
    no limit), or ``submit(fn, *args, task_timeout=s, **kwargs)`` for one call: a call running longer has its
    worker ended and replaced, and its future fails with ``TaskTimeoutError``; the executor goes on. See Note
    [executor dispatch].
    """

    _default_context: Callable[..., Any] = staticmethod(get_context)  # (the facade's subclass gives arraymp's)

    def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                 initializer: Callable[..., object] | None = None, initargs: Iterable[Any] = (), *,
                 max_tasks_per_child: int | None = None, shared_results: bool = True,
                 task_timeout: float | None = None) -> None:
        task_timeout = check_timeout(task_timeout, "task_timeout")
        # the stdlib's checks and messages; never its __init__, which builds the private classes this replaces
        if max_workers is None:
            max_workers = getattr(os, "process_cpu_count", os.cpu_count)() or 1
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is None:
            mp_context = type(self)._default_context("spawn" if max_tasks_per_child is not None else None)
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
        self._state = _State(max_workers, mp_context, initializer, tuple(initargs), max_tasks_per_child,
                             shared_results, task_timeout)
        weakref.finalize(self, _collected, self._state).atexit = False  # (at exit, _python_exit waits instead)

    # the stdlib's attributes, read-only, which third-party code (and the stdlib's tests) read
    @property
    def _processes(self) -> dict:  # type: ignore[override]
        core = self._state.core
        return {} if core is None else {p.pid: p for p in list(core.workers)}

    @property
    def _broken(self) -> str | bool:  # type: ignore[override]
        state = self._state
        core = state.core
        return state.broken or (core is not None and core.slots.broken is not None and _BROKEN)

    @property
    def _executor_manager_thread(self) -> threading.Thread | None:  # type: ignore[override]
        """The thread that delivers the results (it ends once the executor is shut down and its work done)."""
        core = self._state.core
        return None if core is None else core.threads.get("result handler")

    def submit(self, fn: Callable[..., _R], /, *args: Any, task_timeout: float | None = None,  # type: ignore[override]
               **kwargs: Any) -> futures.Future[_R]:  # (override: task_timeout, which the base's has not)
        return self._state.submit(fn, args, kwargs, check_timeout(task_timeout, "task_timeout"))

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
        self._state.end(wait, cancel_futures)

    shutdown.__doc__ = futures.Executor.shutdown.__doc__

    def terminate_workers(self):
        """Python 3.14's: shut the executor down (the pending futures cancelled), send each live worker SIGTERM;
        the running futures fail with ``BrokenProcessPool``. The executor is then broken."""
        self._force_shutdown(operation="terminate")

    def kill_workers(self):
        """Python 3.14's: as ``terminate_workers``, with SIGKILL."""
        self._force_shutdown(operation="kill")

    def _force_shutdown(self, operation: str) -> None:
        """``terminate_workers`` (``operation="terminate"``) or ``kill_workers`` ("kill"), as the stdlib's."""
        if operation not in ("terminate", "kill"):
            raise ValueError(f"Unsupported operation: {operation!r}")
        processes = list(self._processes.values())
        self.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            try:
                if p.is_alive():
                    getattr(p, operation)()
            except (ValueError, ProcessLookupError):  # closed, or just ended
                pass
        self._state.break_(None, message=f"{_BROKEN} (the executor was forcefully shut down)")


def _end_core(core: Core, state: weakref.ref) -> None:
    """The core's finalizer (when its executor's state is collected, at exit, or when run early): tear it down,
    then break the executor if calls were still waiting (``_State.ended``)."""
    core.teardown()
    alive = state()
    if alive is not None:
        alive.ended()


def _collected(state: _State) -> None:
    """The executor was collected without shutdown: its calls finish, then its core goes (shutdown(wait=False))."""
    state.end(wait=False, cancel=False)


def _python_exit() -> None:
    """At interpreter exit, every executor not shut down finishes its calls first, as the stdlib's; a submit after
    this raises RuntimeError."""
    global _global_shutdown
    _global_shutdown = True
    for state in list(_live):
        state.end(wait=True, cancel=False)


# As the stdlib's: run when the main thread is done, before any atexit function (so none can submit after it,
# whenever it was registered) and before the interpreter joins the threads (the closers among them). A fork child
# (a worker, or any process forked while an executor lives) runs these hooks too as it exits, with a copy of its
# parent's executors whose locks may have been held at the fork: they are not its own to finish.
try:
    getattr(threading, "_register_atexit", atexit.register)(_python_exit)
except RuntimeError:  # (imported by an atexit function: the interpreter is past that point)
    atexit.register(_python_exit)
os.register_at_fork(after_in_child=_live.clear)
