"""joblib's backend ``"arraymp"``: ``joblib.Parallel`` and scikit-learn's ``n_jobs`` on arraymp's Pool.

::

    import joblib
    import arraymp.joblib                       # registers the backend "arraymp" with joblib

    with joblib.parallel_config(backend="arraymp", n_jobs=4):
        scores = cross_val_score(model, X, y, cv=4)          # scikit-learn's n_jobs runs here too
        results = joblib.Parallel()(joblib.delayed(f)(X, i) for i in range(64))

What moves by shared memory, and how:

- **Results**: each batch's results come back through the Pool's channel; an
  array of 64 KiB or more (``arraymp.set_inline_threshold``) is copied once
  into shared memory by the worker and arrives as a view of it, where loky
  pickles every result through a pipe. A result that is itself a view of an
  input shared for the call (below) arrives as a writable copy, as under loky.
- **Inputs**: an array argument (``numpy.ndarray`` or ``numpy.memmap``) of
  ``max_nbytes`` (joblib's setting, 1 MB by default) or more, given at the top
  level of a ``delayed`` call, is copied into shared memory once per
  ``Parallel`` call however many tasks take it; each task sends a handle.
  Workers see it read-only (loky's default ``mmap_mode="r"``);
  ``mmap_mode="r+"`` or ``"w+"`` makes it writable (the call's later tasks see
  the writes, the caller's array never does); ``mmap_mode="c"`` or
  ``max_nbytes=None`` gives each task a copy of its own. An array already in
  shared memory (``arraymp.empty_shared``, ``share_memory``, a received one)
  always travels as a handle, writable: workers write into the caller's
  memory, which is how to fill a result in place. Smaller arrays and arrays
  inside other objects go as any argument of our Pool does (inline below
  64 KiB, else one segment per task).

Workers are kept between calls, as loky's reusable executor: every call with
the same ``n_jobs``, start method and thread limits uses the same pool, until
it has been idle for ``idle_worker_timeout`` seconds (300) or :func:`shutdown`
is called. The start method is ``start_method="fork" | "spawn" |
"forkserver"`` (``parallel_config(backend="arraymp", start_method="spawn")``
or ``Parallel(backend="arraymp", start_method=...)``), by default arraymp's
(the stdlib's current one). fork starts fastest; spawn and forkserver start
clean interpreters, which is what to use when the caller runs threads or holds
a CUDA context. Lambdas, closures and, under spawn and forkserver, functions
defined interactively (``python -c``, a notebook) are sent with cloudpickle,
as loky sends them (cloudpickle comes with joblib); everything else, arrays
included, goes through arraymp's reductions.

As under loky: an exception in a task is raised in the caller with the
worker's traceback as its ``__cause__``, and the remaining tasks are
cancelled (the pool is terminated and restarted); ``timeout=`` works; a worker
that dies (a signal, the out-of-memory killer) fails its task with
``arraymp.WorkerLostError`` instead of hanging; ``n_jobs=-1`` uses every CPU;
``batch_size="auto"`` batches short tasks; ``task_timeout=`` (seconds, with the
other backend options: ``parallel_config(backend="arraymp", task_timeout=30)``)
ends a task that runs longer, measured from its start in its worker (the
worker gets SIGTERM, then SIGKILL), which Parallel raises as
``arraymp.TaskTimeoutError`` naming the call, cancelling the rest as for any
task's error; tasks then go one per batch, so the limit is each task's (an
explicit ``batch_size`` puts that many under one limit). ``return_as="generator"`` and
``"generator_unordered"`` work. A ``Parallel`` call inside a task runs
sequentially (loky runs it on threads at the first level). Workers limit the
threads of BLAS and OpenMP to ``cpu_count() // n_jobs`` (or
``inner_max_num_threads``), through the environment and threadpoolctl when it
is installed. joblib has no entry point for backends: ``import arraymp.joblib``
is what registers it.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import threading
import types
import warnings
from multiprocessing import pool as _mp_pool

try:
    import joblib
    from joblib._parallel_backends import AutoBatchingMixin, FallbackToBackend, SequentialBackend
except ImportError as _exc:
    raise ImportError(
        f"arraymp.joblib needs joblib ({_exc}); install it with `pip install 'arraymp[joblib]'` (from "
        "a clone: `python3 -m pip install --no-cache-dir ./packages/{shm-core,shm-manager,"
        "mp-reductions,shm-cuda,mp-spawn} '.[joblib]'`)"
    ) from _exc

try:  # joblib vendored it before 1.5; loky uses it when installed
    import cloudpickle
except ImportError:  # pragma: no cover
    try:
        from joblib.externals import cloudpickle
    except ImportError:
        cloudpickle = None

import numpy as np
from mp_reductions import TaskTimeoutError, check_timeout, is_shared
from mp_reductions import call_repr as _call_repr

import arraymp

__all__ = ["ArraympBackend", "shutdown"]

_START_METHODS = ("fork", "spawn", "forkserver")


class ArraympBackend(AutoBatchingMixin, joblib.ParallelBackendBase):
    """joblib's backend over arraymp's Pool (registered as ``"arraymp"``): see the module's docstring.

    ``start_method``: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (None: arraymp's default);
    ``idle_worker_timeout``: seconds an idle pool is kept for the next call (300, as loky's);
    ``task_timeout``: seconds a task may run (None: no limit), see the module's docstring.
    """

    supports_retrieve_callback = True
    supports_inner_max_num_threads = True

    def __init__(
        self,
        nesting_level=None,
        inner_max_num_threads=None,
        start_method=None,
        idle_worker_timeout=300,
        task_timeout=None,
        **backend_kwargs,
    ):
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads, **backend_kwargs)
        _check_start_method(start_method)
        self.start_method = start_method
        self.idle_worker_timeout = idle_worker_timeout
        self.task_timeout = check_timeout(task_timeout, "task_timeout")
        self.parallel = None
        self._key = None
        self._max_nbytes: int | None = 1_000_000
        self._writable_inputs = False
        self._inputs: dict[int, tuple] = {}  # id(array) -> (array, its shared copy): this call's, see _share
        self._inputs_lock = threading.Lock()
        self._batches = 0

    # ------------------------------------------------------------------ configuration
    def configure(
        self,
        n_jobs=1,
        parallel=None,
        prefer=None,
        require=None,
        start_method=None,
        idle_worker_timeout=None,
        task_timeout=None,
        max_nbytes=1_000_000,
        mmap_mode="r",
        temp_folder=None,
        context=None,
        verbose=0,
        **unknown,
    ):
        """Check the arguments, choose the pool (started at the first task); the number of workers."""
        # ``context``: joblib passes the stdlib's default context to every backend; ours is ``start_method``.
        if unknown:
            raise TypeError(
                f"the arraymp backend takes no argument {', '.join(map(repr, unknown))}; it takes "
                "start_method, idle_worker_timeout, task_timeout, max_nbytes and mmap_mode"
            )
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        _check_start_method(start_method)
        method = start_method or self.start_method or arraymp.get_start_method()
        if idle_worker_timeout is not None:
            self.idle_worker_timeout = idle_worker_timeout
        if task_timeout is not None:
            self.task_timeout = check_timeout(task_timeout, "task_timeout")
        if isinstance(max_nbytes, str):
            from joblib.disk import memstr_to_bytes

            max_nbytes = memstr_to_bytes(max_nbytes)
        self._max_nbytes = None if mmap_mode == "c" else max_nbytes
        self._writable_inputs = mmap_mode in ("r+", "w+")
        env = self._prepare_worker_env(n_jobs)
        self._key = (n_jobs, method, tuple(sorted(env.items())))
        self.parallel = parallel
        return n_jobs

    def effective_n_jobs(self, n_jobs):
        """The number of workers for ``n_jobs`` (-1: every CPU), 1 where a pool cannot start (in a worker)."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if arraymp.current_process().daemon:  # a pool worker (ours, the stdlib's, loky's): no children
            if n_jobs != 1:
                warnings.warn(
                    "arraymp-backed parallel loops cannot be nested in a worker process, setting n_jobs=1", stacklevel=3
                )
            return 1
        if not (self.in_main_thread() or self.nesting_level == 0):
            if n_jobs != 1:  # a thread of joblib's threading backend: no fork from there, as loky
                warnings.warn(
                    "arraymp-backed parallel loops cannot be nested below threads, setting n_jobs=1", stacklevel=3
                )
            return 1
        if n_jobs < 0:
            n_jobs = max(joblib.cpu_count() + 1 + n_jobs, 1)
        return n_jobs

    def compute_batch_size(self):
        """joblib's automatic batch size, but 1 under a ``task_timeout``: the limit is each task's."""
        return 1 if self.task_timeout is not None else super().compute_batch_size()

    def get_nested_backend(self):
        """A ``Parallel`` call inside a task runs sequentially."""
        return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None

    # ------------------------------------------------------------------ the calls
    def start_call(self):
        self._forget_inputs()
        self._batches = 0  # batches submitted in this call: the next one's index (joblib dispatches in order)

    def stop_call(self):
        self._forget_inputs()

    def terminate(self):
        """End of a call: the workers stay for the next one (see :func:`shutdown`)."""
        self._forget_inputs()
        self.reset_batch_stats()

    def submit(self, func, callback=None):
        """Send a batch (joblib's ``BatchedCalls``) to the pool: an AsyncResult; ``callback`` gets ``(ok, value)``."""
        if self._key is None:
            raise RuntimeError("the arraymp backend was not configured: use it through joblib.Parallel")
        task = _batch_name(func) if self.task_timeout is not None else None  # (before _prepare wraps it)
        index, self._batches = self._batches, self._batches + 1
        if hasattr(func, "items"):  # joblib's BatchedCalls: its big inputs shared once, its functions portable
            func.items = self._prepare(func.items)
        workers = _acquire(self._key, self.idle_worker_timeout, self)

        def done(value):
            workers.finished(self)
            if callback is not None:
                callback((True, value))

        def failed(error):
            workers.finished(self)
            if isinstance(error, TaskTimeoutError):  # the joblib task's name, not our wrapper's
                error = TaskTimeoutError(error.limit, index, "a joblib.Parallel call", task, error.pid)
                error.add_note("joblib.Parallel raises a task's error and cancels the rest of the call, as loky")
            if callback is not None:
                callback((False, error))

        try:
            return workers.pool.apply_async(_run, (func,), callback=done, error_callback=failed,
                                            timeout=self.task_timeout)
        except BaseException:
            workers.finished(self)
            raise

    apply_async = submit  # the name joblib before 1.5 calls

    def retrieve_result_callback(self, out):
        """The batch's results, or its exception raised (the worker's traceback as its ``__cause__``)."""
        ok, value = out
        if ok and isinstance(value, _Raised):
            ok, value = False, value.error
        if not ok:
            raise value
        return [self._own(r) for r in value]

    def abort_everything(self, ensure_ready=True):
        """After an error or a timeout: terminate the pool, which kills the running tasks (unless another call
        has tasks in it too: then this call's tasks finish and their results are dropped)."""
        _abort(self)  # the next task starts a new pool: ready either way
        self._forget_inputs()
        self.reset_batch_stats()

    # ------------------------------------------------------------------ inputs and results
    def _prepare(self, items: list) -> list:
        """A batch's ``(function, args, kwargs)`` items with their functions portable and their big arrays shared;
        an item with neither is kept as it is (batches of thousands of tiny tasks pass through here)."""
        fork, share, nd, mm = self._key[1] == "fork", self._max_nbytes is not None, np.ndarray, np.memmap
        last_f = last_g = None  # a batch mostly calls one function
        out = []
        for item in items:
            f, args, kwargs = item
            if f is not last_f:
                last_f, last_g = f, _portable(f, fork)
            changed = last_g is not f
            if share:
                for a in args:
                    if type(a) is nd or type(a) is mm:
                        args, changed = tuple([self._share(a) for a in args]), True
                        break
                if kwargs:
                    for v in kwargs.values():
                        if type(v) is nd or type(v) is mm:
                            kwargs, changed = {k: self._share(v) for k, v in kwargs.items()}, True
                            break
            out.append((last_g, args, kwargs) if changed else item)
        return out

    def _share(self, obj):
        """``obj``, or its shared copy when it is a big array (made once per call: see the module docstring)."""
        if type(obj) not in (np.ndarray, np.memmap) or obj.nbytes < max(self._max_nbytes, 1) or obj.dtype.hasobject:
            return obj
        if is_shared(obj):
            return obj
        with self._inputs_lock:  # joblib dispatches from its callback thread too
            entry = self._inputs.get(id(obj))
            if entry is None:  # a memory map is read once here (pickled, it would be copied into every task)
                copy = arraymp.share_memory(obj.view(np.ndarray) if type(obj) is np.memmap else obj)
                if not self._writable_inputs:
                    copy.flags.writeable = False
                entry = self._inputs[id(obj)] = (obj, copy)  # the original kept: its id stays its own
            return entry[1]

    def _own(self, result):
        """A result that views an input shared for this call, as a copy of its own (loky's results are)."""
        if type(result) is np.ndarray and not result.flags.writeable and is_shared(result) and self._inputs:
            with self._inputs_lock:
                copies = [copy for _, copy in self._inputs.values()]
            if any(np.may_share_memory(result, c) for c in copies):
                return result.copy()
        return result

    def _forget_inputs(self) -> None:
        with self._inputs_lock:
            self._inputs = {}  # tasks in flight hold their own references to the segments


def _check_start_method(method) -> None:
    if method is not None and method not in _START_METHODS:
        raise ValueError(f"start_method={method!r} is not one of {', '.join(_START_METHODS)}")


# ---------------------------------------------------------------------- in the workers
class _Raised:
    """A task's KeyboardInterrupt or SystemExit, returned (the Pool's worker would die of it), raised in the caller."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def __reduce__(self):
        return _Raised, (self.error,)


def _batch_name(batch) -> str | None:
    """``f(1, x=2)``, a batch's first call (and how many more), for a TaskTimeoutError."""
    items = getattr(batch, "items", None)
    if not items:
        return None
    func, args, kwargs = items[0]
    name = getattr(func, "__qualname__", None) or type(func).__name__
    more = f" and {len(items) - 1} more calls" if len(items) > 1 else ""
    return f"{name}{_call_repr(args, kwargs)}{more}"


def _run(batch):
    try:
        return batch()
    except Exception:
        raise  # the Pool sends it with the worker's traceback
    except BaseException as e:
        return _Raised(_mp_pool.ExceptionWithTraceback(e, e.__traceback__))


def _init_worker(env: dict) -> None:
    """Limit the threads of BLAS / OpenMP in a worker to its share of the CPUs."""
    os.environ.update(env)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(int(env["OMP_NUM_THREADS"]))


def _portable(func, fork: bool):
    """``func``, or a stand-in that sends it with cloudpickle when pickle would send it by a name the worker
    cannot look up (a lambda, a closure, a function of an interactive ``__main__`` in a worker that did not fork)."""
    if not isinstance(func, types.FunctionType):
        return func
    module = sys.modules.get(func.__module__)
    obj = module
    for part in func.__qualname__.split("."):
        obj = getattr(obj, part, None)
    # A worker that did not fork imports the main script as __mp_main__ (multiprocessing's spawn.prepare), so a
    # function of a main module with a file is found there; an interactive session's is not.
    if cloudpickle is None or obj is func and (fork or func.__module__ != "__main__" or hasattr(module, "__file__")):
        return func
    return _CloudFunction(func)


class _CloudFunction:
    __slots__ = ("func",)

    def __init__(self, func):
        self.func = func

    def __reduce__(self):
        return pickle.loads, (cloudpickle.dumps(self.func),)  # rebuilt as the function itself


# ---------------------------------------------------------------------- the reusable pool
class _Workers:
    """One pool shared by the calls with the same key, with the tasks each call has in it."""

    def __init__(self, key, idle: float):
        n_jobs, method, env = key
        self.key, self.idle = key, idle
        self.pool = arraymp.get_context(method).Pool(n_jobs, _init_worker, (dict(env),))
        self.running: collections.Counter = collections.Counter()  # backend -> its tasks in the pool
        self.retired = self.terminated = False
        self.timer: threading.Timer | None = None

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


def _acquire(key, idle: float, call) -> _Workers:
    """The pool for ``key`` (started if there is none), with one more task of ``call`` counted in it."""
    global _CURRENT
    with _LOCK:
        w = _CURRENT
        if w is not None and w.key != key:
            _CURRENT = None
            w.retire()  # closed once its tasks are done
            w = None
        if w is None:
            w = _CURRENT = _Workers(key, idle)
        w.idle = idle
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


joblib.register_parallel_backend("arraymp", ArraympBackend)
