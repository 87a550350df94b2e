"""Issue 35, scenario 3: plain numpy code inside a worker keeps fork's copy-on-write for the children it forks. A
worker's big arrays are born in shared memory; before a fork they become the process's private memory again
(mp_reductions _alloc Note [private at fork]), so a child that doubles its copy doubles its own."""

import collections

import _defaults as D
import pytest

import arraymp as mp

METHODS = ["fork", "spawn", "forkserver"]


@pytest.mark.parametrize("method", METHODS)
def test_executor_worker_forking_helpers_keeps_copy_on_write(method):
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        seen, mine = ex.submit(D.stdlib_fork_pool_doubles, 0).result(120)
    assert mine == 2.0  # the helpers' writes never reach the worker
    by_helper = collections.defaultdict(list)
    for pid, value in seen:
        by_helper[pid].append(value)
    for values in by_helper.values():  # each helper doubles its own copy, once per task it ran
        assert values == [2.0 * 2 ** (k + 1) for k in range(len(values))], seen


@pytest.mark.parametrize("method", METHODS)
def test_pool_worker_fork_children_double_their_own_copy(method):
    with mp.get_context(method).Pool(1) as pool:
        seen, mine, untouched = pool.apply(D.forked_helpers_double, (4,))
        assert seen == [4.0, 4.0, 4.0, 4.0] and mine == 2.0 and untouched
        assert pool.map(D.square, range(4)) == [0, 1, 4, 9]  # the worker goes on
