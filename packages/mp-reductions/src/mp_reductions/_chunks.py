"""``executor_map``: Python 3.14's ``ProcessPoolExecutor.map`` (chunks, ``buffersize``) over any executor's
``submit``, on every Python we support (adapts concurrent/futures/_base.py's ``Executor.map`` and
concurrent/futures/process.py's ``map``, ``_process_chunk`` and ``_chain_from_iterable_of_lists``).

Owned here because those helpers are private to the stdlib and ``buffersize`` is new in 3.14: arraymp's executor
and mp-dask's call this one copy. The chunk function, ``process_chunk``, runs in the workers, so it lives in a
module every worker can import.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
import weakref

from ._progress import progress_bar


def process_chunk(fn, chunk) -> list:
    """Run in a worker: ``fn`` over one chunk of argument tuples."""
    return [fn(*args) for args in chunk]


def _chunks(iterables, chunksize: int):
    """The argument tuples of ``zip(*iterables)`` in tuples of ``chunksize``, read lazily."""
    it = zip(*iterables, strict=False)
    while chunk := tuple(itertools.islice(it, chunksize)):
        yield chunk


def _result_or_cancel(future, timeout=None):
    try:
        try:
            return future.result(timeout)
        finally:
            future.cancel()
    finally:
        del future  # no cycle through the exception's traceback


def executor_map(executor, fn, *iterables, timeout=None, chunksize=1, buffersize=None, progress=None):
    """``executor.map(fn, *iterables, timeout=..., chunksize=..., buffersize=...)`` as Python 3.14's
    ``ProcessPoolExecutor.map``: chunks of ``chunksize`` calls, each submitted with ``executor.submit``; with
    ``buffersize``, at most that many chunks submitted and not yet yielded, the iterables read as results are
    taken; results in order; ``timeout`` for the whole iteration (TimeoutError). What is not yielded is cancelled
    when the iterator is closed. ``progress=True`` (or a dict of tqdm's options) draws a progress bar on stderr
    where it is a terminal, advanced as calls finish (Pool.map's ``progress``)."""
    if chunksize < 1:
        raise ValueError("chunksize must be >= 1.")
    if buffersize is not None and not isinstance(buffersize, int):
        raise TypeError("buffersize must be an integer or None")
    if buffersize is not None and buffersize < 1:
        raise ValueError("buffersize must be None or > 0")
    if progress is not None and progress is not False:
        return _map_with_progress(executor, fn, iterables, timeout, chunksize, buffersize, progress)
    end_time = None if timeout is None else timeout + time.monotonic()
    call = functools.partial(process_chunk, fn)
    chunks = _chunks(iterables, chunksize)
    futures = collections.deque(executor.submit(call, chunk) for chunk in itertools.islice(chunks, buffersize))
    executor_ref = weakref.ref(executor)  # the iterator does not keep the executor alive

    def results():
        try:
            while futures:
                if buffersize and (ex := executor_ref()) is not None and (chunk := next(chunks, None)) is not None:
                    futures.append(ex.submit(call, chunk))
                ex = None
                # popped, never kept in a local: a done future holds its exception and so its traceback
                yield _result_or_cancel(futures.popleft(), None if end_time is None else end_time - time.monotonic())
        finally:
            for future in futures:
                future.cancel()

    return _chain(results())


def _map_with_progress(executor, fn, iterables, timeout, chunksize, buffersize, progress):
    """executor_map's body with a progress bar: each future's calls are counted once, by its done-callback (the
    thread that sets it) or, if that has not run yet, before its result is yielded; the bar closes when the
    iteration ends (its end, an error, the iterator closed). Kept apart so that a map without a bar runs
    executor_map's own body."""
    total = min(map(len, iterables)) if all(hasattr(it, "__len__") for it in iterables) else None
    bar = progress_bar(progress, total)
    end_time = None if timeout is None else timeout + time.monotonic()
    call = functools.partial(process_chunk, fn)
    chunks = _chunks(iterables, chunksize)
    counts = {}  # id(future) -> its calls, until counted (not the future: a failed one holds its traceback)
    submitted = 0
    lock = threading.Lock()

    def count(future) -> None:
        with lock:  # held while the bar counts: the iteration's end must not close it in between
            if not future.done():  # a timeout: never counted
                return
            n = counts.pop(id(future), None)
            if n is not None and not future.cancelled():
                bar.add(n, future.exception() is None)

    def submit(ex, chunk):
        nonlocal submitted
        future = ex.submit(call, chunk)
        submitted += len(chunk)
        with lock:
            counts[id(future)] = len(chunk)
        future.add_done_callback(count)  # at once if it is done already
        return future

    try:
        futures = collections.deque(submit(executor, chunk) for chunk in itertools.islice(chunks, buffersize))
    except BaseException:
        bar.close()
        raise
    if not buffersize:  # every chunk submitted: the total is known
        bar.expect(submitted)
    executor_ref = weakref.ref(executor)

    def results():
        try:
            while futures:
                if buffersize and (ex := executor_ref()) is not None and bar.total != submitted:
                    chunk = next(chunks, None)
                    if chunk is not None:
                        futures.append(submit(ex, chunk))
                    else:
                        bar.expect(submitted)
                ex = None
                future = futures.popleft()
                try:
                    value = _result_or_cancel(future, None if end_time is None else end_time - time.monotonic())
                finally:
                    count(future)
                    del future
                yield value
        finally:
            for future in futures:
                future.cancel()
            bar.close()

    return _chain(results())


def _chain(lists):
    """The items of each list in turn, each list emptied as it goes (the iterator keeps no result it yielded)."""
    for items in lists:
        items.reverse()
        while items:
            yield items.pop()
