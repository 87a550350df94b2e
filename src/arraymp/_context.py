"""Contexts: the stdlib's, with our Queue / SimpleQueue / JoinableQueue / Pipe / Pool,
and ``ProcessPoolExecutor`` over our context (adapts multiprocessing/context.py; the
executor is concurrent/futures/process.py's, which replaces retired workers here).

Every factory is a lazy method, as in the stdlib; ``get_context(method)``
returns our context for that start method, and ``get_context("dask", ...)``
mp-dask's context (imported on that call: the ``arraymp[dask]`` extra). The
default context follows the stdlib's start method, so
``arraymp.set_start_method`` and ``multiprocessing.set_start_method`` are one
setting, as in torch.multiprocessing.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import traceback
from concurrent import futures
from concurrent.futures import process as _futures_process
from multiprocessing import context as mpc

from mp_reductions import Queue as _Queue
from mp_reductions import prepare_worker


class _ArrayContext:
    """Mixed into each stdlib context: the channels that move arrays by shared memory."""

    def Queue(self, maxsize=0):
        from mp_reductions import Queue

        return Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize=0):
        from mp_reductions import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self):
        from mp_reductions import SimpleQueue

        return SimpleQueue(ctx=self.get_context())

    def Pipe(self, duplex=True):
        from mp_reductions import Pipe

        return Pipe(duplex)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None, *, shared_results=True):
        from mp_reductions import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context(),
                    shared_results=shared_results)

    def ProcessPoolExecutor(self, max_workers=None, initializer=None, initargs=(), max_tasks_per_child=None, *,
                            shared_results=True):
        kw = {} if max_tasks_per_child is None else {"max_tasks_per_child": max_tasks_per_child}
        return ProcessPoolExecutor(max_workers, self.get_context(), initializer, initargs,
                                   shared_results=shared_results, **kw)

    def get_context(self, method=None, **kwargs):
        if method is None:
            return self
        if method == "dask":
            return _dask_context(**kwargs)
        _no_options(method, kwargs)
        return _CONTEXTS[method] if method in _CONTEXTS else super().get_context(method)


def _no_options(method, kwargs) -> None:
    if kwargs:
        raise TypeError(f"get_context({method!r}) takes no options ({', '.join(kwargs)}); only 'dask' does")


def _dask_context(**kwargs):
    """``get_context("dask", address=None, n_workers=None, threads_per_worker=1, same_node=True, **cluster_kwargs)``."""
    try:
        import mp_dask
    except ImportError as exc:
        raise ImportError(f"get_context('dask') needs the mp-dask package ({exc}); install it with "
                          "`pip install 'arraymp[dask]'` (from a clone: `python3 -m pip install --no-cache-dir "
                          "./packages/{shm-core,shm-manager,mp-reductions,shm-cuda,mp-spawn,mp-dask} '.[dask]'`)"
                          ) from exc
    return mp_dask.get_context(**kwargs)


class ForkContext(_ArrayContext, mpc.ForkContext):
    pass


class SpawnContext(_ArrayContext, mpc.SpawnContext):
    pass


class ForkServerContext(_ArrayContext, mpc.ForkServerContext):
    pass


_CONTEXTS = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


class DefaultContext(_ArrayContext, mpc.BaseContext):
    """The context behind ``arraymp.Queue`` etc.: our context for the stdlib's current start method."""

    Process = multiprocessing.Process

    def get_context(self, method=None, **kwargs):
        if method is None:
            method = multiprocessing.get_start_method()
        if method == "dask":
            return _dask_context(**kwargs)
        _no_options(method, kwargs)
        try:
            return _CONTEXTS[method]
        except KeyError:
            raise ValueError(f"cannot find context for {method!r}; valid ones are: {', '.join(_CONTEXTS)}") from None

    def set_start_method(self, method, force=False):
        multiprocessing.set_start_method(method, force)

    def get_start_method(self, allow_none=False):
        return multiprocessing.get_start_method(allow_none)

    def get_all_start_methods(self):
        return multiprocessing.get_all_start_methods()

    def Queue(self, maxsize=0):
        return self.get_context().Queue(maxsize)

    def JoinableQueue(self, maxsize=0):
        return self.get_context().JoinableQueue(maxsize)

    def SimpleQueue(self):
        return self.get_context().SimpleQueue()


