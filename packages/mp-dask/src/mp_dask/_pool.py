"""``Pool`` on a Dask cluster: the stdlib's API and result objects, tasks run by Dask.

Adapts ``multiprocessing/pool.py``: ``ApplyResult``, ``MapResult``,
``IMapIterator`` and ``IMapUnorderedIterator`` are mp_reductions' (the stdlib's
API), fed by the callbacks of our tasks (see _tasks.py) instead of a
result-handler thread.
``processes`` only sizes the default chunks (Dask decides where and how many
tasks run at once: one per worker thread); ``maxtasksperchild`` is checked, and
not applied, with a warning (see ``_tasks.not_applied``). ``task_timeout`` and
``apply_async(timeout=)`` limit a task's time as mp_reductions.Pool's do, by
ending the worker running it (Note [Dask task timeouts] in _timeouts.py).
"""

from __future__ import annotations

import itertools

from mp_reductions import (
    ApplyResult,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    check_timeout,
    progress_bar,
    track_progress,
)

from ._tasks import Tasks, apply_star, call_star, map_star, not_applied, starmap_star

RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"


def _chunks(items: list, size: int) -> list:
    it = iter(items)
    return list(iter(lambda: list(itertools.islice(it, size)), []))


class Pool:
    """``multiprocessing.pool.Pool`` whose tasks run on the workers of a Dask cluster."""

    _state = TERMINATE  # a half-built pool is safe to terminate

    def __init__(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None, *, context,
                 task_timeout=None):
        task_timeout = check_timeout(task_timeout, "task_timeout")
        if processes is not None and processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if maxtasksperchild is not None:
            not_applied("maxtasksperchild")
        self._cache: dict = {}
        self._tasks = Tasks(context, initializer, initargs, task_timeout)
        self._processes = processes or context.cpu_count()
        self._state = RUN

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _kept(self, result):
        """``result``, which keeps this pool alive until it is set (as the stdlib's results keep theirs)."""
        result._pool = self
        return result

    def _submit(self, result, star, func, payloads, kind: str, limit=None) -> None:
        self._tasks.submit(star, func, payloads, lambda i, success, value: result._set(i, (success, value)), kind,
                           limit)

    def apply(self, func, args=(), kwds={}, *, timeout=None):  # noqa: B006 - the stdlib's signature
        return self.apply_async(func, args, kwds, timeout=timeout).get()

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None, *,  # noqa: B006
                    timeout=None):
        """The stdlib's; ``timeout``: this call's time limit in seconds instead of the pool's ``task_timeout``.
        The result's ``get(timeout)`` only stops waiting, as the stdlib's."""
        limit = check_timeout(timeout, "timeout")
        self._check_running()
        result = self._kept(ApplyResult(self._cache, callback, error_callback))
        self._submit(result, apply_star, func, [(tuple(args), dict(kwds))], "apply", limit)
        return result

    # ``progress=True`` (or a dict of tqdm's options): mp_reductions.Pool's progress bar, advanced as results arrive.

    def map(self, func, iterable, chunksize=None, *, progress=None):
        return self._map_async(func, iterable, map_star, chunksize, progress=progress).get()

    def starmap(self, func, iterable, chunksize=None, *, progress=None):
        return self._map_async(func, iterable, starmap_star, chunksize, progress=progress).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None, *, progress=None):
        return self._map_async(func, iterable, map_star, chunksize, callback, error_callback, progress=progress)

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None, *, progress=None):
        return self._map_async(func, iterable, starmap_star, chunksize, callback, error_callback,
                               progress=progress)

    def _map_async(self, func, iterable, star, chunksize=None, callback=None, error_callback=None, *,
                   progress=None):
        self._check_running()
        items = list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            chunksize += bool(extra)
        if chunksize < 1 and items:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        chunks = _chunks(items, chunksize) if items else []
        bar = progress_bar(progress, len(items))
        result = self._kept(MapResult(self._cache, chunksize if items else 0, len(items), callback, error_callback))
        track_progress(result, bar, [len(c) for c in chunks])
        self._submit(result, star, func, chunks, "map")
        return result

    def imap(self, func, iterable, chunksize=1, *, progress=None):
        return self._imap(IMapIterator, func, iterable, chunksize, "imap", progress)

    def imap_unordered(self, func, iterable, chunksize=1, *, progress=None):
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, "imap_unordered", progress)

    def _imap(self, result_type, func, iterable, chunksize, kind, progress=None):
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        items = list(iterable)
        bar = progress_bar(progress, len(items))
        result = self._kept(result_type(self._cache))
        payloads = items if chunksize == 1 else _chunks(items, chunksize)
        track_progress(result, bar, None if chunksize == 1 else [len(c) for c in payloads])
        self._submit(result, call_star if chunksize == 1 else map_star, func, payloads, kind)
        result._set_length(len(payloads))
        return result if chunksize == 1 else (item for chunk in result for item in chunk)

    def close(self) -> None:
        if self._state == RUN:
            self._state = CLOSE

    def terminate(self) -> None:
        """Cancel every pending task (its result then raises CancelledError) and let the workers go."""
        if not hasattr(self, "_tasks"):
            return
        self._state = TERMINATE
        self._tasks.cancel()
        self._tasks.wait()
        self._tasks.close()

    def join(self) -> None:
        if self._state == RUN:
            raise ValueError("Pool is still running")
        self._tasks.wait()
        self._tasks.close()

    def __enter__(self):
        self._check_running()
        return self

    def __exit__(self, *exc):
        self.terminate()

    def __reduce__(self):
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    def __repr__(self):
        return f"<{type(self).__name__} state={self._state} pending={len(self._tasks.pending)}>"
