"""Functions run in pool workers (importable under spawn and forkserver)."""

import multiprocessing
import os
import time

import mp_reductions as mpr
import numpy as np

VALUE = None


def square(x):
    return x * x


def add(x, y):
    return x + y


def double(a):
    return a * 2


def big(i):
    return np.full((300, 300), i, np.float32)  # 360 KB: by shared memory


def five_arrays(i):
    return [np.full((100, 100), i, np.float32) for _ in range(5)]


def getpid(_=None):
    return os.getpid()


def pid_then_sleep(slots, k, seconds):
    """Publish this worker's pid in ``slots[k]`` (a shared array), then block."""
    slots[k] = os.getpid()
    time.sleep(seconds)
    return k


def square_or_block(x, slots, blocked=3):
    if x == blocked:
        pid_then_sleep(slots, 0, 60)
    return x * x


def set_value(v):
    global VALUE
    VALUE = v


def get_value(_=None):
    return VALUE


def fail(x):
    raise ValueError(f"bad {x}")


def share_results(strategy):
    """Initializer: every result goes by shared memory, with ``strategy``."""
    mpr.init_reductions()
    mpr.set_inline_threshold(0)
    mpr.set_sharing_strategy(strategy)


def square_or_block_pair(args):
    return square_or_block(*args)


def identity(x):
    return x


def _rebuild_slowly(path, seconds):
    with open(path + ".tmp", "w") as f:  # the worker's pid, for the test to kill it while this unpickles
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(seconds)
    return SlowToUnpickle(path, seconds)


class SlowToUnpickle:
    """An argument whose unpickling in the worker writes the worker's pid to ``path``, then sleeps."""

    def __init__(self, path, seconds):
        self.path, self.seconds = path, seconds

    def __reduce__(self):
        return _rebuild_slowly, (self.path, self.seconds)


def _rebuild_raising(message):
    raise ValueError(message)


class FailsToUnpickle:
    """An argument whose unpickling raises ``ValueError(message)`` (pickling it works)."""

    def __init__(self, message):
        self.message = message

    def __reduce__(self):
        return _rebuild_raising, (self.message,)


KEPT = ()


def _die_in_a_worker():
    if multiprocessing.parent_process() is not None:  # (not in the test's process, should it unpickle one)
        os.kill(os.getpid(), 9)


class DiesWhenUnpickled:
    """An argument whose unpickling kills the pool worker: one put before an array kills it before it maps it."""

    def __reduce__(self):
        return _die_in_a_worker, ()


class DiesWhenPickled:
    """Part of a result whose pickling kills the pool worker: one put after an array kills it once the array's
    in-flight count is taken, before the result is sent."""

    def __reduce__(self):
        os.kill(os.getpid(), 9)


def shared_then_dies(n):
    """A result naming a named segment (file_system, whatever the start method passed on) and killing its worker
    as it is pickled."""
    mpr.set_sharing_strategy("file_system")
    a = mpr.empty_shared(n)
    a[:] = 5
    return a, DiesWhenPickled()


def die_after(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), 9)


def first_sum(_, a):
    return float(a.sum())


def keep(*arrays):
    """Initializer: keep the initargs for the tasks."""
    global KEPT
    KEPT = arrays


def kept_sum(_):
    return float(sum(a.sum() for a in KEPT))


def three_mib(i):
    return np.full(3 << 18, i, np.float32)


def arrays_and_a_lock(method):
    """A result that cannot be pickled, after a long repr."""
    return [np.arange(float(i), i + 1000.0) for i in range(20)] + [multiprocessing.get_context(method).Lock()]


def sized(n):
    """A result of ``n`` bytes' pickle, about: around the short results' limit (Note [batches])."""
    return n, b"x" * n


def nap(seconds):
    time.sleep(seconds)
    return seconds


def slow_square_or_block(args):
    """x * x after 50 us of work (short enough to be batched, slow enough that batches fill), or, for x ==
    blocked, this worker's pid written to ``path`` and a 60 s sleep. No shared array in the arguments: a task
    that names shared memory travels alone."""
    x, path, blocked = args
    end = time.perf_counter() + 50e-6
    while time.perf_counter() < end:
        pass
    if x == blocked:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        time.sleep(60)
    return x * x


def child_exitcode():
    """A worker's child's exit code, None when the worker may not start one (a daemonic process)."""
    try:
        p = multiprocessing.get_context("fork").Process(target=int)
        p.start()
    except AssertionError:  # "daemonic processes are not allowed to have children"
        return None
    p.join()
    return p.exitcode


def write_own_input(x, i):
    """Write this task's input and say what it held: another task's write must not show (value semantics)."""
    before = float(x[0])
    x[0] = 1000 + i
    return before, x.flags.writeable, float(x[-1])


def first_and_flag(x, i):
    return float(x[0]), x.flags.writeable


def die(_=None):
    os.kill(os.getpid(), 9)


_HEAP: list = []
_GC: list = []  # (start, stop) of each full collection since keep_a_large_heap


def _gc_watch(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        _GC.append((time.perf_counter(), None))
    elif _GC and _GC[-1][1] is None:
        _GC[-1] = (_GC[-1][0], time.perf_counter())


def keep_a_large_heap(n, max_interval):
    """A task that leaves a heap of ``n`` tracked objects alive in its worker (a cache made on first use), caps
    the worker's spacing of full collections at ``max_interval``, and starts logging them."""
    import gc

    from mp_reductions._pool import worker

    worker.GC_MAX_INTERVAL = max_interval
    _HEAP[:] = [[] for _ in range(n)]
    _GC.clear()
    if _gc_watch not in gc.callbacks:
        gc.callbacks.append(_gc_watch)


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gc_log(_=None):
    """The (start, stop) of each full collection since keep_a_large_heap."""
    return [c for c in _GC if c[1] is not None]


VICTIMS = (2, 5, 9)  # the items whose task dies (or hangs) in the several-faults suite


def dies_on_victims(x):
    """x * x, after 10 ms; a worker that runs a victim dies of SIGKILL."""
    if x in VICTIMS:
        os.kill(os.getpid(), 9)
    time.sleep(0.01)
    return x * x


def dies_on_victims_star(x, y):
    return dies_on_victims(x) + y


def hangs_on_victims(x):
    """x * x; a victim hangs for a minute (past any time limit of the suite)."""
    time.sleep(60 if x in VICTIMS else 0.01)
    return x * x


def graceful_nap(seconds, ignore=False):
    """A task with a SIGTERM handler of its own that raises (a graceful shutdown), or ignores SIGTERM."""
    import signal

    def shut_down(signum, frame):
        raise RuntimeError("graceful shutdown")

    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else shut_down)
    time.sleep(seconds)
    return "finished"


def nap_then_print(seconds, text):
    time.sleep(seconds)
    print(text, flush=True)


def call_each(funcs):
    """Each function called with no argument, or with None."""
    out = []
    for f in funcs:
        try:
            out.append(f())
        except TypeError:
            out.append(f(None))
    return out
