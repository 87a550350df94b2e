"""Issue 35, scenario 7: under the file_system strategy, an array in a memfd segment (a Pool result, a received
array, an empty_shared made before the strategy was set) put on a stdlib multiprocessing Queue or stored in a Manager
dict arrives, as the stdlib would send it (mp_reductions _reductions Note [channels we do not own])."""

import multiprocessing

import _defaults as D
import numpy as np
import pytest

import arraymp as mp

METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture
def file_system():
    old = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(old)


def memfd_arrays(method):
    """Three arrays in memfd segments, made under file_descriptor: before the strategy is set."""
    made = mp.empty_shared((512, 256))
    made[:] = 1
    with mp.get_context(method).Pool(1) as pool:
        result, _ = pool.apply(D.fresh, (2,))  # moved from the worker: its memfd
    q = mp.Queue()
    q.put(np.full(1 << 16, 3.0))
    received = q.get(timeout=60)
    return [made, result, received]


@pytest.mark.parametrize("method", METHODS)
def test_memfd_arrays_cross_a_stdlib_queue_and_a_manager_under_file_system(method, file_system):
    arrays = memfd_arrays(method)
    mp.set_sharing_strategy("file_system")
    ctx = multiprocessing.get_context(method)
    q = ctx.Queue()
    for a in arrays:
        q.put(a)
    got = [q.get(timeout=60) for _ in arrays]
    assert all(np.array_equal(a, b) for a, b in zip(arrays, got, strict=True))
    q.close()
    q.join_thread()
    with ctx.Manager() as manager:
        d = manager.dict()
        for i, a in enumerate(arrays):
            d[i] = a
        assert all(np.array_equal(d[i], a) for i, a in enumerate(arrays))
    del got, arrays
