"""arraymp's ProcessPoolExecutor (concurrent.futures' API over our Pool, Note [executor dispatch]): the stdlib's
semantics and Python 3.14's API on every version; workers retiring at max_tasks_per_child are replaced (the stdlib's
hangs, CPython gh-115634), fork refuses max_tasks_per_child as the stdlib does, a dead worker breaks the executor
with its cause, and arrays move as arguments, results and initargs under every start method."""

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time
from collections import Counter

import _work
import numpy as np
import pytest

import arraymp as mp

METHODS = ["spawn", "forkserver", "fork"]
TASKS, N = 20, 1 << 14  # 20 tasks of 128 KiB float64 arrays: above the 64 KiB inline threshold

def square_and_pid(x):  # run by the workers, found in this module
    return x * x, os.getpid()


# Run in a fresh interpreter: an executor that hangs there cannot stall pytest, and a hang ends the run with every
# thread's stack (the workers of a hung pool are killed first).
RETIRING = """
import concurrent.futures, faulthandler, json, os, sys
import numpy as np
import arraymp as mp
import _work
import test_executor as t

method, max_tasks, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
ctx = None if method == "default" else mp.get_context(method)
ex = mp.ProcessPoolExecutor(2, mp_context=ctx, max_tasks_per_child=max_tasks)
futures = [ex.submit(t.square_and_pid, np.full(t.N, i, np.float64)) for i in range(t.TASKS)]
if not wait:
    ex.shutdown(wait=False)  # the queued work still runs, as documented
done, pending = concurrent.futures.wait(futures, timeout=90)
if pending:
    workers = ex._processes
    sys.stderr.write(f"{len(pending)} of {len(futures)} tasks never finished; workers left: {list(workers)}\\n")
    faulthandler.dump_traceback()
    for p in list(workers.values()):
        p.kill()
    os._exit(3)
out = [(float(r.min()), float(r.max()), r.shape[0], _work.via_shared_memory(r), pid)
       for r, pid in (f.result() for f in futures)]
ex.shutdown()
print(json.dumps({"start_method": ex._mp_context.get_start_method(), "results": out}))
"""


