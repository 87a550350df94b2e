"""Issue 35, scenarios 1 and 2: results are snapshots, as with the stdlib. A worker's arrays of 1 MiB or more are born
in shared memory, but what a worker keeps (a module-level buffer, an lru_cache table, the base of a view) comes back
as a copy: a later task never changes an earlier result, and the caller's writes never reach the worker. Only a result
the worker gave up entirely moves with no copy (mp_reductions _alloc Note [moving results]). mp.Pool,
mp.ProcessPoolExecutor and the joblib backend, under fork, spawn and forkserver."""

import _defaults as D
import _work
import pytest

import arraymp as mp

METHODS = ["fork", "spawn", "forkserver"]
TIMEOUT = 120


@pytest.fixture(params=METHODS)
def method(request):
    return request.param


def test_pool_map_of_a_module_buffer_returns_each_tasks_values(method):
    with mp.get_context(method).Pool(2) as pool:
        results = pool.map(D.fill_module_buffer, range(4), chunksize=1)
        assert [float(r[0]) for r in results] == [0, 1, 2, 3]
        assert all((r == i).all() for i, r in enumerate(results))
        first = pool.apply(D.fill_module_buffer, (7,))
        pool.apply(D.fill_module_buffer, (8,))
        pool.map(D.fill_module_buffer, range(10, 20))
        assert (first == 7).all()  # a later task does not change an earlier result


def test_pool_callers_writes_never_reach_the_cached_table(method):
    with mp.get_context(method).Pool(1) as pool:
        r = pool.apply(D.cached_table, (0,))
        r /= r.max()  # normalise in place, as numpy code does with its own result
        later = pool.map(D.cached_table, range(3))
        assert all(float(t[-1]) == D.N for t in later)
        assert pool.apply(D.table_first_and_last, (0,)) == (1.0, float(D.N))


def test_executor_results_are_snapshots(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        results = list(ex.map(D.fill_module_buffer, range(4)))
        assert [float(r[0]) for r in results] == [0, 1, 2, 3]
        r = ex.submit(D.cached_table, 0).result(TIMEOUT)
        r /= r.max()
        assert {ex.submit(D.table_first_and_last, 0).result(TIMEOUT) for _ in range(4)} == {(1.0, float(D.N))}


def test_joblib_results_are_snapshots(method):
    joblib = pytest.importorskip("joblib", reason="joblib is not installed: `pip install 'arraymp[joblib]'`")
    import arraymp.joblib

    try:
        with joblib.parallel_config(backend="arraymp", n_jobs=2, start_method=method):
            results = joblib.Parallel()(joblib.delayed(D.fill_module_buffer)(i) for i in range(4))
            assert [float(r[0]) for r in results] == [0, 1, 2, 3]
            tables = joblib.Parallel()(joblib.delayed(D.cached_table)(i) for i in range(4))
            for t in tables:
                t /= t.max()
            again = joblib.Parallel()(joblib.delayed(D.table_first_and_last)(i) for i in range(4))
            assert set(again) == {(1.0, float(D.N))}
    finally:
        arraymp.joblib.shutdown()


def test_fresh_results_still_move_without_a_copy_and_kept_ones_are_copied(method):
    with mp.get_context(method).Pool(1) as pool:
        for a, where in pool.map(D.fresh, range(3)):
            assert where is not None and _work.segment_key(a) == where  # the worker's own segment: no copy
        [views], where = pool.apply(D.fresh_views, (5,))
        assert _work.segment_key(views["row"]) == _work.segment_key(views["col"]) == where
        assert (views["row"] == 5).all() and (views["col"] == 5).all()
        kept, where = pool.apply(D.kept_view, (6,))
        assert where is not None and _work.segment_key(kept) != where and (kept == 6).all()  # a copy
        kept[:] = -1
        again, _ = pool.apply(D.kept_view, (6,))
        assert (again == 6).all()


def test_a_moved_result_is_the_callers_alone(method):
    with mp.get_context(method).Pool(1) as pool:
        a, _ = pool.apply(D.fresh, (1,))
        others = [r for r, _ in pool.map(D.fresh, range(8))]  # the worker's pool may reuse segments: not a's
        assert (a == 1).all() and all((r == i).all() for i, r in enumerate(others))
        a[:] = -3
        assert all((r == i).all() for i, r in enumerate(others))