default_context = DefaultContext()


class ProcessPoolExecutor(futures.ProcessPoolExecutor):
    """``concurrent.futures.ProcessPoolExecutor`` whose ``mp_context`` defaults to ``arraymp.get_context()``.

    Calls go through our Queue (Note [call queue]) and results come back
    through our SimpleQueue, arrays by shared memory both ways. Workers that retire at
    ``max_tasks_per_child`` are replaced where the stdlib's executor hangs
    (Note [replacing workers]). ``shared_results`` (default True): arrays of
    1 MiB or more that the workers make are born in shared memory, so results
    come back with no copy (``mp_reductions.shared_allocation``).
    """

    def __init__(self, max_workers=None, mp_context=None, initializer=None, initargs=(), *, shared_results=True,
                 **kwargs):
        if mp_context is None:  # as the stdlib's: spawn when workers are replaced (max_tasks_per_child)
            mp_context = default_context.get_context("spawn" if kwargs.get("max_tasks_per_child") is not None else None)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        # each worker sets shared allocation for its results first (mp_reductions Note [shared allocation])
        super().__init__(max_workers, mp_context, _start_worker, (shared_results, initializer, initargs), **kwargs)
        stdlib = self._call_queue
        self._call_queue = _CallQueue(  # Note [call queue]
            stdlib._maxsize, ctx=self._mp_context, pending_work_items=self._pending_work_items,
            shutdown_lock=self._shutdown_lock, thread_wakeup=self._executor_manager_thread_wakeup)
        self._call_queue._ignore_epipe = True
        stdlib.close()  # never used: no feeder thread to join

    def _adjust_process_count(self):
        # The stdlib calls this from submit() and, when a worker retired at max_tasks_per_child, from its manager
        # thread (under the shutdown lock); only the second call is ours to change. See Note [replacing workers].
        manager = threading.current_thread()
        if (getattr(self, "_max_tasks_per_child", None) is None  # Python 3.10 has none; else workers never retire
                or not isinstance(manager, _futures_process._ExecutorManagerThread)
                or manager.executor_reference() is not self):
            return super()._adjust_process_count()
        if len(manager.processes) >= self._max_workers:
            return
        if manager.is_shutting_down() and not manager.pending_work_items:
            return  # shut down with nothing left to run: the manager ends the pool next
        p = self._mp_context.Process(target=_futures_process._process_worker,
                                     args=(manager.call_queue, manager.result_queue, self._initializer,
                                           self._initargs, self._max_tasks_per_child))
        p.start()
        manager.processes[p.pid] = p

    def _start_executor_manager_thread(self):
        super()._start_executor_manager_thread()
        manager = self._executor_manager_thread
        if manager is not None and type(manager) is _futures_process._ExecutorManagerThread:
            manager.__class__ = _ManagerThread  # Note [manager wait]


_PIPE_SIZE = 1 << 16  # a pipe's capacity (Linux's default)


class _ManagerThread(_futures_process._ExecutorManagerThread):
    """The stdlib's manager thread, taking a result already queued without waiting (Note [manager wait])."""

    def wait_result_broken_or_wakeup(self):
        reader = self.result_queue._reader
        if not reader.poll():
            return super().wait_result_broken_or_wakeup()
        try:
            result_item = reader.recv()
        except BaseException as e:  # as the stdlib's: the pool is broken, this the cause
            return None, True, traceback.format_exception(type(e), e, e.__traceback__)
        fd = self.thread_wakeup._reader.fileno()
        ready = select.poll()  # (select.select fails past descriptor 1023)
        ready.register(fd, select.POLLIN)
        if ready.poll(0):  # cleared as the stdlib's at every wake: a full pipe blocks submit()
            os.read(fd, _PIPE_SIZE)  # every wakeup in it: each is one write of 4 bytes, whole (< PIPE_BUF)
        return result_item, False, None