def with_this_module():
    path = [str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH")]  # this module, for the workers
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def run_retiring(method, max_tasks, wait=True):
    out = subprocess.run([sys.executable, "-c", RETIRING, method, str(max_tasks), "wait" if wait else "nowait"],
                         capture_output=True, text=True, timeout=300, env=with_this_module())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_retiring(got, max_tasks):
    results = got["results"]
    assert len(results) == TASKS
    for i, (low, high, n, shared, _) in enumerate(results):
        assert (low, high, n, shared) == (i * i, i * i, N, True)  # right result, moved by shared memory
    per_worker = Counter(pid for *_, pid in results)
    assert max(per_worker.values()) <= max_tasks  # the stdlib's semantics: then the worker is replaced


@pytest.mark.parametrize("max_tasks", [1, 2])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_retired_workers_are_replaced_until_all_tasks_ran(method, max_tasks):
    got = run_retiring(method, max_tasks)
    assert got["start_method"] == method
    check_retiring(got, max_tasks)


def test_short_form_with_max_tasks_per_child_does_not_hang():
    got = run_retiring("default", 2)  # mp.ProcessPoolExecutor(2, max_tasks_per_child=2): spawn, as the stdlib's
    assert got["start_method"] == "spawn"
    check_retiring(got, 2)


def test_queued_work_runs_after_shutdown_without_wait():
    check_retiring(run_retiring("spawn", 1, wait=False), 1)


AT_EXIT = """
import sys
import arraymp as mp
import _work
import test_executor as t

ex = mp.ProcessPoolExecutor(2, mp_context=mp.get_context(sys.argv[1]))
for i in range(6):
    ex.submit(t.touch_later, sys.argv[2], i)
ex.shutdown(wait=False)  # then the interpreter exits: it waits for the queued work, as the stdlib's
"""


def touch_later(directory, i):
    time.sleep(0.2)
    (pathlib.Path(directory) / str(i)).touch()


@pytest.mark.parametrize("method", METHODS)
def test_the_interpreter_waits_at_exit_for_work_queued_before_shutdown_without_wait(method, tmp_path):
    out = subprocess.run([sys.executable, "-c", AT_EXIT, method, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=with_this_module())
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(i) for i in range(6)]


@pytest.mark.parametrize("cls", [concurrent.futures.ProcessPoolExecutor, mp.ProcessPoolExecutor],
                         ids=["stdlib", "arraymp"])
def test_shutdown_with_wait_from_a_done_callback_raises_as_the_stdlibs(cls):
    # issue 32: ours waited for the thread the callback ran in (a deadlock); the stdlib's raises there, and the
    # executor is shut down all the same
    ex = cls(1)
    raised, ran = [], concurrent.futures.Future()

    def callback(f):
        try:
            ex.shutdown(wait=True)
        except RuntimeError as e:
            raised.append(str(e))
        ran.set_result(None)

    f = ex.submit(time.sleep, 0.5)
    f.add_done_callback(callback)  # (before the call ends: it runs in the thread that sets the result)
    ran.result(timeout=60)
    assert raised == ["cannot join current thread"]
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(abs, 1)
    ex.shutdown(wait=True)


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
        assert all((g == 2 * x).all() and g.shape == x.shape and _work.via_shared_memory(g)
                   for g, x in zip(got, xs, strict=True))
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
            assert [float(a[0]) for a in got] == [0.0, 1.0, -1.0, 3.0]
            assert all(_work.via_shared_memory(a) and not mp.is_shared(a) for a in got)  # the caller's own
    with mp.get_context(method).ProcessPoolExecutor(1, shared_results=False, initializer=_work.set_env,
                                                    initargs=("ARRAYMP_T", "1")) as ex:  # the initializer still runs
        assert ex.submit(_work.get_env, "ARRAYMP_T").result(timeout=60) == "1"


TIMEOUT = 60


def test_it_is_the_stdlibs_type_and_every_public_method_is_ours():
    # Note [executor dispatch]: never the stdlib's __init__ nor any of its methods (their private classes change in
    # patch releases); every public method of this Python's stdlib executor is overridden
    ex = mp.ProcessPoolExecutor(2)
    assert isinstance(ex, concurrent.futures.ProcessPoolExecutor) and isinstance(ex, concurrent.futures.Executor)
    stdlib = concurrent.futures.ProcessPoolExecutor
    public = [n for n in dir(stdlib) if not n.startswith("_") and callable(getattr(stdlib, n))]
    assert {"submit", "map", "shutdown"} <= set(public)
    assert [n for n in public if getattr(mp.ProcessPoolExecutor, n) is getattr(stdlib, n)] == []
    assert {"terminate_workers", "kill_workers"} <= set(dir(mp.ProcessPoolExecutor))  # 3.14's, on every version
    assert ex._max_workers == 2 and ex._processes == {}  # no worker before the first submit
    ex.shutdown()


def test_arguments_are_checked_as_the_stdlib_checks_them():
    ex = mp.ProcessPoolExecutor()
    assert ex._max_workers == getattr(os, "process_cpu_count", os.cpu_count)()
    assert ex._mp_context is mp.get_context()
    ex.shutdown()
    for bad, error in [(dict(max_workers=0), ValueError), (dict(max_workers=-1), ValueError),
                       (dict(initializer=3), TypeError), (dict(max_tasks_per_child=0), ValueError),
                       (dict(max_tasks_per_child=1.5), TypeError)]:
        with pytest.raises(error) as stdlib:
            concurrent.futures.ProcessPoolExecutor(**bad)
        with pytest.raises(error) as ours:
            mp.ProcessPoolExecutor(**bad)
        assert str(ours.value) == str(stdlib.value)
    with mp.ProcessPoolExecutor(1, max_tasks_per_child=3) as ex:
        assert ex._mp_context is mp.get_context("spawn")


@pytest.mark.parametrize("method", METHODS)
def test_a_pending_future_is_cancellable_a_running_one_is_not(method):
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        # one worker: two calls run (max_workers + 1, the stdlib's call queue), the others are pending
        first, second, *rest = [ex.submit(_work.nap, 0.5) for _ in range(5)]
        assert first.running() and second.running() and not any(f.running() for f in rest)
        assert not first.cancel() and not second.cancel()
        assert rest[0].cancel() and rest[0].cancelled()
        assert [f.result(TIMEOUT) for f in (first, second, rest[1], rest[2])] == [0.5] * 4
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(_work.double, 1)


@pytest.mark.parametrize("method", METHODS)
def test_shutdown_cancel_futures_cancels_the_pending_ones(method):
    ex = mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method))
    fs = [ex.submit(_work.nap, 0.3) for _ in range(8)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert [f.result(0) for f in fs[:2]] == [0.3, 0.3]  # they ran: given to the pool
    assert all(f.cancelled() for f in fs[2:])
    assert multiprocessing.active_children() == []


def counted(n, seen):
    for i in range(n):
        seen.append(i)
        yield i


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_buffersize_bounds_the_submitted_work(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        for bad, error, message in [(dict(buffersize=0), ValueError, "buffersize must be None or > 0"),
                                    (dict(buffersize=1.5), TypeError, "buffersize must be an integer or None"),
                                    (dict(chunksize=0), ValueError, "chunksize must be >= 1.")]:
            with pytest.raises(error, match=message.replace(".", r"\.")):
                ex.map(_work.double, range(3), **bad)
        seen = []
        results = ex.map(_work.double, counted(100, seen), buffersize=3)
        assert len(seen) == 3  # read lazily: only what the buffer holds was submitted
        assert [next(results) for _ in range(5)] == [0, 2, 4, 6, 8]
        assert len(seen) == 3 + 5
        assert list(results) == [2 * i for i in range(5, 100)]
        seen = []
        results = ex.map(_work.double, counted(100, seen), chunksize=10, buffersize=2)
        assert len(seen) == 20  # two chunks of ten
        assert next(results) == 0 and len(seen) == 30
        results.close()  # what was submitted and not yielded is cancelled
        seen = []
        assert list(ex.map(max, counted(10, seen), range(7), chunksize=3)) == list(range(7))


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_map_timeout(method):
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        results = ex.map(_work.nap, [2.0, 0.1, 0.1, 0.1], timeout=0.5)
        with pytest.raises(TimeoutError):
            next(results)


def hold(a, seconds):
    time.sleep(seconds)
    return a.shape


# Under the default strategy (file_descriptor) nothing is named: the leak check counts descriptors. Not under
# file_system here: a Pool whose workers are signalled while they hold their arguments' named segments has left one
# in /dev/shm past the leak check's 5 s now and then (the Pool alone too, with no executor), seen after spawn or
# forkserver pools ran in the same process: to be looked at in mp-reductions / shm-manager.
@pytest.mark.parametrize("how", ["terminate_workers", "kill_workers"])
@pytest.mark.parametrize("method", METHODS)
def test_terminate_and_kill_workers(method, how):
    ex = mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method))
    big = np.ones(N)  # 128 KiB: a segment (memfd) of its own per call sent
    assert ex.submit(_work.double, 1).result(TIMEOUT) == 2  # a worker is up
    running = [ex.submit(hold, big, 30) for _ in range(3)]  # max_workers + 1 given to the pool
    deadline = time.monotonic() + TIMEOUT
    while len(ex._processes) < 2:  # (under spawn and forkserver the second starts on demand, as the stdlib's)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    workers = list(ex._processes.values())
    pending = [ex.submit(hold, big, 0) for _ in range(5)]
    getattr(ex, how)()
    for f in running:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            f.result(TIMEOUT)
    assert all(f.cancelled() for f in pending)  # 3.14's: shut down with cancel_futures=True
    with pytest.raises(concurrent.futures.process.BrokenProcessPool):
        ex.submit(_work.double, 1)
    ex.shutdown()
    signal = {"terminate_workers": -15, "kill_workers": -9}[how]
    assert [w.exitcode for w in workers] == [signal, signal]
    assert multiprocessing.active_children() == []


