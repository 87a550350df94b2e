"""joblib's backend "arraymp" (arraymp.joblib): joblib's own idioms for a backend (context managers, nested calls,
exceptions, batch_size="auto", generators, timeouts, aborting), joblib's options for process backends through either
entry (initializer in every worker, unknown options refused alike), what pickle cannot send by name going by value,
pools inside a loky worker, arrays both ways by shared memory with the big inputs shared once per call, a killed
worker failing instead of hanging, and scikit-learn's n_jobs giving loky's scores. joblib's own test_parallel.py
runs with arraymp beside loky in the joblib_suite nox session (joblib_suite/)."""

import gc
import multiprocessing
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from _work import via_shared_memory

joblib = pytest.importorskip("joblib", reason="joblib is not installed: `pip install 'arraymp[joblib]'`")

from joblib import Parallel, delayed, parallel_backend, parallel_config  # noqa: E402
from mp_reductions import _shared  # noqa: E402

import arraymp as mp  # noqa: E402
import arraymp.joblib  # noqa: E402

METHODS = ["fork", "spawn", "forkserver"]
BIG = 1 << 20  # float64 elements: 8 MiB, over joblib's max_nbytes (1 MB)


@pytest.fixture(autouse=True)
def no_workers_kept():
    """The workers kept between calls go after each test (the leak check counts children)."""
    yield
    arraymp.joblib.shutdown()


# ------------------------------------------------------------------ run by the workers (found in this module)
def pid(*_):
    return os.getpid()


def square(x):
    return x * x


def divide(x, y):
    return x / y


def interrupt(_):
    raise KeyboardInterrupt


def sleep_or_raise(i, started):
    if i == 0:
        time.sleep(0.5)
        raise ValueError("task 0 failed")
    return sleep_long(i, started)


def sleep_long(i, started):
    started[i] = os.getpid()  # started is shared: the caller sees it
    time.sleep(60)
    return i


def kill_self(i):
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return i


def thread_limits(_):
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        blas = []
    else:
        blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    return os.environ["OMP_NUM_THREADS"], blas


def nested(i):
    backend, n_jobs = joblib.parallel.get_active_backend()
    inner = Parallel(n_jobs=2)(delayed(pid)() for _ in range(4))
    return type(backend).__name__, backend.nesting_level, set(inner), os.getpid()


def nested_arraymp(i):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = Parallel(n_jobs=2, backend="arraymp")(delayed(pid)() for _ in range(3))
    return set(inner), os.getpid(), [str(w.message) for w in caught]


def set_tag(*parts):
    os.environ["ARRAYMP_TEST_TAG"] = ":".join(map(str, parts))


def tag(_=None):
    return os.environ.get("ARRAYMP_TEST_TAG"), os.getpid()


def call_with(g, i, f=None):
    return g(i), f(i), os.environ.get("ARRAYMP_TEST_TAG")


def unbox(box):
    return box, type(box).__name__, box.v


def inside_loky(i):
    """Run by a loky worker: arraymp's context, Pool and joblib backend work there (its start method reads "loky")."""
    with mp.Pool(2) as pool:
        squares = pool.map(square, range(4))
    inner = Parallel(n_jobs=2, backend="arraymp")(delayed(pid)() for _ in range(4))
    arraymp.joblib.shutdown()
    with mp.get_context("forkserver").Pool(2) as pool:  # (3.14's default: its children must know "loky")
        served = set(pool.map(pid, range(4)))
    return (multiprocessing.get_start_method(), mp.get_context().get_start_method(), squares, set(inner) | served,
            os.getpid())


def in_a_forked_child(q):
    q.put(Parallel(n_jobs=2, backend="arraymp")(delayed(square)(i) for i in range(4)))
    arraymp.joblib.shutdown()


def inode(a: np.ndarray):
    """Which segment ``a`` views: its name (file_system), or its memfd's inode."""
    seg, _ = _shared.segment_of(a)
    return seg.name or os.fstat(seg.fd).st_ino


