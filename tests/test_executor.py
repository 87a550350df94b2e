"""arraymp's ProcessPoolExecutor (concurrent.futures' over our context): workers retiring at max_tasks_per_child are
replaced (the stdlib's hangs, CPython gh-115634), fork refuses max_tasks_per_child as the stdlib does, and arrays
move as arguments, results and initargs under every start method."""

import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
from collections import Counter

import _work
import numpy as np
import pytest

import arraymp as mp

METHODS = ["spawn", "forkserver", "fork"]
TASKS, N = 20, 1 << 14  # 20 tasks of 128 KiB float64 arrays: above the 64 KiB inline threshold

needs_max_tasks = pytest.mark.skipif(sys.version_info < (3, 11),
                                     reason="max_tasks_per_child is new in Python 3.11's concurrent.futures")


def square_and_pid(x):  # run by the workers, found in this module
    return x * x, os.getpid()


# Run in a fresh interpreter: an executor that hangs there cannot stall pytest, and a hang ends the run with every
# thread's stack (the workers of a hung pool are killed first).
RETIRING = """
import concurrent.futures, faulthandler, json, os, sys
import numpy as np
import arraymp as mp
import test_executor as t

method, max_tasks, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
ctx = None if method == "default" else mp.get_context(method)
ex = mp.ProcessPoolExecutor(2, mp_context=ctx, max_tasks_per_child=max_tasks)
processes = ex._processes  # shutdown() forgets them
futures = [ex.submit(t.square_and_pid, np.full(t.N, i, np.float64)) for i in range(t.TASKS)]
if not wait:
    ex.shutdown(wait=False)  # the queued work still runs, as documented
done, pending = concurrent.futures.wait(futures, timeout=90)
if pending:
    sys.stderr.write(f"{len(pending)} of {len(futures)} tasks never finished; workers left: {list(processes)}\\n")
    faulthandler.dump_traceback()
    for p in list(processes.values()):
        p.kill()
    os._exit(3)
out = [(float(r.min()), float(r.max()), r.shape[0], mp.is_shared(r), pid) for r, pid in (f.result() for f in futures)]
ex.shutdown()
print(json.dumps({"start_method": ex._mp_context.get_start_method(), "results": out}))
"""