def pid_then_nap(path, seconds):
    pathlib.Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


@pytest.mark.parametrize("method", METHODS)
def test_a_worker_killed_from_outside_breaks_the_executor_and_says_which(method, tmp_path):
    import signal

    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        marker = tmp_path / "pid"
        running = [ex.submit(pid_then_nap, marker, 30), *[ex.submit(_work.nap, 30) for _ in range(2)]]
        pending = [ex.submit(_work.double, i) for i in range(5)]
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists() or not marker.read_text():  # a worker that dies idle is replaced (the Pool's)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = int(marker.read_text())
        os.kill(victim, signal.SIGKILL)
        errors = []
        for f in running + pending:
            with pytest.raises(concurrent.futures.process.BrokenProcessPool) as info:
                f.result(TIMEOUT)
            errors.append(info.value)
        assert len({id(e) for e in errors}) == len(errors)  # one each, as the stdlib's
        cause = errors[0].__cause__
        assert isinstance(cause, mp.WorkerLostError) and (cause.pid, cause.exitcode) == (victim, -signal.SIGKILL)
        assert all(e.__cause__ is cause for e in errors)
        with pytest.raises(concurrent.futures.process.BrokenProcessPool, match="not usable anymore"):
            ex.submit(_work.double, 1)


def fail_to_start():
    raise RuntimeError("no GPU here")