def look(x, i):
    """How the worker got ``x``, and a 4 MiB result."""
    return mp.is_shared(x), x.flags.writeable, inode(x), float(x[i]), np.full(BIG // 2, i, np.float64)


def bump(x):
    time.sleep(0.05)
    x[0] += 1
    return float(x[0])


def head(x):
    return x[:1000]  # a view of the input


def fill(out, i):
    out[i] = i * 10  # out is shared: the caller sees this
    return i


# ------------------------------------------------------------------ registration and configuration
@pytest.mark.parametrize("context", [parallel_config, parallel_backend])
def test_backend_is_registered_and_runs_in_worker_processes(context):
    with context("arraymp", n_jobs=3):
        backend, n_jobs = joblib.parallel.get_active_backend()
        assert isinstance(backend, arraymp.joblib.ArraympBackend) and n_jobs == 3
        p = Parallel()
        assert p.n_jobs == 3
        assert p(delayed(square)(i) for i in range(20)) == [i * i for i in range(20)]
        pids = set(Parallel()(delayed(pid)(i) for i in range(20)))
    assert os.getpid() not in pids and 1 <= len(pids) <= 3


def test_n_jobs_minus_one_uses_every_cpu():
    with Parallel(n_jobs=-1, backend="arraymp") as p:
        assert p._effective_n_jobs() == joblib.cpu_count()
        assert p(delayed(square)(i) for i in range(10)) == [i * i for i in range(10)]


def test_n_jobs_one_runs_in_this_process():
    assert Parallel(n_jobs=1, backend="arraymp")(delayed(pid)() for _ in range(3)) == [os.getpid()] * 3


def test_bad_arguments_say_what_is_accepted():
    with pytest.raises(ValueError, match="start_method='thread' is not one of fork, spawn, forkserver"):
        with parallel_config("arraymp", start_method="thread"):
            pass
    with pytest.raises(TypeError, match="takes no argument 'chunks'.*start_method"):
        Parallel(n_jobs=2, backend="arraymp", chunks=3)(delayed(square)(i) for i in range(3))


OPTIONS = "initializer, initargs, idle_worker_timeout, maxtasksperchild, context, start_method, task_timeout"


@pytest.mark.parametrize("entry", ["parallel_config", "parallel_backend", "Parallel"])
def test_an_unknown_or_bad_option_is_refused_alike_through_either_entry(entry):
    # issue 43: parallel_config(backend="arraymp", task_timout=1) was dropped without a word
    def give(**options):
        if entry == "Parallel":
            return Parallel(n_jobs=2, backend="arraymp", **options)(delayed(square)(i) for i in range(2))
        with (parallel_config if entry == "parallel_config" else parallel_backend)("arraymp", n_jobs=2, **options):
            return Parallel()(delayed(square)(i) for i in range(2))

    with pytest.raises(TypeError, match=re.escape(f"takes no argument 'task_timout'; it takes {OPTIONS}")):
        give(task_timout=1)
    with pytest.raises(TypeError, match="initializer must be a callable, not int"):
        give(initializer=3)
    with pytest.raises(ValueError, match="maxtasksperchild must be a positive int or None, not 0"):
        give(maxtasksperchild=0)
    with pytest.raises(ValueError, match="idle_worker_timeout must be a number of seconds"):
        give(idle_worker_timeout=-1)
    if entry != "Parallel":  # (Parallel passes the backend joblib's own context: only parallel_config has ours)
        with pytest.raises(ValueError, match="start_method='fork' and context=.* disagree"):
            give(start_method="fork", context="spawn")
    assert give(maxtasksperchild=1) == [0, 1]


@pytest.mark.parametrize("entry", ["parallel_config", "parallel_backend", "Parallel"])
def test_the_initializer_runs_in_every_worker_also_those_started_later(entry):
    # issue 43: joblib's initializer / initargs (loky's and multiprocessing's); maxtasksperchild=2 retires the
    # workers as the call runs, and each fresh one runs the initializer before its first task
    options = dict(initializer=set_tag, initargs=("ready", 1), maxtasksperchild=2)
    calls = (delayed(tag)(i) for i in range(12))
    if entry == "Parallel":
        out = Parallel(n_jobs=2, backend="arraymp", batch_size=1, **options)(calls)
    else:
        with (parallel_config if entry == "parallel_config" else parallel_backend)("arraymp", n_jobs=2, **options):
            out = Parallel(batch_size=1)(calls)
    assert {t for t, _ in out} == {"ready:1"}
    assert len({p for _, p in out}) >= 4  # six pairs of tasks: workers replaced, every one initialized


def test_workers_are_kept_for_an_equal_initializer_and_replaced_for_another():
    def run(*initargs):
        return Parallel(n_jobs=2, backend="arraymp", initializer=set_tag, initargs=initargs)(
            delayed(tag)(i) for i in range(8))

    first = run("a", np.arange(3))  # an array: equal only to itself
    assert {t for t, _ in first} == {"a:[0 1 2]"}
    other = run("b", np.arange(3))
    assert {t for t, _ in other} == {"b:[0 1 2]"} and not {p for _, p in other} & {p for _, p in first}
    again = run("b", np.arange(3))
    assert not {p for _, p in again} & {p for _, p in other}  # another array: new workers, as loky's
    args = ("c", 1)
    kept = run(*args)
    workers = {p.pid for p in arraymp._joblibpool._CURRENT.pool._pool}  # (one may have run all 8: a loaded machine)
    assert {p for _, p in kept} <= workers
    assert {p for _, p in run(*args)} <= workers  # equal arguments: the same workers


def test_the_context_option_chooses_the_start_method():
    with parallel_config("arraymp", n_jobs=2, context=multiprocessing.get_context("spawn")):
        assert Parallel()(delayed(square)(i) for i in range(4)) == [0, 1, 4, 9]
        assert arraymp._joblibpool._CURRENT.pool._ctx.get_start_method() == "spawn"


@pytest.mark.parametrize("method", METHODS)
def test_what_pickle_cannot_send_by_name_goes_by_value(method):
    # issue 43: a closure initializer, lambdas as arguments and keyword arguments, an instance of a class defined
    # in a function (and it comes back as that class), under every start method, as loky sends them
    k = 7

    class Box:
        def __init__(self, v):
            self.v = v

    with parallel_config("arraymp", n_jobs=2, start_method=method, initializer=lambda f: set_tag(f(k)),
                         initargs=(lambda x: x * 6,)):
        out = Parallel()(delayed(call_with)(lambda x: x + k, i, f=lambda y: -y) for i in range(4))
        boxes = Parallel()(delayed(unbox)(Box(i)) for i in range(3))
    assert out == [(i + 7, -i, "42") for i in range(4)]
    assert [(type(b) is Box, name, v) for b, name, v in boxes] == [(True, "Box", i) for i in range(3)]


def test_workers_are_reused_between_calls_until_shutdown():
    with parallel_config("arraymp", n_jobs=2):
        first = set(Parallel()(delayed(pid)(i) for i in range(40)))
        workers = {p.pid for p in arraymp._joblibpool._CURRENT.pool._pool}  # (one may have run all 40: a loaded
        second = set(Parallel()(delayed(pid)(i) for i in range(40)))  # machine starts the other late)
        assert first <= workers and second <= workers
        assert {p.pid for p in arraymp._joblibpool._CURRENT.pool._pool} == workers
        arraymp.joblib.shutdown()
        third = set(Parallel()(delayed(pid)(i) for i in range(40)))
    assert not third & workers


def test_idle_workers_stop_after_idle_worker_timeout():
    with parallel_config("arraymp", n_jobs=2, idle_worker_timeout=0.5):
        first = set(Parallel()(delayed(pid)(i) for i in range(20)))
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in first)
        assert not set(Parallel()(delayed(pid)(i) for i in range(20))) & first  # a new pool for the next call


