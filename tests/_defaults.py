"""Functions run in pool workers by the tests of issue 35's scenarios (test_defaults_*.py): plain numpy code, as a
user writes it, that never asked for shared memory."""

import functools
import os

import numpy as np

N = 1 << 18  # float64 elements: 2 MiB, over the 1 MiB at which a worker's arrays are born in shared memory
BUF = None


def fill_module_buffer(i):
    """Scenario 1: a module-level buffer (made at first use, in the worker) filled and returned, task after task."""
    global BUF
    if BUF is None:
        BUF = np.zeros(N)
    BUF[:] = i
    return BUF


@functools.lru_cache
def _table():
    return np.arange(N, dtype=np.float64) + 1


def cached_table(i):
    """Scenario 2: a table from a functools.lru_cache."""
    return _table()


def table_first_and_last(i):
    t = _table()
    return float(t[0]), float(t[-1])


def fresh(i):
    """A fresh result the worker keeps nothing of, and where its memory lies (to tell whether it moved)."""
    a = np.full(N, float(i))
    return a, _where(a)


def fresh_views(i):
    """Two views of one fresh base, in a dict inside a list: nothing else holds them."""
    base = np.full((2, N), float(i))
    return [{"row": base[1], "col": base[:, 7]}], _where(base)


def kept_view(i):
    """A view of a base the worker keeps (a global): copied."""
    global _KEPT_BASE
    _KEPT_BASE = np.full((2, N), float(i))
    return _KEPT_BASE[1], _where(_KEPT_BASE)


_KEPT_BASE = None


def _where(a):
    """The (st_dev, st_ino) of the shared segment ``a``'s data lies in, or None."""
    from mp_reductions import _shared

    found = _shared.segment_of(a, _shared.BORN_PRIVATE)
    return None if found is None else found[0].key


def forked_helpers_double(helpers):
    """Scenario 3: a worker makes a 2 MiB array, and fork children each double their copy of it; what each child
    saw and what the worker's array holds after."""
    a = np.full(N, 2.0)
    seen = []
    for _ in range(helpers):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            a[:] *= 2
            os.write(w, str(float(a[0])).encode())
            os._exit(0)
        os.close(w)
        seen.append(float(os.read(r, 64)))
        os.close(r)
        os.waitpid(pid, 0)
    return seen, float(a[0]), bool((a == 2).all())


def stdlib_fork_pool_doubles(_):
    """Scenario 3 as reported: a stdlib fork Pool inside an executor worker, each helper doubling its copy."""
    import multiprocessing

    global _HELPER_ARRAY
    _HELPER_ARRAY = np.full(N, 2.0)
    with multiprocessing.get_context("fork").Pool(4) as helpers:
        seen = helpers.map(_double_once, range(4), chunksize=1)
    return seen, float(_HELPER_ARRAY[0])


_HELPER_ARRAY = None


def _double_once(_):
    _HELPER_ARRAY[:] *= 2
    return os.getpid(), float(_HELPER_ARRAY[0])


def square(x):
    return x * x