@pytest.mark.parametrize("method", METHODS)
def test_an_initializer_that_fails_breaks_the_executor(method):
    # a submit made once the executor broke raises (as the stdlib's may: its test_initializer allows it), the
    # others' futures fail; each error has the initializer's failure as its cause
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method), initializer=fail_to_start) as ex:
        errors = []
        for i in range(4):
            try:
                f = ex.submit(_work.double, i)
            except concurrent.futures.process.BrokenProcessPool as e:
                errors.append(e)
                continue
            with pytest.raises(concurrent.futures.process.BrokenProcessPool) as info:
                f.result(TIMEOUT)
            errors.append(info.value)
        assert len(errors) == 4
        for error in errors:
            assert isinstance(error.__cause__, mp.WorkerStartError)
            assert "no GPU here" in str(error.__cause__.__cause__)


@pytest.mark.parametrize("method", METHODS)
def test_a_call_that_cannot_be_pickled_fails_alone_and_a_dying_worker_breaks_the_pool(method):
    import threading

    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        bad = ex.submit(_work.double, threading.Lock())
        good = [ex.submit(_work.double, i) for i in range(20)]
        with pytest.raises(TypeError, match="pickle"):
            bad.result(TIMEOUT)
        assert [f.result(TIMEOUT) for f in good] == [2 * i for i in range(20)]
        doomed = ex.submit(_work.die)
        with pytest.raises(concurrent.futures.process.BrokenProcessPool) as info:
            doomed.result(TIMEOUT)
        assert info.value.__cause__.exitcode == -9
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            ex.submit(_work.double, 1).result(TIMEOUT)


@pytest.mark.parametrize("method", METHODS)
def test_a_result_that_cannot_be_unpickled_fails_alone(method):
    # the stdlib breaks the executor here (it cannot tell whose result it was); the Pool can: that future fails
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        with pytest.raises(ValueError, match="cannot be unpickled here"):
            ex.submit(_work.unloadable).result(TIMEOUT)
        assert ex.submit(_work.double, 2).result(TIMEOUT) == 4


