"""The result objects of a pool call, and the cache of pending ones (adapted from CPython's
Lib/multiprocessing/pool.py, 3.11-3.15 alike, Copyright (c) 2006-2008 R Oudkerk, licensed to the PSF
under a Contributor Agreement; this adaptation is under the PSF License Agreement, as the original).

What changed from the stdlib's, and why:

- Each class subclasses the stdlib's of the same name (``isinstance(r, multiprocessing.pool.AsyncResult)``
  holds) and overrides every method: none of the stdlib's private ones is called.
- ``_set`` always completes what it completes (the event set, the result out of the cache) even when a
  callback raises, and then raises that error for the handler to log: the stdlib's result handler thread
  died there and every later result hung.
- ``_abort(error)`` fails whatever is still pending at once (the pool broke: Note [helper threads]); a
  map's chunks, an iterator's items not yet delivered.
- ``describe(i)`` names task ``i`` for errors (its function, a chunk's items); a failed map keeps its length
  apart from its value (the stdlib's holds the error there: a second lost chunk could not be named).
- A progress bar (``_progress``, from mp_reductions' progress_bar) is advanced by ``_set`` itself.
- ``ApplyResult`` waits on a lock held until it is set (``Done``), not a ``threading.Event``: the Event's
  Condition cost ~4 us to make and as much again to set and wait on (per 1,000 ``apply_async``, fork: the
  caller's CPU 16.5 -> 7.3 ms).
"""

from __future__ import annotations

import collections
import itertools
import reprlib
import threading
import types
from multiprocessing import TimeoutError
from multiprocessing import pool as mp_pool
from typing import Any

job_counter = itertools.count()  # one per process: job numbers are the pool's keys (and mp-dask's)

_SHORT = reprlib.Repr()
_SHORT.maxother = _SHORT.maxstring = 200


def short_repr(obj) -> str:
    """``repr(obj)`` cut short, for messages."""
    return _SHORT.repr(obj)


def call_repr(args, kwds) -> str:
    """``(1, 'a', key=2)``, each cut short."""
    parts = [_SHORT.repr(a) for a in args] + [f"{k}={_SHORT.repr(v)}" for k, v in kwds.items()]
    return f"({', '.join(parts)})"


class Cache(dict):
    """The pending results of a pool by job. ``on_empty`` (a callable, or None) is called when the cache
    empties once ``closing``: a closed pool's worker handler waits for that, and waking it at the end of
    every call cost the parent ~150 us of CPU a ``map``. ``inputs``: job -> the unshared arrays its
    messages sent (_reductions Note [inputs once per call])."""

    closing = False

    def __init__(self, on_empty=None):
        super().__init__()
        self.on_empty = on_empty
        self.inputs: dict = {}

    def __delitem__(self, job):
        dict.__delitem__(self, job)
        self.inputs.pop(job, None)
        if not self and self.closing and self.on_empty is not None:
            self.on_empty()


_setting = threading.Lock()  # Done.set's: sets of different results never wait long for one another


class Done:
    """``threading.Event`` for one result (is_set / set / wait), ~10 times cheaper to make and use. A lock
    held from creation until ``set``: a waiter acquires it once set (or times out), then releases it for the
    next waiter."""

    __slots__ = ("_lock", "_flag")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with _setting:  # once: a second set must not release a waiter's hold
            if self._flag:
                return
            self._flag = True
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._flag and self._lock.acquire(True, -1 if timeout is None else max(timeout, 0)):
            self._lock.release()
        return self._flag


class _Pending:
    """What every result object of a pool call shares: its progress bar, its leaving the cache, its name in
    messages."""

    _job: int
    _cache: Cache
    _pool: Any = None  # the front it keeps alive while pending
    _limit: float | None = None  # seconds: the call's own time limit (watchdog Note [task timeouts])
    _call: str | None = None  # its arguments, cut short, for TaskTimeoutError's message
    _func: Any = None  # the function its tasks call, for messages
    _progress: Any = None  # a ProgressBar advanced as results arrive, or None
    _sizes: Any = None  # items per task for the bar (None: one each)
    _chunksize = 1
    alone = False  # its tasks go to the workers one to a message, never batched (slots Note [batches])

    def _advance(self, i: int, ok: bool) -> None:
        bar = self._progress
        if bar is not None:
            bar.add(1 if self._sizes is None else self._sizes[i] if i < len(self._sizes) else 0, ok)

    def _leave(self) -> None:
        self._pool = None
        try:
            del self._cache[self._job]
        except KeyError:  # aborted meanwhile
            pass

    def describe(self, i: int) -> str | None:
        """Task ``i`` for a message: its function's name, a call's arguments (with a limit), a chunk's items."""
        func = self._func
        if func is None:
            return None
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or _SHORT.repr(func)
        if self._call is not None:
            return f"{name}{self._call}"
        if self._chunksize > 1:
            return f"{name}, items {i * self._chunksize}-{self._last_item(i)}"
        return name

    def _last_item(self, i: int) -> str:
        return f"{(i + 1) * self._chunksize - 1} at most"


