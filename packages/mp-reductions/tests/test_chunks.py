"""executor_map: Python 3.14's ProcessPoolExecutor.map (chunks, buffersize) over any executor's submit, on every
version; checked here over a pool of real processes (ours, through a small executor facade) and a thread pool."""

import concurrent.futures
import operator
import sys
import time

import pytest
from mp_reductions import Pool, executor_map

TIMEOUT = 60


class PoolExecutor:
    """The least an executor needs for executor_map: submit, over our Pool."""

    def __init__(self, pool):
        self.pool, self.submitted = pool, 0

    def submit(self, fn, *args):
        self.submitted += 1
        f = concurrent.futures.Future()
        f.set_running_or_notify_cancel()
        self.pool.apply_async(fn, args, callback=f.set_result, error_callback=f.set_exception)
        return f


def counted(n, seen):
    for i in range(n):
        seen.append(i)
        yield i


@pytest.mark.parametrize("chunksize", [1, 3, 10])
def test_results_in_order_over_a_pool(chunksize):
    with Pool(2) as pool:
        ex = PoolExecutor(pool)
        assert list(executor_map(ex, operator.mul, range(20), range(25), chunksize=chunksize)) == \
            [i * i for i in range(20)]
        assert ex.submitted == -(-20 // chunksize)
        with pytest.raises(ZeroDivisionError):
            list(executor_map(ex, operator.floordiv, [1, 2], [1, 0]))


def test_buffersize_reads_the_iterables_lazily():
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        seen = []
        results = executor_map(ex, abs, counted(50, seen), chunksize=4, buffersize=2)
        assert len(seen) == 8  # two chunks submitted, nothing else read
        assert [next(results) for _ in range(5)] == [0, 1, 2, 3, 4]
        assert len(seen) == 16  # a chunk submitted as each one is taken
        assert list(results) == list(range(5, 50))


def test_arguments_are_checked_as_3_14_checks_them():
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        for kwargs, error, message in [({"chunksize": 0}, ValueError, "chunksize must be >= 1."),
                                       ({"buffersize": 0}, ValueError, "buffersize must be None or > 0"),
                                       ({"buffersize": 2.0}, TypeError, "buffersize must be an integer or None")]:
            with pytest.raises(error) as ours:
                executor_map(ex, abs, [1], **kwargs)
            assert str(ours.value) == message
            if sys.version_info >= (3, 14):
                with concurrent.futures.ProcessPoolExecutor(1) as stdlib, pytest.raises(error) as theirs:
                    stdlib.map(abs, [1], **kwargs)
                assert str(theirs.value) == message


def test_timeout_is_for_the_whole_iteration_and_what_is_left_is_cancelled():
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        results = executor_map(ex, time.sleep, [1.0, 0.01, 0.01, 0.01], timeout=0.2)
        with pytest.raises(TimeoutError):
            next(results)
        assert ex.submit(abs, -1).result(TIMEOUT) == 1  # the calls not started were cancelled: the thread is free