@pytest.mark.parametrize("method", METHODS)
def test_done_callbacks_may_submit_and_many_small_calls_complete(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        chained = []
        first = ex.submit(_work.double, 1)
        first.add_done_callback(lambda f: chained.append(ex.submit(_work.double, f.result())))
        assert first.result(TIMEOUT) == 2
        deadline = time.monotonic() + TIMEOUT
        while not chained and time.monotonic() < deadline:
            time.sleep(0.01)
        assert chained[0].result(TIMEOUT) == 4
        fs = [ex.submit(_work.double, i) for i in range(5_000)]
        assert [f.result(TIMEOUT) for f in fs] == [2 * i for i in range(5_000)]


@pytest.mark.parametrize("method", METHODS)
def test_fresh_big_results_move_without_a_copy(method):
    import _defaults as D

    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        for a, where in [ex.submit(D.fresh, i).result(TIMEOUT) for i in range(3)] + list(ex.map(D.fresh, range(3))):
            assert where is not None and _work.segment_key(a) == where  # the worker's own segment: no copy


# What CPython's test_concurrent_futures asks of the executor (issue 41 item 4: nox -s futures_suite-3.X), as a
# program meets it: the same calls on the stdlib's executor and on ours end the same way.

def exit_now(code):
    sys.exit(code)


def _exit_one():
    sys.exit(1)


class ExitAtPickle:
    def __reduce__(self):
        sys.exit(2)  # in the worker, while its result is pickled


class ExitAtUnpickle:
    def __reduce__(self):
        return _exit_one, ()  # in the caller, while its result is unpickled


class ErrorAtPickle:
    def __reduce__(self):
        import pickle

        raise pickle.PicklingError("not this one")


def returning(kind):
    return {"exit at pickle": ExitAtPickle, "error at pickle": ErrorAtPickle, "exit at unpickle": ExitAtUnpickle,
            "lock": __import__("threading").Lock}[kind]()


def outcome(future):
    try:
        return "result", future.result(TIMEOUT)
    except concurrent.futures.process.BrokenProcessPool:
        return "broken", None
    except BaseException as e:
        return type(e).__name__, getattr(e, "code", None)


def executors(method):
    return [(name, make(2, mp_context=ctx)) for name, make, ctx in [
        ("stdlib", concurrent.futures.ProcessPoolExecutor, multiprocessing.get_context(method)),
        ("arraymp", mp.ProcessPoolExecutor, mp.get_context(method))]]


@pytest.mark.parametrize("method", METHODS)
def test_a_calls_systemexit_and_a_results_pickling_error_are_its_own_as_the_stdlibs(method):
    # issue 41: sys.exit() in a call, or a SystemExit while its result is pickled, broke our executor; a result
    # that could not be pickled raised MaybeEncodingError, which code catching PicklingError misses
    got = {}
    for name, ex in executors(method):
        with ex:
            fs = [ex.submit(exit_now, 3), ex.submit(returning, "exit at pickle"),
                  ex.submit(returning, "error at pickle"), ex.submit(returning, "lock")]
            got[name] = [outcome(f) for f in fs] + [outcome(ex.submit(abs, -1))]  # and it goes on
    assert got["arraymp"] == got["stdlib"] == [("SystemExit", 3), ("SystemExit", 2), ("PicklingError", None),
                                                ("TypeError", None), ("result", 1)]


UNPICKLE_EXIT = """
import sys
import arraymp as mp
import concurrent.futures
import test_executor as t

cls = concurrent.futures.ProcessPoolExecutor if sys.argv[2] == "stdlib" else mp.ProcessPoolExecutor
ctx = (mp if sys.argv[2] == "arraymp" else __import__("multiprocessing")).get_context(sys.argv[1])
ex = cls(2, mp_context=ctx)
print(t.outcome(ex.submit(t.returning, "exit at unpickle"))[0])
try:
    ex.submit(abs, 1)
except concurrent.futures.process.BrokenProcessPool:
    print("submit refused")
"""  # and the interpreter exits, the executor never shut down


@pytest.mark.parametrize("method", METHODS)
def test_a_results_systemexit_while_unpickled_breaks_the_executor_and_the_program_still_exits(method):
    # issue 41: the future stayed RUNNING, later calls never ran and the process hung at exit
    for name in ("stdlib", "arraymp"):
        out = subprocess.run([sys.executable, "-c", UNPICKLE_EXIT, method, name], capture_output=True, text=True,
                             timeout=120, env=with_this_module())
        assert (out.returncode, out.stdout.split("\n")) == (0, ["broken", "submit refused", ""]), (name, out.stderr)


AT_EXIT_SUBMIT = """
import atexit, sys

def late(name):
    try:
        ex.submit(abs, -1)
    except RuntimeError as e:
        print(name, e, flush=True)

atexit.register(late, "before import")
import arraymp as mp
import _work

ex = mp.ProcessPoolExecutor(2, mp_context=mp.get_context(sys.argv[1]))
atexit.register(late, "after")
f = ex.submit(_work.nap, 0.3)
"""


@pytest.mark.parametrize("method", METHODS)
def test_a_submit_in_an_atexit_function_is_refused_as_the_stdlibs(method):
    # issue 41: one registered before our executor's module was imported ran before our exit hook, and was taken
    out = subprocess.run([sys.executable, "-c", AT_EXIT_SUBMIT, method], capture_output=True, text=True, timeout=120,
                         env=with_this_module())
    assert out.returncode == 0, out.stderr
    refused = "cannot schedule new futures after interpreter shutdown"
    assert out.stdout.splitlines() == [f"after {refused}", f"before import {refused}"], out.stderr


@pytest.mark.parametrize("method", METHODS)
def test_an_executor_whose_closer_thread_cannot_start_still_shuts_down(method, monkeypatch):
    # issue 41: at interpreter finalization no thread starts; the `with` exit raised RuntimeError, and every later
    # shutdown "cannot join thread before it is started", the workers left running
    import threading

    start = threading.Thread.start

    def refuse_the_closer(thread):
        if thread.name == "ProcessPoolExecutor closer":
            raise RuntimeError("can't create new thread at interpreter shutdown")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_the_closer)
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        fs = [ex.submit(_work.nap, 0.1) for _ in range(4)]
        workers = list(ex._processes.values())
    assert [f.result(0) for f in fs] == [0.1] * 4
    ex.shutdown()
    ex.shutdown(wait=False)
    assert workers and all(w.exitcode is not None for w in workers)