class _CallQueue(_futures_process._SafeQueue, _Queue):
    """The executor's call queue: the stdlib's ``_SafeQueue`` (a call that cannot be pickled fails its future)
    over our Queue (Note [call queue])."""


def _start_worker(shared_results: bool, initializer, initargs) -> None:
    """An executor worker's first call: its big arrays are born in shared memory, private (or not), and it goes
    first to the out-of-memory killer (mp_reductions.prepare_worker); then the user's initializer runs."""
    prepare_worker(shared_results)
    if initializer is not None:
        initializer(*initargs)


# Note [call queue]
# ~~~~~~~~~~~~~~~~~
# concurrent.futures sends each call through its _SafeQueue, a multiprocessing Queue whose put hands the item to a
# feeder thread that pickles and writes it: a thread switch per call in the executor's process, which makes tiny
# calls cost more than the work. Ours pickles and sends in the thread that puts (the executor's manager thread),
# carries arrays by shared memory, and holds no lock a killed worker could leave held; _SafeQueue's
# _on_queue_feeder_error still fails the future of a call that cannot be pickled (our Queue calls a subclass's
# hook at put). The stdlib's manager thread only puts, checks full(), closes and joins it (and, from Python 3.12,
# calls _terminate_broken), all of which our Queue has.


# Note [manager wait]
# ~~~~~~~~~~~~~~~~~~~
# concurrent.futures' manager thread takes one result per wake, and each wake is a multiprocessing.connection.wait
# on the result queue, its wakeup pipe and every worker's sentinel (a selector built and filled each time), then a
# clear() of the wakeup pipe (another such wait per poll): with tiny calls, that was a third of the manager's time.
# Ours takes a result already queued (a poll of our SimpleQueue's socket) without that wait, and empties the wakeup
# pipe when it holds something (one select of its descriptor, one read of all it holds), as the stdlib's clears it
# at every wake: each submit() writes to it, and a full pipe would block submit(). Each wakeup is a Connection
# message of no bytes, one write of its 4-byte header (atomic: under PIPE_BUF), so a read of all the pipe holds
# leaves no part of one behind for the stdlib's clear() (which reads message by message). When no result is queued
# it waits as the stdlib's does, so a dead worker's sentinel is seen once the results it sent are taken (the
# stdlib's looks at results first too). The thread is the stdlib's, its class changed once it started (in every
# version, 3.10 to 3.13, the executor starts it in _start_executor_manager_thread, and its run loop looks the
# method up at every turn).


# Note [replacing workers]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# concurrent.futures hangs for good once a worker must be replaced (CPython gh-115634, Python 3.11 up to 3.13.x
# releases without GH-140900): its "idle worker" semaphore counts completed tasks, not idle workers. Every task a
# worker finishes without retiring releases a token that only submit() takes back, so with a backlog queued the
# tokens outlive the idle moments they stood for, and the worker itself once it retires. The manager thread then
# replaces a retired worker through _adjust_process_count(), which takes such a stale token, concludes that a
# worker is idle and starts none; when the last worker has retired, the queued tasks wait forever:
#
#   submit x6 -> A, B started          A: task 1 done -> token     A: task 2 done, retires
#   manager: A retired -> _adjust_process_count() takes A's token -> no replacement (same for B) -> 0 workers
#
# As GH-140900 does upstream, a retired worker is replaced whenever the pool is below max_workers, without asking
# the semaphore; submit() keeps the stdlib's on-demand start and reuse of idle workers. The replacement is built
# from the manager thread's own references (processes, call and result queues), because shutdown(wait=False)
# clears the executor's while the manager still runs the queued work (gh-119592). Nothing is started once the
# pool is shut down with no work left. A future's done-callback that calls submit() runs in the manager thread
# too: it starts a worker without asking the semaphore, never more than max_workers. A worker that dies (not
# retires) breaks the pool, as in the stdlib. Left as in the stdlib: an executor garbage-collected with work
# queued cannot be reached from its manager, which then replaces no worker (upstream fails those futures with
# BrokenProcessPool since gh-152967).
