"""``Pool``: the stdlib's ``multiprocessing.pool.Pool`` API over the pool core (adapts the public methods of
CPython's Lib/multiprocessing/pool.py, 3.11-3.15 alike, Copyright (c) 2006-2008 R Oudkerk, licensed to the PSF
under a Contributor Agreement; PSF License Agreement).

What changed from the stdlib's, and why: arrays travel by shared memory; a dead worker fails only the task it
ran (``WorkerLostError``) and is replaced; workers that cannot start stop the pool (``WorkerStartError``);
``task_timeout`` and ``apply_async(timeout=)`` end a task past its limit (``TaskTimeoutError``); ``progress=``
draws a bar; a helper thread that fails breaks the pool loudly (core Note [helper threads]). The class
subclasses the stdlib's (``isinstance(p, multiprocessing.pool.Pool)`` holds) and overrides every method it
has: none of the stdlib's private ones is called. ``_pool``, ``_state``, ``_cache``, ``_processes`` and
``_repopulate_pool()`` are kept under the stdlib's names, which its own tests and some programs read.
"""

from __future__ import annotations

import itertools
import os
import warnings
from multiprocessing import get_context, util
from multiprocessing import pool as mp_pool
from typing import TYPE_CHECKING, Any, Self, TypeVar

from .._progress import chunk_sizes, counted, progress_bar, track_progress
from .core import Core, start_process
from .errors import check_timeout
from .handlers import RAISE, RUN
from .results import ApplyResult, IMapIterator, IMapUnorderedIterator, MapResult, call_repr

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

_S = TypeVar("_S")
_R = TypeVar("_R")
_Progress = bool | dict[str, Any] | None  # progress=: True, or a dict of tqdm's options (_progress.py)


def mapstar(args):
    """A map chunk's function, run in a worker: ``(func, items)``."""
    return list(map(*args))


def starmapstar(args):
    """A starmap chunk's function, run in a worker."""
    return list(itertools.starmap(args[0], args[1]))


def _chunks(func, it, size: int):
    """``(func, items)`` for each chunk of ``size`` items of ``it``."""
    it = iter(it)
    while x := tuple(itertools.islice(it, size)):
        yield func, x


def _guarded(job: int, func, iterable):
    """The tasks of a call over ``iterable``; an error of the iterable's is the next task's (the stdlib's
    _guarded_task_generation, the task failing in the parent instead of in a worker)."""
    i = -1
    try:
        for i, x in enumerate(iterable):
            yield job, i, func, (x,), {}
    except Exception as e:
        yield job, i + 1, RAISE, (e,), {}