def test_a_different_n_jobs_gets_a_new_pool_and_the_old_one_goes():
    first = set(Parallel(n_jobs=2, backend="arraymp")(delayed(pid)(i) for i in range(40)))
    second = set(Parallel(n_jobs=3, backend="arraymp")(delayed(pid)(i) for i in range(60)))
    assert not second & first
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in first)


def _alive(p: int) -> bool:
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("inner", [None, 3])
def test_workers_limit_blas_threads_to_their_share(inner):
    with parallel_config("arraymp", n_jobs=2, inner_max_num_threads=inner):
        out = Parallel()(delayed(thread_limits)(i) for i in range(4))
    expected = inner or max(joblib.cpu_count() // 2, 1)
    assert all(omp == str(expected) and all(n == expected for n in blas) for omp, blas in out), out


@pytest.mark.parametrize("method", METHODS)
def test_start_method_is_chosen(method):
    with parallel_config("arraymp", n_jobs=2, start_method=method):
        assert Parallel()(delayed(square)(i) for i in range(8)) == [i * i for i in range(8)]
        assert arraymp._joblibpool._CURRENT.pool._ctx.get_start_method() == method


# ------------------------------------------------------------------ arrays
@pytest.mark.parametrize("method", METHODS)
def test_big_inputs_are_shared_once_per_call_and_results_come_by_shared_memory(method):
    x = np.random.default_rng(0).random(BIG)
    out = Parallel(n_jobs=2, backend="arraymp", start_method=method)(delayed(look)(x, i) for i in range(12))
    shared, writable, inodes, values, results = zip(*out, strict=True)
    assert all(shared) and not any(writable)  # a handle to a read-only copy: loky's mmap_mode="r"
    assert len(set(inodes)) == 1  # one copy for the twelve tasks
    assert list(values) == [x[i] for i in range(12)]
    for i, r in enumerate(results):
        assert via_shared_memory(r) and not mp.is_shared(r)  # by shared memory, the caller's own
        assert r.flags.writeable and r.shape == (BIG // 2,) and (r == i).all()
    assert x.flags.writeable and not mp.is_shared(x)  # the caller's array is left as it was


def test_file_system_strategy_leaves_no_segment_behind():
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # named segments: the leak check counts them in ARRAYMP_SHM_DIR
    try:
        x = np.random.default_rng(1).random(BIG)
        with parallel_config("arraymp", n_jobs=2, start_method="fork"):  # forked workers share the strategy
            out = Parallel()(delayed(look)(x, i) for i in range(6))
        assert all(o[0] and not o[1] for o in out) and len({o[2] for o in out}) == 1
        assert [o[3] for o in out] == list(x[:6])
        assert all(via_shared_memory(o[4]) and (o[4] == i).all() for i, o in enumerate(out))
        del out
    finally:
        arraymp.joblib.shutdown()
        mp.set_sharing_strategy(old)


def test_a_keyword_array_is_shared_once_too():
    x = np.random.default_rng(3).random(BIG)
    out = Parallel(n_jobs=2, backend="arraymp")(delayed(look)(x=x, i=i) for i in range(6))
    assert all(o[0] and not o[1] for o in out) and len({o[2] for o in out}) == 1


def test_a_memory_map_input_is_read_once_into_shared_memory(tmp_path):
    x = np.random.default_rng(2).random(BIG)
    joblib.dump(x, tmp_path / "x.joblib")
    m = joblib.load(tmp_path / "x.joblib", mmap_mode="r")
    assert isinstance(m, np.memmap)
    out = Parallel(n_jobs=2, backend="arraymp")(delayed(look)(m, i) for i in range(6))
    assert all(o[0] and not o[1] for o in out) and len({o[2] for o in out}) == 1  # one shared copy, by handle
    assert [o[3] for o in out] == list(x[:6])


def test_max_nbytes_none_gives_each_task_a_copy_and_r_plus_one_writable_copy():
    x = np.ones(BIG)
    out = Parallel(n_jobs=2, backend="arraymp", max_nbytes=None)(delayed(bump)(x) for i in range(6))
    assert out == [2.0] * 6  # each task wrote into a copy of its own
    out = Parallel(n_jobs=2, backend="arraymp", mmap_mode="r+", batch_size=1)(delayed(bump)(x) for i in range(6))
    assert max(out) > 2.0  # the call's tasks wrote into one copy
    assert x[0] == 1.0  # never into the caller's array


def test_a_result_viewing_an_input_comes_back_as_a_writable_copy():
    x = np.arange(BIG, dtype=np.float64)
    r = Parallel(n_jobs=2, backend="arraymp")(delayed(head)(x) for _ in range(3))
    for a in r:
        assert a.flags.writeable and (a == x[:1000]).all()
        a += 1  # loky's results are plain arrays: so are ours


def test_a_shared_array_is_written_in_place_by_the_workers():
    out = mp.zeros_shared(200, np.int64)
    assert Parallel(n_jobs=2, backend="arraymp")(delayed(fill)(out, i) for i in range(200)) == list(range(200))
    assert (out == np.arange(200) * 10).all()


# ------------------------------------------------------------------ errors
def test_exception_is_raised_with_the_workers_traceback():
    with pytest.raises(ZeroDivisionError) as info:
        Parallel(n_jobs=2, backend="arraymp")(delayed(divide)(1, y) for y in (1, 0, 2))
    assert "in divide" in str(info.value.__cause__) and "return x / y" in str(info.value.__cause__)


def test_keyboard_interrupt_in_a_task_is_raised_and_the_backend_goes_on():
    with Parallel(n_jobs=2, backend="arraymp") as p:
        with pytest.raises(KeyboardInterrupt):
            p(delayed(interrupt)(i) for i in range(2))
        assert p(delayed(square)(i) for i in range(10)) == [i * i for i in range(10)]


def test_an_error_cancels_the_remaining_work():
    started = mp.zeros_shared(20, np.int64)
    with parallel_config("arraymp", n_jobs=2):
        with pytest.raises(ValueError, match="task 0 failed"):
            Parallel(batch_size=1)(delayed(sleep_or_raise)(i, started) for i in range(20))
        sleepers = [int(p) for p in started if p]
        assert 1 <= len(sleepers) <= 2  # what ran beside task 0 (the others never started) ...
        _wait_gone(sleepers)  # ... was killed, not let sleep its 60 s
        assert len(Parallel()(delayed(pid)() for _ in range(4))) == 4  # and the backend goes on


def test_timeout_raises_and_kills_the_late_tasks():
    started = mp.zeros_shared(4, np.int64)
    # the workers started first (they are kept for the next call): under 3.14's forkserver on a loaded machine,
    # starting them took longer than the timeout, and no task had started when it struck
    assert len(Parallel(n_jobs=2, backend="arraymp")(delayed(pid)() for _ in range(2))) == 2
    with pytest.raises(multiprocessing.TimeoutError):  # what joblib raises, as for loky
        Parallel(n_jobs=2, backend="arraymp", timeout=2, batch_size=1)(
            delayed(sleep_long)(i, started) for i in range(4)
        )
    sleepers = [int(p) for p in started if p]
    assert sleepers
    _wait_gone(sleepers)


@pytest.mark.parametrize("how", ["parallel", "parallel_config"])
def test_task_timeout_ends_the_stuck_task_and_names_it(how):
    # issue 34: a task past the backend's task_timeout has its worker ended and fails with TaskTimeoutError, which
    # Parallel raises (cancelling the rest, as for any task's error); each task is its own batch, so the limit
    # is each task's
    started = mp.zeros_shared(4, np.int64)
    calls = (delayed(sleep_long if i == 1 else pid)(*((i, started) if i == 1 else ())) for i in range(4))
    with pytest.raises(mp.TaskTimeoutError, match=r"^task 1 of a joblib\.Parallel call \(sleep_long\(1, ") as info:
        if how == "parallel":
            Parallel(n_jobs=2, backend="arraymp", task_timeout=1)(calls)
        else:
            with parallel_config("arraymp", n_jobs=2, task_timeout=1):
                Parallel()(calls)
    assert info.value.limit == 1.0 and info.value.pid == started[1]
    assert "cancels the rest of the call" in info.value.__notes__[0]
    _wait_gone([int(started[1])])
    with parallel_config("arraymp", n_jobs=2, task_timeout=30):  # a limit no task reaches changes nothing
        assert Parallel(batch_size="auto")(delayed(square)(i) for i in range(100)) == [i * i for i in range(100)]


def test_a_bad_task_timeout_says_what_it_takes():
    for bad, error in ((-1, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="task_timeout must be a"):
            Parallel(n_jobs=2, backend="arraymp", task_timeout=bad)(delayed(square)(i) for i in range(2))


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"workers {pids} still run their 60 s tasks"


def test_killed_worker_raises_worker_lost_error_instead_of_hanging():
    with parallel_config("arraymp", n_jobs=2):
        with pytest.raises(mp.WorkerLostError, match="SIGKILL"):
            Parallel(batch_size=1, timeout=60)(delayed(kill_self)(i) for i in range(8))
        assert Parallel()(delayed(square)(i) for i in range(4)) == [0, 1, 4, 9]


def test_a_managed_parallel_works_after_an_error():
    with Parallel(n_jobs=2, backend="arraymp") as p:
        with pytest.raises(ZeroDivisionError):
            p(delayed(divide)(1, y) for y in (1, 0))
        assert p(delayed(square)(i) for i in range(10)) == [i * i for i in range(10)]
        assert p(delayed(square)(i) for i in range(10)) == [i * i for i in range(10)]


# ------------------------------------------------------------------ joblib's idioms
def test_nested_parallel_runs_on_threads_in_the_worker_as_under_loky():
    out = Parallel(n_jobs=2, backend="arraymp")(delayed(nested)(i) for i in range(4))
    for backend, level, inner, worker in out:
        assert (backend, level) == ("ThreadingBackend", 1) and inner == {worker} and worker != os.getpid()


def test_the_arraymp_backend_inside_its_own_worker_runs_there_and_says_so():
    # the workers are daemonic, as the stdlib Pool's: no pool of their own (loky's start one: docs/joblib.md)
    out = Parallel(n_jobs=2, backend="arraymp")(delayed(nested_arraymp)(i) for i in range(2))
    for inner, worker, caught in out:
        assert inner == {worker} and any("cannot be nested in a worker process" in w for w in caught)


def test_pools_work_inside_a_loky_worker():
    # issue 43: a loky worker's start method reads "loky"; arraymp's context falls back to the platform's default
    # there, as the stdlib's Pool runs there, so mp.Pool(), mp.get_context() and the backend work in any library
    # that nests under joblib's default backend
    from joblib.externals.loky import get_reusable_executor

    try:
        out = Parallel(n_jobs=2)(delayed(inside_loky)(i) for i in range(2))  # joblib's default backend: loky
    finally:
        get_reusable_executor().shutdown(wait=True)  # loky keeps its workers: the leak check counts children
    for theirs, ours, squares, inner, worker in out:
        assert theirs == "loky" and ours == multiprocessing.get_all_start_methods()[0]
        assert squares == [0, 1, 4, 9] and inner and worker not in inner  # processes of their own


def test_a_forked_child_of_a_caller_runs_a_pool_of_its_own():
    # the parent's pool, kept for its next call, came with the fork without its threads: the child must not use it
    assert Parallel(n_jobs=2, backend="arraymp")(delayed(square)(i) for i in range(4)) == [0, 1, 4, 9]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=in_a_forked_child, args=(q,))
    child.start()
    try:
        assert q.get(timeout=60) == [0, 1, 4, 9]
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_batch_size_auto_batches_tiny_tasks():
    with Parallel(n_jobs=2, batch_size="auto", backend="arraymp") as p:
        assert p(delayed(square)(i) for i in range(5000)) == [i * i for i in range(5000)]
        assert p._backend.compute_batch_size() > 1


def test_return_as_generator():
    g = Parallel(n_jobs=2, backend="arraymp", return_as="generator")(delayed(square)(i) for i in range(50))
    assert not isinstance(g, list)
    assert list(g) == [i * i for i in range(50)]


@pytest.mark.parametrize("n_jobs", [2, 4])
def test_generator_unordered_never_holds_fast_results_behind_a_slow_task(n_jobs):
    # issue 43, joblib's test_parallel_unordered_generator_returns_fastest_first again and again: each call on new
    # workers, one of which may not have taken its first messages when the others are done (slots Note [lost
    # tasks]); every fast result comes before the slow one
    for _ in range(4):
        arraymp.joblib.shutdown()
        g = Parallel(n_jobs=n_jobs, backend="arraymp", return_as="generator_unordered")(
            delayed(_sleep_id)(20.0 if i == 1 else 0.0, i) for i in range(10))
        t0 = time.monotonic()
        assert sorted(next(g) for _ in range(9)) == [0, *range(2, 10)]
        assert time.monotonic() - t0 < 20
        with pytest.warns(UserWarning, match="cancelled"):  # joblib says so
            del g  # joblib aborts the call: its slow task's worker is ended
            gc.collect()


def test_generator_unordered_sends_each_batch_alone():
    # with every batch dispatched at once the pool has many ready and would batch them (slots Note [batches]); a
    # slow one must hold none behind it when results are wanted as they finish
    for _ in range(5):  # short tasks measured: the pool batches now (a loaded machine may make them read long)
        assert len(Parallel(n_jobs=2, backend="arraymp", batch_size=1)(delayed(square)(i) for i in range(2000))) == 2000
        if arraymp._joblibpool._CURRENT.pool._core.slots.n > 1:
            break
    else:
        pytest.skip(f"the pool measured short tasks as {arraymp._joblibpool._CURRENT.pool._core.slots.per_task} s each")
    g = Parallel(n_jobs=2, backend="arraymp", return_as="generator_unordered", pre_dispatch="all", batch_size=1)(
        delayed(_sleep_id)(20.0 if i == 150 else 0.0, i) for i in range(300))  # (150: sent with others ready)
    t0 = time.monotonic()
    assert 150 not in {next(g) for _ in range(299)}
    assert time.monotonic() - t0 < 20
    with pytest.warns(UserWarning, match="cancelled"):  # joblib aborts the call, and says so
        del g
        gc.collect()


def _sleep_id(s, i):
    time.sleep(s)
    return i


def test_return_as_generator_unordered_yields_in_completion_order():
    out = list(
        Parallel(n_jobs=2, backend="arraymp", return_as="generator_unordered", batch_size=1)(
            delayed(_sleep_then)(s) for s in (1.5, 0.0, 0.0)
        )
    )
    assert out[0] == 0.0 and sorted(out) == [0.0, 0.0, 1.5]  # "generator" would yield the slow one first


def _sleep_then(s):
    time.sleep(s)
    return s


def test_a_dropped_generator_does_not_break_another_call():
    g = Parallel(n_jobs=2, backend="arraymp", return_as="generator", batch_size=1)(
        delayed(_sleep_then)(0.3) for _ in range(6)
    )
    assert next(g) == 0.3
    h = Parallel(n_jobs=2, backend="arraymp", return_as="generator", batch_size=1, timeout=30)(
        delayed(square)(i) for i in range(20)
    )
    with pytest.warns(UserWarning, match="cancelled"):
        del g  # joblib aborts it: the pool is shared with h, whose tasks must not be killed
        gc.collect()
    assert list(h) == [i * i for i in range(20)]  # loky raises "The executor underlying Parallel has been shutdown"


def test_lambdas_and_closures_run_under_spawn():
    k = 3
    with parallel_config("arraymp", n_jobs=2, start_method="spawn"):
        assert Parallel()(delayed(lambda x: x + k)(i) for i in range(5)) == [3, 4, 5, 6, 7]


def test_readme_example_runs_and_says_what_happened(tmp_path):
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"^### joblib and scikit-learn\n.*?```python\n(.*?)^```", readme, re.M | re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "came back through shared memory" in out.stdout


def test_missing_joblib_says_how_to_install_it():
    code = "import sys; sys.modules['joblib'] = None\nimport arraymp.joblib"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError: arraymp.joblib needs joblib" in out.stderr and "arraymp[joblib]" in out.stderr


# ------------------------------------------------------------------ scikit-learn
def test_cross_val_score_gives_loky_s_scores():
    pytest.importorskip("sklearn", reason="scikit-learn is not installed")
    from sklearn.datasets import make_classification
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import cross_val_score

    X, y = make_classification(n_samples=600, n_features=20, random_state=0)

    def scores():
        return cross_val_score(RandomForestClassifier(n_estimators=50, random_state=0), X, y, cv=4, n_jobs=2)

    with parallel_config("loky"):
        loky = scores()
    from joblib.externals.loky import get_reusable_executor

    get_reusable_executor().shutdown(wait=True)  # loky keeps its workers: the leak check counts children
    with parallel_config("arraymp"):
        ours = scores()
    assert list(ours) == list(loky) and len(ours) == 4


def test_grid_search_over_a_pipeline_with_a_class_defined_in_a_function():
    # issue 43, scikit-learn's test_dispatch_config_parallel[2]: a transformer class defined inside a function, in
    # a pipeline that GridSearchCV clones and sends to the workers
    pytest.importorskip("sklearn", reason="scikit-learn is not installed")
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    class Scaler(StandardScaler):
        def fit(self, X, y=None):
            self.seen_ = X.shape
            return super().fit(X, y)

    X, y = make_classification(n_samples=200, n_features=8, random_state=2)
    search = GridSearchCV(make_pipeline(Scaler(), LogisticRegression(max_iter=500)),
                          {"logisticregression__C": [0.1, 1.0, 10.0]}, cv=3, n_jobs=2, error_score="raise")
    with parallel_config("arraymp"):
        search.fit(X, y)
    serial = GridSearchCV(make_pipeline(Scaler(), LogisticRegression(max_iter=500)),
                          {"logisticregression__C": [0.1, 1.0, 10.0]}, cv=3).fit(X, y)
    assert list(search.cv_results_["mean_test_score"]) == list(serial.cv_results_["mean_test_score"])
    assert isinstance(search.best_estimator_.steps[0][1], Scaler)


def test_grid_search_cv_finds_what_a_sequential_search_finds():
    pytest.importorskip("sklearn", reason="scikit-learn is not installed")
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV

    X, y = make_classification(n_samples=300, n_features=10, random_state=1)

    def search(n_jobs):
        return GridSearchCV(LogisticRegression(max_iter=500), {"C": [0.01, 0.1, 1, 10]}, cv=3, n_jobs=n_jobs).fit(X, y)

    serial = search(None)
    with parallel_config("arraymp", n_jobs=2):
        ours = search(2)
    assert ours.best_params_ == serial.best_params_
    assert list(ours.cv_results_["mean_test_score"]) == list(serial.cv_results_["mean_test_score"])
