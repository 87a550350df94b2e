"""The joblib backend's reusable pool (arraymp.joblib): the lifetime of the workers kept between calls.

One pool at a time, shared by the calls with the same ``n_jobs``, start method, thread limits,
``maxtasksperchild`` and an equal initializer, counting the tasks each call has in it: started when a call is
configured (``_ready``) or submits (``_acquire``), closed once idle for ``idle_worker_timeout`` seconds, retired
when a call needs another, terminated when a call aborts alone in it (``_abort``), stopped by :func:`shutdown`
(``arraymp.joblib.shutdown``). Its workers start with ``_init_worker``.
"""

from __future__ import annotations

import collections
import os
import threading

import arraymp


def _init_worker(env: dict, initializer=None, *initargs) -> None:
    """Limit the threads of BLAS / OpenMP in a worker to its share of the CPUs, then call the user's initializer
    (the pool sends it and each of its arguments by value where pickle cannot send them by name)."""
    os.environ.update(env)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(int(env["OMP_NUM_THREADS"]))
    if initializer is not None:
        initializer(*initargs)


class _Workers:
    """One pool shared by the calls with the same key and initializer, with the tasks each call has in it."""

    def __init__(self, key, init, idle: float):
        n_jobs, method, env, maxtasks = key
        initializer, initargs = init
        self.key, self.init, self.idle = key, init, idle
        self.pool = arraymp.get_context(method).Pool(n_jobs, _init_worker, (dict(env), initializer, *initargs),
                                                     maxtasks)
        self.running: collections.Counter = collections.Counter()  # backend -> its tasks in the pool
        self.retired = self.terminated = False
        self.timer: threading.Timer | None = None

    def serves(self, key, init) -> bool:
        """Whether a call with ``key`` and ``init`` may run here (the initializer and its arguments equal, as
        loky reuses its workers; arguments that cannot say so, arrays, must be the same objects)."""
        if self.key != key:
            return False
        try:
            return self.init is init or bool(self.init == init)
        except Exception:  # (an array's == is elementwise)
            return False

    def started(self, call) -> None:  # _LOCK held
        self.running[call] += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def finished(self, call) -> None:
        """A task's result came (in the pool's result handler: the pool is closed from another thread)."""
        with _LOCK:
            if self.terminated:
                return
            self.running[call] -= 1
            if self.running[call] <= 0:
                del self.running[call]
            if not self.running:
                self._close_later(0 if self.retired else self.idle)

    def _close_later(self, delay: float) -> None:  # _LOCK held
        if self.timer is not None:
            self.timer.cancel()
        self.timer = threading.Timer(delay, self._close_if_idle)
        self.timer.daemon = True  # never keeps the interpreter from exiting: the Pool's finalizer ends it
        self.timer.start()

    def _close_if_idle(self) -> None:
        global _CURRENT
        with _LOCK:
            if self.running or self.timer is None or self.timer is not threading.current_thread():
                return
            self.timer = None
            if _CURRENT is self:
                _CURRENT = None
            self.retired = True
        self.close()

    def close(self) -> None:
        self.pool.close()
        self.pool.join()

    def retire(self) -> None:  # _LOCK held
        self.retired = True
        if not self.running:
            self._close_later(0)


_LOCK = threading.Lock()
_CURRENT: _Workers | None = None
_INHERITED: list[_Workers] = []  # a fork child's: its parent's pool, whose threads did not come with the fork


def _after_fork_in_child() -> None:
    """A process forked from one that ran calls (a non-daemonic child, ``os.fork``) starts a pool of its own: the
    parent's is kept referenced, never used nor collected here (its finalizer would nudge the parent's threads)."""
    global _CURRENT, _LOCK
    _LOCK = threading.Lock()
    if _CURRENT is not None:
        _INHERITED.append(_CURRENT)
    _CURRENT = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _current(key, init, idle: float) -> _Workers:  # _LOCK held
    """The pool for ``key`` and ``init``, started if there is none (the one before retired)."""
    global _CURRENT
    w = _CURRENT
    if w is not None and not w.serves(key, init):
        _CURRENT = None
        w.retire()  # closed once its tasks are done
        w = None
    if w is None:
        w = _CURRENT = _Workers(key, init, idle)
    w.idle = idle
    return w


def _ready(key, init, idle: float) -> _Workers:
    """The pool for a call being configured: started now, closed after ``idle`` seconds if no task comes."""
    with _LOCK:
        w = _current(key, init, idle)
        if not w.running:
            w._close_later(idle)
        return w


def _acquire(key, init, idle: float, call) -> _Workers:
    """The pool for ``key`` and ``init`` (started if there is none), with one more task of ``call`` counted in it."""
    with _LOCK:
        w = _current(key, init, idle)
        w.started(call)
        return w


def _abort(call) -> None:
    """Terminate the current pool if only ``call`` has tasks in it."""
    global _CURRENT
    with _LOCK:
        w = _CURRENT
        if w is None or set(w.running) - {call}:
            return
        _CURRENT = None
        w.retired = w.terminated = True
        w.running.clear()
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
    w.pool.terminate()  # outside the lock: its result handler may be waiting for it in finished()


def shutdown() -> None:
    """Stop the workers kept for the next call now (they stop by themselves after ``idle_worker_timeout``).
    Tasks still running are let finish."""
    global _CURRENT
    with _LOCK:
        w, _CURRENT = _CURRENT, None
        if w is None:
            return
        w.retired = True
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
    w.close()