class Pool(mp_pool.Pool):
    """``multiprocessing.pool.Pool`` whose arrays travel by shared memory and which survives dead workers.

    ``context`` chooses the start method (any ``multiprocessing`` context); the queues are always ours. A worker
    that dies while running a task fails that task's result with :class:`WorkerLostError` and is replaced.
    ``shared_results`` (default True): arrays of 1 MiB or more that the workers make are born in shared memory,
    so results come back with no copy (``shared_allocation``; off under the file_system strategy). ``daemon``
    (default True, as the stdlib's): whether the workers are daemonic processes. ``task_timeout`` (seconds,
    default None: no limit): a task still running after that long has its worker ended (SIGTERM, then SIGKILL
    after ``GRACE`` seconds) and fails with :class:`TaskTimeoutError`; the worker is replaced.
    ``apply_async(..., timeout=)`` sets one call's limit. A chunk of ``map`` is one task.
    ``AsyncResult.get(timeout)`` keeps the stdlib's meaning: it only stops waiting.
    """

    _core: Core  # (unset in a half-built pool: __del__ and _state cope)

    @staticmethod
    def Process(ctx, *args, **kwds):
        """The stdlib's hook: a worker process of ``ctx``."""
        return start_process(ctx, *args, **kwds)

    def __init__(self, processes: int | None = None, initializer: Callable[..., object] | None = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: int | None = None, context: Any = None, *,
                 shared_results: bool = True, daemon: bool = True, task_timeout: float | None = None) -> None:
        task_timeout = check_timeout(task_timeout, "task_timeout")
        ctx = context or get_context()
        if processes is None:
            processes = getattr(os, "process_cpu_count", os.cpu_count)() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None:
            if not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0:
                raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._processes = processes
        self._ctx, self._initializer, self._initargs = ctx, initializer, initargs
        self._maxtasksperchild = maxtasksperchild
        self._core = Core(processes, initializer, initargs, maxtasksperchild, ctx, shared_results=shared_results,
                          daemon=daemon, task_timeout=task_timeout, Process=type(self).Process)
        self._terminate = util.Finalize(self, self._core.teardown, exitpriority=15)
        self._core.finalizer = self._terminate

    # the stdlib's attributes, read by its tests and by some programs
    @property
    def _state(self) -> str:
        core = getattr(self, "_core", None)
        return core.state if core is not None else mp_pool.TERMINATE

    @_state.setter
    def _state(self, value: str) -> None:
        self._core.state = value

    @property
    def _pool(self) -> list:
        return self._core.workers

    @property
    def _cache(self):
        return self._core.cache

    def _repopulate_pool(self) -> None:
        self._core.repopulate()

    def _check_running(self) -> None:
        self._core.check_running()

    def _result(self, make, func, sizes=None, progress: _Progress = None, total: int | None = None):
        """The result ``make()`` makes, ready for its tasks: its function named, its front kept alive, its bar
        (made first: without tqdm, nothing is left pending)."""
        bar = progress_bar(progress, total)
        result = make()
        result._func = func
        result._pool = self  # the pool lives while a result is pending, as the stdlib's does
        track_progress(result, bar, sizes)
        return result

    def apply_async(self, func: Callable[..., _R], args: Iterable[Any] = (),
                    kwds: Mapping[str, Any] = {},  # noqa: B006 (the stdlib's)
                    callback: Callable[[_R], object] | None = None,
                    error_callback: Callable[[BaseException], object] | None = None, *,
                    timeout: float | None = None, alone: bool = False) -> mp_pool.ApplyResult[_R]:
        """The stdlib's; ``timeout``: this call's limit in seconds instead of the pool's ``task_timeout``
        (watchdog Note [task timeouts]). The result's ``get(timeout)`` only stops waiting, as the stdlib's.
        ``alone=True``: the task goes to a worker in a message of its own, never in a batch behind other short
        tasks (slots Note [batches]), for a caller that takes each result as soon as its task ends."""
        limit = check_timeout(timeout, "timeout")
        self._check_running()
        result = self._result(lambda: ApplyResult(self._cache, callback, error_callback), func)
        if alone:
            result.alone = True
        core = self._core
        if limit is not None or core.watchdog.task_timeout is not None:
            result._call = call_repr(args, kwds)  # for its TaskTimeoutError
        if limit is not None:
            result._limit = limit
            core.watchdog.limit(result._job, limit)
        core.submit([(result._job, 0, func, args, kwds)])
        return result

    def apply(self, func: Callable[..., _R], args: Iterable[Any] = (), kwds: Mapping[str, Any] = {}, *,  # noqa: B006
              timeout: float | None = None) -> _R:
        """The stdlib's; ``timeout`` as ``apply_async``'s."""
        return self.apply_async(func, args, kwds, timeout=timeout).get()

    # The stdlib's maps, plus ``progress``: a tqdm bar advanced as results arrive (_progress.py).

    def map(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = None, *,
            progress: _Progress = None) -> list[_R]:
        """The stdlib's; ``progress=True`` (or a dict of tqdm's options, e.g. ``{"desc": "fit"}``) draws a progress
        bar on stderr where it is a terminal."""
        return self._map_async(func, iterable, mapstar, chunksize, progress=progress).get()

    def starmap(self, func: Callable[..., _R], iterable: Iterable[Iterable[Any]], chunksize: int | None = None, *,
                progress: _Progress = None) -> list[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, starmapstar, chunksize, progress=progress).get()

    def map_async(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = None,
                  callback: Callable[[list[_R]], object] | None = None,
                  error_callback: Callable[[BaseException], object] | None = None, *,
                  progress: _Progress = None) -> mp_pool.MapResult[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, mapstar, chunksize, callback, error_callback, progress=progress)

    def starmap_async(self, func: Callable[..., _R], iterable: Iterable[Iterable[Any]], chunksize: int | None = None,
                      callback: Callable[[list[_R]], object] | None = None,
                      error_callback: Callable[[BaseException], object] | None = None, *,
                      progress: _Progress = None) -> mp_pool.MapResult[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, starmapstar, chunksize, callback, error_callback, progress=progress)

    def _map_async(self, func, iterable, mapper, chunksize=None, callback=None, error_callback=None, *,
                   progress=None):
        self._check_running()
        if not hasattr(iterable, "__len__"):
            iterable = list(iterable)
        if chunksize is None:
            # the stdlib's rule, by the pool's size (its len(self._pool) is 0 while every worker is dead)
            chunksize, extra = divmod(len(iterable), self._processes * 4)
            if extra:
                chunksize += 1
        if len(iterable) == 0:
            chunksize = 0
        result = self._result(lambda: MapResult(self._cache, chunksize, len(iterable), callback, error_callback), func,
                              chunk_sizes(len(iterable), chunksize), progress, len(iterable))
        self._core.submit(_guarded(result._job, mapper, _chunks(func, iterable, chunksize)))
        return result

    def imap(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = 1, *,  # type: ignore[override]
             progress: _Progress = None) -> Iterator[_R]:
        """The stdlib's, with ``progress`` as ``map``'s (its total unknown until the iterable is read to its end,
        where it has no ``len``)."""
        return self._imap(IMapIterator, func, iterable, chunksize, progress)

    def imap_unordered(self, func: Callable[[_S], _R], iterable: Iterable[_S],  # type: ignore[override]  # as imap
                       chunksize: int | None = 1, *, progress: _Progress = None) -> Iterator[_R]:
        """The stdlib's, with ``progress`` as ``imap``'s."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, progress)

    def _imap(self, result_type, func, iterable, chunksize, progress):
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize!r}")
        total = len(iterable) if hasattr(iterable, "__len__") else None
        if chunksize == 1:
            result = self._result(lambda: result_type(self._cache), func, None, progress, total)
            self._core.submit(_guarded(result._job, func, iterable), result._set_length)
            return result
        sizes: list[int] = []
        result = self._result(lambda: result_type(self._cache), func, sizes, progress, total)
        result._chunksize = chunksize
        self._core.submit(_guarded(result._job, mapstar, counted(_chunks(func, iterable, chunksize), sizes)),
                          result._set_length)
        return (item for chunk in result for item in chunk)

    def close(self) -> None:
        util.debug("closing pool")
        self._core.close()

    def terminate(self) -> None:
        """The stdlib's; the progress bars of the maps left unfinished close."""
        util.debug("terminating pool")
        try:
            self._terminate()
        finally:
            for result in list(self._cache.values()):
                bar = getattr(result, "_progress", None)
                if bar is not None:
                    bar.close()

    def join(self) -> None:
        util.debug("joining pool")
        self._core.join()

    def __enter__(self) -> Self:
        self._check_running()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.terminate()

    def __reduce__(self):
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    def __repr__(self) -> str:
        cls = type(self)
        return f"<{cls.__module__}.{cls.__qualname__} state={self._state} pool_size={len(self._pool)}>"

    # Copy globals as defaults: they are there during interpreter shutdown, when the pool may be collected.
    def __del__(self, _warn=warnings.warn, RUN=RUN):
        core = getattr(self, "_core", None)
        if core is not None and core.state == RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)
            core.wake()  # (quiet: a pool already torn down at exit has its notifier closed)
