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

The backend takes joblib's options for process backends, the same way through
``parallel_config(backend="arraymp", ...)`` (or ``parallel_backend``) and
``Parallel(backend="arraymp", ...)``, and refuses any other with TypeError
through either: ``initializer`` and ``initargs`` (called in every worker as
it starts, also in one that replaces a dead or retired worker),
``idle_worker_timeout``, ``maxtasksperchild``, ``context`` (a multiprocessing
context, or its name; through ``parallel_config`` only, as for joblib's
multiprocessing backend: ``Parallel`` passes every backend joblib's own
default context), plus ours, ``start_method`` and ``task_timeout``;
joblib's own (``n_jobs``, ``batch_size``, ``max_nbytes``, ``mmap_mode``,
``inner_max_num_threads``, ``prefer``, ``require``, ``verbose``,
``temp_folder``, which changes nothing: no array goes through a file).

Workers are kept between calls, as loky's reusable executor: every call with
the same ``n_jobs``, start method, thread limits, ``maxtasksperchild`` and an
equal initializer with equal ``initargs`` uses the same pool, until it has
been idle for ``idle_worker_timeout`` seconds (300) or :func:`shutdown` is
called. The start method is ``start_method="fork" | "spawn" | "forkserver"``,
by default arraymp's (the stdlib's current one, or the platform's default in
a process whose start method is another library's, such as a loky worker's).
fork starts fastest; spawn and forkserver start clean interpreters, which is
what to use when the caller runs threads or holds a CUDA context. A function
or class that pickle cannot send by name (a lambda, a closure, a class defined
in a function, one defined in a notebook or by ``python -c``), wherever it is
in a task (the ``delayed`` function, its arguments and keyword arguments, a
pipeline's step), goes by value with cloudpickle, as loky sends it; everything
else, arrays included, goes by name and through arraymp's reductions (the
Pool's pickler: mp_reductions' _byvalue Note [by value]).