def log_to(queue):
    import logging
    import logging.handlers

    logger = logging.getLogger("concurrent.futures")
    logger.addHandler(logging.handlers.QueueHandler(queue))
    logger.propagate = False
    raise ValueError("error in initializer")


@pytest.mark.parametrize("method", METHODS)
def test_a_failing_initializer_is_logged_to_the_concurrent_futures_logger(method):
    import queue

    ctx = mp.get_context(method)
    logs = ctx.Queue()
    with mp.ProcessPoolExecutor(1, mp_context=ctx, initializer=log_to, initargs=(logs,)) as ex:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            ex.submit(abs, 1).result(TIMEOUT)
    records = [logs.get(timeout=TIMEOUT)]  # (QueueHandler puts the traceback in the message)
    with contextlib.suppress(queue.Empty):  # a replacement may have started before the first failure was settled,
        while True:  # and failed alike (docs/differences.md): each failure is logged, nothing else is
            records.append(logs.get(timeout=0.5))
    assert len(records) <= 2, [r.getMessage() for r in records]
    for record in records:
        assert record.levelname == "CRITICAL" and record.getMessage().startswith("Exception in initializer:")
        assert "ValueError: error in initializer" in record.getMessage()
    logs.close()


@pytest.mark.parametrize("method", METHODS)
def test_submit_starts_the_workers_it_needs_before_it_returns(method):
    # as the stdlib's: one per call while none is idle (under fork all at the first submit), so they can be counted,
    # or signalled, as soon as submit returns (CPython's test_saturation, test_killed_child); ours started later
    with mp.ProcessPoolExecutor(3, mp_context=mp.get_context(method)) as ex:
        assert ex.submit(_work.nap, 0).result(TIMEOUT) == 0
        assert ex.submit(_work.nap, 0).result(TIMEOUT) == 0
        assert len(ex._processes) == (3 if method == "fork" else 1)  # an idle worker takes the next call
        for n in (1, 2, 3, 3):
            ex.submit(_work.nap, 0.5)
            assert len(ex._processes) == (3 if method == "fork" else n)


def broken_submit(ex, kept):
    """A caller's frame: its locals must go when it returns, the error raised in it caught there."""
    try:
        ex.submit(abs, 1)
    except concurrent.futures.process.BrokenProcessPool:
        return