class ApplyResult(_Pending, mp_pool.ApplyResult):
    """The result of ``apply_async``: the stdlib's API (``ready``, ``successful``, ``wait``, ``get``)."""

    kind = "apply"

    def __init__(self, cache, callback=None, error_callback=None):
        self._event = Done()
        self._job = next(job_counter)
        self._cache = cache
        self._callback = callback
        self._error_callback = error_callback
        cache[self._job] = self

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: float | None = None):
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        if self._success:
            return self._value
        raise self._value

    def _set(self, i: int, obj) -> None:
        self._advance(i, obj[0] is True)
        self._success, self._value = obj
        self._complete()

    def _complete(self) -> None:
        """Call the callback, then mark it ready and leave the cache whatever the callback did (a raising
        callback's error is raised after, for the handler to log)."""
        try:
            if self._success and self._callback:
                self._callback(self._value)
            elif not self._success and self._error_callback:
                self._error_callback(self._value)
        finally:
            self._event.set()
            self._leave()

    def _abort(self, error: BaseException) -> None:
        """Fail now with ``error`` (the pool broke), if not ready yet."""
        if not self.ready():
            self._success, self._value = False, error
            self._complete()

    __class_getitem__ = classmethod(types.GenericAlias)  # type: ignore[var-annotated]  # (Generic's, typed)


AsyncResult = ApplyResult


class MapResult(ApplyResult, mp_pool.MapResult):
    """The result of ``map_async`` / ``starmap_async``: its chunks' lists joined, or the first error."""

    kind = "map"
    once_per_call = True  # an array given to several of its tasks is copied once (_reductions Note)

    def __init__(self, cache, chunksize: int, length: int, callback=None, error_callback=None):
        ApplyResult.__init__(self, cache, callback, error_callback)
        self._success = True
        self._value: list | BaseException = [None] * length
        self._length = length
        self._chunksize = chunksize
        if chunksize <= 0:
            self._number_left = 0
            self._event.set()
            self._leave()
        else:
            self._number_left = length // chunksize + bool(length % chunksize)

    def _set(self, i: int, success_result) -> None:
        success, result = success_result
        self._advance(i, success is True)
        self._number_left -= 1
        if success and self._success:
            self._value[i * self._chunksize:(i + 1) * self._chunksize] = result  # type: ignore[index]
        elif not success and self._success:  # only the first error is kept
            self._success, self._value = False, result
        if self._number_left == 0:  # ready once every chunk is in
            self._complete()

    def _abort(self, error: BaseException) -> None:
        if not self.ready():
            self._number_left = 0
            if self._success:
                self._success, self._value = False, error
            self._complete()

    def _last_item(self, i: int) -> str:
        return str(min((i + 1) * self._chunksize, self._length) - 1)


class IMapIterator(_Pending, mp_pool.IMapIterator):
    """The iterator of ``imap``: results in order, each item's error raised at its place."""

    kind = "imap"
    once_per_call = True

    def __init__(self, cache):
        self._cond = threading.Condition(threading.Lock())
        self._job = next(job_counter)
        self._cache = cache
        self._items: collections.deque = collections.deque()
        self._index = 0
        self._length: int | None = None
        self._unsorted: dict = {}
        cache[self._job] = self

    def __iter__(self):
        return self

    def next(self, timeout: float | None = None):
        with self._cond:
            try:
                item = self._items.popleft()
            except IndexError:
                if self._index == self._length:
                    raise StopIteration from None
                self._cond.wait(timeout)
                try:
                    item = self._items.popleft()
                except IndexError:
                    if self._index == self._length:
                        raise StopIteration from None
                    raise TimeoutError from None
        success, value = item
        if success:
            return value
        raise value

    __next__ = next

    def _set(self, i: int, obj) -> None:
        self._advance(i, obj[0] is True)
        with self._cond:
            if self._index == i:
                self._items.append(obj)
                self._index += 1
                while self._index in self._unsorted:
                    self._items.append(self._unsorted.pop(self._index))
                    self._index += 1
                self._cond.notify()
            else:
                self._unsorted[i] = obj
            if self._index == self._length:
                self._leave()

    def _set_length(self, length: int) -> None:
        bar = self._progress
        if bar is not None:
            bar.expect(length if self._sizes is None else sum(self._sizes))
        with self._cond:
            self._length = length
            if self._index == self._length:
                self._cond.notify()
                self._leave()

    def _abort(self, error: BaseException) -> None:
        """The items delivered stay; the next one raises ``error``, and the iteration ends there."""
        with self._cond:
            if self._length is not None and self._index >= self._length:
                return
            self._unsorted.clear()
            self._items.append((False, error))
            self._index += 1
            self._length = self._index
            self._cond.notify_all()
            self._leave()


class IMapUnorderedIterator(IMapIterator, mp_pool.IMapUnorderedIterator):
    """The iterator of ``imap_unordered``: results as they come."""

    kind = "imap_unordered"

    def _set(self, i: int, obj) -> None:
        self._advance(i, obj[0] is True)
        with self._cond:
            self._items.append(obj)
            self._index += 1
            self._cond.notify()
            if self._index == self._length:
                self._leave()
