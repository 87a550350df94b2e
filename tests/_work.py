import numpy as np
import shm_core


def segment_under(a: np.ndarray) -> shm_core.Segment | None:
    """The segment ``a`` views (it came with no pickled copy): shared, or its receiver's own (mp_reductions' _shared
    Note [own arrays]); None for process memory."""
    while isinstance(a, np.ndarray):
        a = a.base
    a = getattr(a, "obj", a)
    return a if isinstance(a, shm_core.Segment) else None


def via_shared_memory(a: np.ndarray) -> bool:
    return segment_under(a) is not None


def segment_key(a: np.ndarray):
    seg = segment_under(a)
    return None if seg is None else seg.key


def double(x):
    return x * 2


def make(i):
    return [np.full((100, 100), i, np.float32) for _ in range(5)]


def train(rank, a, shared, out):
    """An mp.spawn function: report the sum past a[0] of its array argument, then (rank 0) write a[0]."""
    out.put((rank, float(a[1:].sum()), bool(shared)))
    if rank == 0:
        a[0] = -1


KEPT = {}


def result_kept(i):
    """A fresh 2 MiB result, kept in the worker too: a write to what the caller received shows whether it was
    copied (shared_results)."""
    KEPT[i] = a = np.full(1 << 19, i, np.float32)
    return a


def kept_value(i):
    a = KEPT[i]
    return float(a[0]) if (a == a[0]).all() else None


def set_env(name, value):
    import os

    os.environ[name] = value


def get_env(name):
    import os

    return os.environ.get(name)


def die():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _refuse_to_load():
    raise ValueError("this result cannot be unpickled here")


class Unloadable:
    """A result that pickles in the worker and fails to unpickle in the caller."""

    def __reduce__(self):
        return _refuse_to_load, ()


def unloadable():
    return Unloadable()


def nap(seconds):
    import time

    time.sleep(seconds)
    return seconds


def wait_for_sigint(ready):
    """Exit 7 from a SIGINT handler (``Process.interrupt``), after telling ``ready`` it is installed."""
    import os
    import signal
    import time

    signal.signal(signal.SIGINT, lambda *_: os._exit(7))
    ready.set()
    time.sleep(60)