As under loky: an exception in a task is raised in the caller with the
worker's traceback as its ``__cause__``, and the remaining tasks are
cancelled (the pool is terminated and restarted, unless another call has tasks
in it: then they run to their end and their results are dropped); ``timeout=``
works; a worker that dies (a signal, the out-of-memory killer) fails its task
with ``arraymp.WorkerLostError`` instead of hanging; ``n_jobs=-1`` uses every
CPU; ``batch_size="auto"`` batches short tasks; ``task_timeout=`` (seconds:
``parallel_config(backend="arraymp", task_timeout=30)``) ends a task that runs
longer, measured from its start in its worker (the worker gets SIGTERM, then
SIGKILL), which Parallel raises as ``arraymp.TaskTimeoutError`` naming the
call, cancelling the rest as for any task's error; tasks then go one per
batch, so the limit is each task's (an explicit ``batch_size`` puts that many
under one limit). ``return_as="generator"`` and ``"generator_unordered"``
work; under ``"generator_unordered"`` each of joblib's batches goes to the
workers in a message of its own (``apply_async(alone=True)``), so a fast
result is never held behind a slow task. A ``Parallel`` call inside a task
runs on threads (sequentially one level further down), as under loky; one
that names the arraymp backend there runs with ``n_jobs=1`` and warns: the
workers are daemonic, as the stdlib Pool's. Workers limit the threads of BLAS
and OpenMP to ``cpu_count() // n_jobs`` (or ``inner_max_num_threads``),
through the environment and threadpoolctl when it is installed. joblib has no
entry point for backends: ``import arraymp.joblib`` is what registers it.
"""

from __future__ import annotations

import threading
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

import numpy as np
from mp_reductions import TaskTimeoutError, check_timeout, is_shared
from mp_reductions import call_repr as _call_repr

import arraymp

from ._joblibpool import _abort, _acquire, _ready, _Workers, shutdown

__all__ = ["ArraympBackend", "shutdown"]

_START_METHODS = ("fork", "spawn", "forkserver")
# The backend's own options, taken the same way from either entry: ``parallel_config(backend="arraymp", ...)`` /
# ``parallel_backend("arraymp", ...)`` (the constructor) and ``Parallel(backend="arraymp", ...)`` (configure, for
# that call). loky's and multiprocessing's (joblib's user guide), then ours; their defaults.
_OPTIONS = {
    "initializer": None,
    "initargs": (),
    "idle_worker_timeout": 300,
    "maxtasksperchild": None,
    "context": None,
    "start_method": None,
    "task_timeout": None,
}


class ArraympBackend(AutoBatchingMixin, joblib.ParallelBackendBase):
    """joblib's backend over arraymp's Pool (registered as ``"arraymp"``): see the module's docstring.

    ``initializer``, ``initargs``: a function called with these arguments in every worker as it starts (loky's and
    multiprocessing's option); ``idle_worker_timeout``: seconds an idle pool is kept for the next call (300, as
    loky's); ``maxtasksperchild``: tasks a worker runs before a fresh one replaces it (multiprocessing's);
    ``start_method``: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (None: arraymp's default), or ``context``, a
    multiprocessing context of one of them (multiprocessing's); ``task_timeout``: seconds a task may run (None: no
    limit), see the module's docstring. Any other option is refused with TypeError, through either entry.
    """

    supports_retrieve_callback = True
    supports_inner_max_num_threads = True

    def __init__(self, nesting_level=None, inner_max_num_threads=None, **options):
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self._defaults = {**_OPTIONS, **_check_options(options)}  # this backend's, for every call
        self._apply(self._defaults)
        self.parallel = None
        self._key = self._init = None
        self._workers: _Workers | None = None  # the pool this call runs on, as loky's backend names its executor
        self._max_nbytes: int | None = 1_000_000
        self._writable_inputs = False
        self._alone = False  # this call wants each result as its task ends: its batches go alone to the workers
        self._inputs: dict[int, tuple] = {}  # id(array) -> (array, its shared copy): this call's, see _share
        self._inputs_lock = threading.Lock()
        self._batches = 0

    def _apply(self, options: dict) -> None:
        """Make ``options`` (checked) the current call's."""
        self.start_method = options["start_method"]
        self.idle_worker_timeout = options["idle_worker_timeout"]
        self.task_timeout = options["task_timeout"]
        self.initializer, self.initargs = options["initializer"], options["initargs"]
        self.maxtasksperchild = options["maxtasksperchild"]

    # ------------------------------------------------------------------ configuration
    def configure(
        self,
        n_jobs=1,
        parallel=None,
        prefer=None,
        require=None,
        max_nbytes=1_000_000,
        mmap_mode="r",
        temp_folder=None,
        verbose=0,
        context=None,
        **options,
    ):
        """Check the arguments and start the pool (kept for the next calls); the number of workers.

        ``options``: the backend's own given to ``Parallel``, over the constructor's for this call. joblib's:
        ``temp_folder`` and ``verbose`` change nothing (no array goes through a file; the workers log nothing);
        ``context`` is joblib's default multiprocessing context, passed to every backend (ours: ``start_method``,
        or ``context`` given to ``parallel_config``)."""
        call = {**self._defaults, **_check_options(options)}
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self._apply(call)
        # arraymp's default context is the stdlib's current start method, or the platform's default where that is
        # another library's (a loky worker's "loky")
        method = self.start_method or arraymp.get_context().get_start_method()
        if isinstance(max_nbytes, str):
            from joblib.disk import memstr_to_bytes

            max_nbytes = memstr_to_bytes(max_nbytes)
        self._max_nbytes = None if mmap_mode == "c" else max_nbytes
        self._writable_inputs = mmap_mode in ("r+", "w+")
        self._alone = not getattr(parallel, "return_ordered", True)  # return_as="generator_unordered"
        env = self._prepare_worker_env(n_jobs)
        self._key = (n_jobs, method, tuple(sorted(env.items())), self.maxtasksperchild)
        self._init = (self.initializer, tuple(self.initargs))
        self.parallel = parallel
        self._workers = _ready(self._key, self._init, self.idle_worker_timeout)  # started now, as loky's
        return n_jobs

    def effective_n_jobs(self, n_jobs):
        """The number of workers for ``n_jobs`` (-1: every CPU), 1 where a pool cannot start (in a worker)."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if arraymp.current_process().daemon:  # a daemonic pool worker (ours, the stdlib's): no children
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

    # ------------------------------------------------------------------ the calls
    def start_call(self):
        self._forget_inputs()
        self._batches = 0  # batches submitted in this call: the next one's index (joblib dispatches in order)

    def stop_call(self):
        self._forget_inputs()

    def terminate(self):
        """End of a call: the workers stay for the next one (see :func:`shutdown`)."""
        self._forget_inputs()
        self._workers = None
        self.reset_batch_stats()

    def submit(self, func, callback=None):
        """Send a batch (joblib's ``BatchedCalls``) to the pool: an AsyncResult; ``callback`` gets ``(ok, value)``."""
        if self._key is None:
            raise RuntimeError("the arraymp backend was not configured: use it through joblib.Parallel")
        task = _batch_name(func) if self.task_timeout is not None else None  # (its arguments as the caller gave them)
        index, self._batches = self._batches, self._batches + 1
        if hasattr(func, "items"):  # joblib's BatchedCalls: its big inputs shared once
            func.items = self._prepare(func.items)
        workers = self._workers = _acquire(self._key, self._init, self.idle_worker_timeout, self)

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
                                            timeout=self.task_timeout, alone=self._alone)
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
        _abort(self)
        self._forget_inputs()
        self.reset_batch_stats()
        # a managed Parallel (``with Parallel(...) as p``) has a pool ready for its next call, as loky's
        self._workers = _ready(self._key, self._init, self.idle_worker_timeout) if ensure_ready else None

    # ------------------------------------------------------------------ inputs and results
    def _prepare(self, items: list) -> list:
        """A batch's ``(function, args, kwargs)`` items with their big arrays shared; an item with none is kept as it
        is (batches of thousands of tiny tasks pass through here). Functions and classes that pickle cannot send by
        name, anywhere in an item, go by value (the Pool's pickler: mp_reductions' _byvalue Note [by value])."""
        if self._max_nbytes is None:
            return items
        nd, mm = np.ndarray, np.memmap
        out = []
        for item in items:
            f, args, kwargs = item
            changed = False
            for a in args:
                if type(a) is nd or type(a) is mm:
                    args, changed = tuple([self._share(a) for a in args]), True
                    break
            if kwargs:
                for v in kwargs.values():
                    if type(v) is nd or type(v) is mm:
                        kwargs, changed = {k: self._share(v) for k, v in kwargs.items()}, True
                        break
            out.append((f, args, kwargs) if changed else item)
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


def _check_options(options: dict) -> dict:
    """The backend's own options, checked (either entry alike): TypeError for one it does not take."""
    unknown = [name for name in options if name not in _OPTIONS]
    if unknown:
        raise TypeError(
            f"the arraymp backend takes no argument {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(_OPTIONS)} (and joblib's own: n_jobs, batch_size, max_nbytes, mmap_mode, ...)"
        )
    out = dict(options)
    context = out.pop("context", None)
    if context is not None:  # multiprocessing's option: a context, or its name
        method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: context)()
        if out.get("start_method") not in (None, method):
            raise ValueError(f"start_method={out['start_method']!r} and context={context!r} disagree: give one")
        out["start_method"] = method
    if out.get("start_method") is not None and out["start_method"] not in _START_METHODS:
        raise ValueError(f"start_method={out['start_method']!r} is not one of {', '.join(_START_METHODS)}")
    if "task_timeout" in out:
        out["task_timeout"] = check_timeout(out["task_timeout"], "task_timeout")
    if "idle_worker_timeout" in out:
        idle = out["idle_worker_timeout"]
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle >= 0:
            raise ValueError(f"idle_worker_timeout must be a number of seconds (0 or more), not {idle!r}")
    if out.get("initializer") is not None and not callable(out["initializer"]):
        raise TypeError(f"initializer must be a callable, not {type(out['initializer']).__name__}")
    if "initargs" in out:
        out["initargs"] = tuple(out["initargs"])
    tasks = out.get("maxtasksperchild")
    if tasks is not None and (isinstance(tasks, bool) or not isinstance(tasks, int) or tasks <= 0):
        raise ValueError(f"maxtasksperchild must be a positive int or None, not {tasks!r}")
    return out


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


joblib.register_parallel_backend("arraymp", ArraympBackend)