class Kept:
    pass


def keep_nothing(*args):
    pass


@pytest.mark.parametrize("method", METHODS)
def test_what_the_caller_handed_or_held_goes_without_a_garbage_collection(method):
    # CPython's FailingInitializerResourcesTest: an mp.Queue given as initargs lived on past shutdown until a garbage
    # collection (its semaphores reported leaked by the resource tracker): the core's parts refer to each other, and
    # the error a broken executor's submit raised sat in a local of submit's frame, which its traceback holds
    import gc
    import weakref

    ctx = mp.get_context(method)
    gc.disable()
    try:
        kept = Kept()
        ref = weakref.ref(kept)
        with mp.ProcessPoolExecutor(1, mp_context=ctx, initializer=keep_nothing, initargs=(kept,)) as ex:
            assert ex.submit(abs, -1).result(TIMEOUT) == 1
        del ex, kept
        assert ref() is None
        with mp.ProcessPoolExecutor(1, mp_context=ctx, initializer=fail_to_start) as ex:
            with pytest.raises(concurrent.futures.process.BrokenProcessPool):
                ex.submit(abs, 1).result(TIMEOUT)
            kept = Kept()
            ref = weakref.ref(kept)
            broken_submit(ex, kept)
            del kept
            assert ref() is None
    finally:
        gc.enable()


FINALIZED = """
import multiprocessing.util, sys
import arraymp as mp
import _work

ex = mp.ProcessPoolExecutor(1, mp_context=mp.get_context(sys.argv[1]))
fs = [ex.submit(_work.nap, 5) for _ in range(3)]
ex.shutdown(wait=False)
multiprocessing.util._run_finalizers()  # what multiprocessing.util._cleanup_tests, a test suite's cleanup, runs
print([type(f.exception(60)).__name__ for f in fs])
"""  # and the interpreter exits


@pytest.mark.parametrize("method", METHODS)
def test_calls_whose_pool_multiprocessings_finalizers_ended_fail_and_the_program_exits(method):
    # CPython's suite cleans up with multiprocessing.util._cleanup_tests, which runs every finalizer: our executor's
    # core was torn down, its running calls never settled, and the closer thread, which waits for them, hung the
    # interpreter's exit (the stdlib's breaks when its workers die)
    out = subprocess.run([sys.executable, "-c", FINALIZED, method], capture_output=True, text=True, timeout=120,
                         env=with_this_module())
    assert (out.returncode, out.stdout) == (0, "['BrokenProcessPool', 'BrokenProcessPool', 'BrokenProcessPool']\n"), \
        out.stderr


FORKED = """
import os, sys
import arraymp as mp

with mp.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:  # forked in submit, its lock held
    assert ex.submit(abs, -1).result(60) == 1
    pid = os.fork()  # a process of the program's own, forked while the executor runs
    if pid == 0:
        sys.exit(0)  # a normal exit: the interpreter's exit hooks run
    assert os.waitpid(pid, 0)[1] == 0
print("done")
"""


def test_processes_forked_while_an_executor_runs_exit():
    # our exit hook runs in fork children too (threading's, as the stdlib's): it finished the parent's executors
    # there, whose lock the fork may have copied held, and the workers hung at exit, and shutdown with them
    out = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "done\n"), out.stderr


def test_terminate_and_kill_workers_go_through_force_shutdown_as_the_stdlibs(monkeypatch):
    # code (CPython's tests among it) that patches the stdlib's _force_shutdown(operation=...) sees the same call
    calls = []
    with mp.ProcessPoolExecutor(1) as ex:
        monkeypatch.setattr(ex, "_force_shutdown", lambda **kw: calls.append(kw))
        ex.terminate_workers()
        ex.kill_workers()
    assert calls == [{"operation": "terminate"}, {"operation": "kill"}]
    with mp.ProcessPoolExecutor(1) as ex, pytest.raises(ValueError, match="Unsupported operation: 'stop'"):
        ex._force_shutdown(operation="stop")