def run_retiring(method, max_tasks, wait=True):
    path = [str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH")]  # this module, for the workers
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    out = subprocess.run([sys.executable, "-c", RETIRING, method, str(max_tasks), "wait" if wait else "nowait"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_retiring(got, max_tasks):
    results = got["results"]
    assert len(results) == TASKS
    for i, (low, high, n, shared, _) in enumerate(results):
        assert (low, high, n, shared) == (i * i, i * i, N, True)  # right result, moved by shared memory
    per_worker = Counter(pid for *_, pid in results)
    assert max(per_worker.values()) <= max_tasks  # the stdlib's semantics: then the worker is replaced


@needs_max_tasks
@pytest.mark.parametrize("max_tasks", [1, 2])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_retired_workers_are_replaced_until_all_tasks_ran(method, max_tasks):
    got = run_retiring(method, max_tasks)
    assert got["start_method"] == method
    check_retiring(got, max_tasks)


@needs_max_tasks
def test_short_form_with_max_tasks_per_child_does_not_hang():
    got = run_retiring("default", 2)  # mp.ProcessPoolExecutor(2, max_tasks_per_child=2): spawn, as the stdlib's
    assert got["start_method"] == "spawn"
    check_retiring(got, 2)


@needs_max_tasks
def test_queued_work_runs_after_shutdown_without_wait():
    check_retiring(run_retiring("spawn", 1, wait=False), 1)


@needs_max_tasks
def test_fork_refuses_max_tasks_per_child_as_the_stdlib():
    with pytest.raises(ValueError) as stdlib:
        concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"),
                                               max_tasks_per_child=1)
    for make in (lambda: mp.ProcessPoolExecutor(2, mp_context=mp.get_context("fork"), max_tasks_per_child=1),
                 lambda: mp.get_context("fork").ProcessPoolExecutor(2, max_tasks_per_child=2)):
        with pytest.raises(ValueError) as ours:
            make()
        assert str(ours.value) == str(stdlib.value)


@pytest.mark.parametrize("method", METHODS)
def test_arrays_as_arguments_and_results(method):
    xs = [np.full(N, i, np.float64) for i in range(6)]  # 128 KiB each
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        got = list(ex.map(_work.double, xs, timeout=120))
        assert all((g == 2 * x).all() and g.shape == x.shape and mp.is_shared(g) for g, x in zip(got, xs, strict=True))
        shared = mp.zeros_shared((N,), np.float64)
        shared[:] = 3
        assert (ex.submit(_work.double, shared).result(timeout=120) == 6).all()
    del got


_initarg = None


def keep(a):
    global _initarg
    _initarg = a


def initarg_summary():
    return float(_initarg.sum()), _initarg.shape, _initarg.dtype.str


@pytest.mark.parametrize("method", METHODS)
def test_big_array_as_initargs(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method), initializer=keep,
                                initargs=(np.arange(1_000_000.0),)) as ex:  # 8 MB
        got = [ex.submit(initarg_summary).result(timeout=120) for _ in range(4)]
    assert got == [(float(np.arange(1_000_000.0).sum()), (1_000_000,), "<f8")] * 4


@pytest.mark.parametrize("method", METHODS)
def test_results_are_snapshots_with_shared_results_or_without(method):
    # shared_results (default True): a worker's 2 MiB arrays are born in shared memory, but a result the worker keeps
    # comes back as a copy (issue 35): the caller's write never reaches the worker's array
    ctx = mp.get_context(method)
    for shared in (True, False):
        with mp.ProcessPoolExecutor(1, mp_context=ctx, shared_results=shared) as ex:
            got = list(ex.map(_work.result_kept, range(4)))
            got[2][:] = -1
            assert ex.submit(_work.kept_value, 2).result(timeout=60) == 2.0
            assert [float(a[0]) for a in got] == [0.0, 1.0, -1.0, 3.0] and all(mp.is_shared(a) for a in got)
    with mp.get_context(method).ProcessPoolExecutor(1, shared_results=False, initializer=_work.set_env,
                                                    initargs=("ARRAYMP_T", "1")) as ex:  # the initializer still runs
        assert ex.submit(_work.get_env, "ARRAYMP_T").result(timeout=60) == "1"


@pytest.mark.parametrize("method", METHODS)
def test_a_call_that_cannot_be_pickled_fails_alone_and_a_killed_worker_breaks_the_pool(method):
    # Note [call queue]: our call queue pickles in the manager thread; an unpicklable call fails its own future (the
    # stdlib's _SafeQueue hook), the others run; a worker killed mid-call breaks the executor as the stdlib's does
    import threading

    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        bad = ex.submit(_work.double, threading.Lock())
        good = [ex.submit(_work.double, i) for i in range(20)]
        with pytest.raises(TypeError, match="pickle"):
            bad.result(timeout=60)
        assert [f.result(timeout=60) for f in good] == [2 * i for i in range(20)]
        doomed = ex.submit(_work.die)
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            doomed.result(timeout=60)
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            ex.submit(_work.double, 1).result(timeout=60)


@pytest.mark.parametrize("method", METHODS)
def test_queued_results_are_taken_without_waiting(method, monkeypatch):
    # Note [manager wait]: the stdlib's manager thread waits on a selector of every channel and sentinel before
    # each result; ours takes a result already queued. The futures' callbacks (run by the manager thread) sleep,
    # so results queue up behind them: the stdlib's would wait once per result
    import threading
    import time
    from multiprocessing import connection

    waits, wait = Counter(), connection.wait

    def counted(object_list, *args, **kwargs):
        if len(object_list) > 1:  # the wait for a result (not a poll of the wakeup pipe alone, in its clear())
            waits[threading.current_thread().name] += 1
        return wait(object_list, *args, **kwargs)

    monkeypatch.setattr(connection, "wait", counted)
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        assert ex.submit(_work.double, 1).result(timeout=60) == 2  # the manager thread started
        manager = ex._executor_manager_thread.name
        before = waits[manager]
        naps = [ex.submit(_work.nap, 1.0) for _ in range(2)]  # no result comes before every callback is on
        futures = [ex.submit(_work.double, i) for i in range(100)]
        for f in futures:
            f.add_done_callback(lambda f: time.sleep(0.005))
        assert not any(f.done() for f in futures), "a result came before the callbacks were on (a stalled machine)"
        assert [f.result(timeout=60) for f in naps] == [1.0, 1.0]
        assert [f.result(timeout=60) for f in futures] == [2 * i for i in range(100)]
        assert waits[manager] - before < 50, f"the manager waited {waits[manager] - before} times for 100 results"
        # submit() still wakes it: its wakeup pipe is emptied as results are taken (a full one blocks submit())
        assert [f.result(timeout=60) for f in [ex.submit(_work.double, i) for i in range(20_000)]] == \
            [2 * i for i in range(20_000)]


@pytest.mark.parametrize("method", METHODS)
def test_a_result_that_cannot_be_unpickled_breaks_the_pool_with_its_cause(method):
    # as the stdlib's: the manager cannot tell which call it was, so the pool is broken, the error its cause
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool) as info:
            ex.submit(_work.unloadable).result(timeout=60)
        assert "cannot be unpickled here" in str(info.value.__cause__)
