"""Arrays born in shared memory: numpy's allocations of 1 MiB or more in recycled segments (issue 22, _alloc Note
[shared allocation]), across real processes under every start method where the start method matters."""

import asyncio
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import _alloc_targets as T
import _targets
import mp_reductions as mpr
import numpy as np
import pytest
from _views import via_shared_memory
from mp_reductions import _recycle

METHODS = ["fork", "spawn", "forkserver"]
TIMEOUT = 60


@pytest.fixture(params=METHODS)
def ctx(request):
    return multiprocessing.get_context(request.param)


def memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "/memfd:arraymp" in line})


def born(*args, fill=None):
    with mpr.shared_allocation():
        return np.full(*args, fill) if fill is not None else np.zeros(*args)


def test_pool_results_the_worker_keeps_come_back_as_copies_equal_to_those_without(ctx):
    # a Pool of 1: the task that reads the kept result runs where it was made; on by default
    with mpr.Pool(1, context=ctx) as pool:
        on = pool.map(T.result_kept, range(4))
        on[2][:] = -1
        assert pool.apply(T.kept_value, (2,)) == 2  # kept by the worker: a snapshot (Note [moving results])
    with mpr.Pool(1, context=ctx, shared_results=False) as pool:
        off = pool.map(T.result_kept, range(4))
        off[2][:] = -1
        assert pool.apply(T.kept_value, (2,)) == 2  # a copy
    on[2][:] = off[2][:] = 2
    assert all(via_shared_memory(a) and not mpr.is_shared(a) for a in on + off)  # copies: the caller's own
    assert [a.tolist() for a in on] == [a.tolist() for a in off] == [[float(i)] * T.N for i in range(4)]


def test_queue_sends_a_born_array_and_its_view_without_a_copy(ctx):
    a = born((512, 1024), np.float32)
    assert mpr.is_shared(a) and mpr.is_shared(a[:, 1])
    q, done = mpr.Queue(), mpr.Queue()
    q.put(a)
    q.put(a[:, 1])
    p = ctx.Process(target=_targets.fill_from_queue, args=(q, done, 4))
    p.start()
    assert done.get(timeout=TIMEOUT) == "ok"
    p.join(TIMEOUT)
    assert p.exitcode == 0 and (a == 4).all()


def test_small_arrays_other_threads_and_tasks_are_untouched():
    with mpr.shared_allocation():
        assert not mpr.is_shared(np.ones(1000))  # under the threshold: numpy's memory
        in_thread = []
        t = threading.Thread(target=lambda: in_thread.append(mpr.is_shared(np.ones(1 << 20))))
        t.start()
        t.join()
        assert in_thread == [False]
        assert mpr.is_shared(np.ones(1 << 20))

    async def outside():
        return mpr.is_shared(np.ones(1 << 20))

    async def inside():
        with mpr.shared_allocation():
            await asyncio.sleep(0.01)
            return mpr.is_shared(np.ones(1 << 20))

    async def both():
        return await asyncio.gather(inside(), outside())

    assert asyncio.run(both()) == [True, False]
    assert not mpr.is_shared(np.ones(1 << 20))


def test_process_wide_switch_and_calloc_of_a_recycled_segment():
    mpr.set_shared_allocation(True)
    try:
        a = np.full(1 << 18, 7.0)
        seg = mpr_segment(a)
        del a
        z = np.zeros(1 << 18)  # calloc: the same segment, recycled, must read zeros
        assert mpr_segment(z) is seg and not z.any()
    finally:
        mpr.set_shared_allocation(False)
    assert not mpr.is_shared(np.zeros(1 << 18))


def mpr_segment(a):
    from mp_reductions import _shared

    return _shared.segment_of(a)[0]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_realloc_keeps_values_and_sharing(method):
    a = born(T.N, np.float32)
    a[:] = np.arange(T.N)
    a.resize(2 * T.N, refcheck=False)  # numpy's realloc: a new segment, the data moved
    assert mpr.is_shared(a) and (a[:T.N] == np.arange(T.N)).all() and not a[T.N:].any()
    with mpr.shared_allocation():
        tiled = np.resize(a[:T.N], 3 * T.N)  # np.resize: a new array, under the handler too
    assert mpr.is_shared(tiled) and (tiled[2 * T.N:] == np.arange(T.N)).all()
    small = born(T.N, fill=5.0)
    small.resize(1000, refcheck=False)  # shrunk under the threshold: into numpy's memory
    assert not mpr.is_shared(small) and (small == 5).all()
    q, done = mpr.Queue(), mpr.Queue()
    p = multiprocessing.get_context(method).Process(target=T.double_in_place, args=(q, done))
    p.start()
    q.put(a)
    assert done.get(timeout=TIMEOUT) == "ok"
    p.join(TIMEOUT)
    assert (a[:T.N] == 2 * np.arange(T.N)).all()


def test_a_view_outlives_its_base_and_the_segment_comes_back():
    a = born(4 * T.N, fill=3.0)
    seg = mpr_segment(a)
    v = a[T.N:2 * T.N]
    del a
    gc.collect()
    q, done = mpr.Queue(), mpr.Queue()
    p = multiprocessing.get_context("spawn").Process(target=T.double_in_place, args=(q, done))
    p.start()
    q.put(v)
    assert done.get(timeout=TIMEOUT) == "ok"
    p.join(TIMEOUT)
    assert (v == 6).all() and mpr_segment(v) is seg
    del v
    deadline = time.monotonic() + 10
    while True:  # numpy freed it: back in the pool, free once the child's view is gone
        again = born(4 * T.N, np.float32)
        if mpr_segment(again) is seg or time.monotonic() > deadline:
            break
        del again
        time.sleep(0.05)
    assert mpr_segment(again) is seg and not again.any()


def test_arrays_freed_in_other_threads_go_back_to_the_pool():
    _recycle.release_all()  # the pool holds only this test's segments (earlier tests' free ones would fit too)
    arrays = [born(T.N, fill=float(i)) for i in range(8)]
    segments = {id(mpr_segment(a)) for a in arrays}
    chunks = [arrays[i::4] for i in range(4)]
    del arrays
    threads = [threading.Thread(target=chunk.clear) for chunk in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = [born(T.N, np.float32) for _ in range(8)]
    assert {id(mpr_segment(a)) for a in again} == segments and not any(a.any() for a in again)


def test_a_fork_child_never_recycles_its_parents_segments():
    ctx = multiprocessing.get_context("fork")
    holder = [born(T.N, fill=1.0)]
    kept = born(T.N, fill=7.0)
    go, out = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=T.fork_child_allocates, args=(holder, go, out, 8))
    p.start()
    holder.clear()  # the parent's free: its segment waits in its pool for the child's view to go
    go.set()
    pid, creators, wrong = out.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert p.exitcode == 0 and wrong == 0
    assert creators == [pid], f"the child handed out segments made by {creators} (it is {pid}, parent {os.getpid()})"
    assert (kept == 7).all()


def test_a_worker_killed_while_holding_handler_memory_leaves_nothing(ctx):
    before = memfd_mappings()
    slots = mpr.zeros_shared((1,), np.int64)
    with mpr.Pool(1, initializer=mpr.set_shared_allocation, initargs=(True,), context=ctx) as pool:
        got = pool.apply(T.result_kept, (3,))
        blocked = pool.apply_async(T.hold_then_sleep, (slots, 60))
        deadline = time.monotonic() + TIMEOUT
        while slots[0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(int(slots[0]), signal.SIGKILL)
        with pytest.raises(mpr.WorkerLostError):
            blocked.get(TIMEOUT)
        assert (got == 3).all()  # what the parent received stays
        assert pool.apply(T.result_kept, (5,))[0] == 5  # the replacement serves
    del got, slots
    _recycle.release_all()
    deadline = time.monotonic() + 10
    while memfd_mappings() > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert memfd_mappings() <= before


def test_off_under_the_file_system_strategy(strategy):
    a = born(T.N, fill=2.0)
    assert mpr.is_shared(a) == (strategy == "file_descriptor")
    q = mpr.Queue()
    q.put(a)
    b = q.get(timeout=TIMEOUT)
    assert (b == 2).all() and b.shape == a.shape


def test_interpreter_exit_with_live_handler_arrays_is_clean():
    # arrays alive at exit: in globals, in a cycle, in a daemon thread freeing as it goes, a view sent and kept,
    # and in builtins and sys, freed after every other module is gone (numpy's free then must not call Python)
    code = """if True:
        import builtins, sys, threading, time, numpy as np, mp_reductions as mpr
        mpr.init_reductions()
        mpr.set_shared_allocation(True)
        g = [np.ones(1 << 18) for _ in range(4)]
        cycle = [np.ones(1 << 18)]; cycle.append(cycle)
        def churn():
            while True:
                a = np.ones(1 << 18); del a
        threading.Thread(target=churn, daemon=True).start()
        q = mpr.Queue(); q.put(g[0][10:]); kept = q.get(timeout=30)
        builtins._arraymp_kept = np.ones(1 << 18); sys._arraymp_kept = np.ones(1 << 18)
        time.sleep(0.2)
        print("done")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------- born private (Pool and executor workers: issue 35)
def private(*args, fill=0.0):
    """An array born private, as a Pool worker makes it (plain numpy code, under set_shared_allocation(private))."""
    from mp_reductions import _alloc

    token = _alloc._private.set(True)
    old = mpr_native().swap_handler(mpr_native().shared_handler)
    try:
        return np.full(*args, fill)
    finally:
        mpr_native().swap_handler(old)
        _alloc._private.reset(token)


def mpr_native():
    import shm_core
    from mp_reductions import _alloc

    _alloc._install()
    return shm_core


def private_segment(a):
    from mp_reductions import _shared

    found = _shared.segment_of(a, _shared.BORN_PRIVATE)
    return None if found is None else found[0]


KEPT_HERE = []


def test_a_born_private_array_is_a_plain_arrays_memory_to_everyone_but_a_move():
    a = private(T.N, fill=3.0)
    assert private_segment(a) is not None and not mpr.is_shared(a) and not mpr.is_shared(a[10:])
    q = mpr.Queue()
    q.put(a)  # a plain array's way: a copy
    b = q.get(timeout=TIMEOUT)
    b[:] = -1
    assert (a == 3).all()
    shared = mpr.share_memory({"a": a})["a"]  # a copy of it, as of any unshared array
    assert mpr.is_shared(shared) and mpr_segment(shared) is not private_segment(a)


def test_moves_gives_only_arrays_held_by_the_result_alone():
    # each result is built so that no local of this test holds what it holds (a local is a reference from elsewhere)
    from mp_reductions._alloc import moves

    result = (True, private(T.N))
    assert moves(result) == {id(result[1])}
    fresh = result[1]
    assert moves(result) == set()  # the local ``fresh`` holds it too
    del fresh
    KEPT_HERE.append(private(T.N))  # a global holds it: never moved, nor a view of it
    assert moves((True, KEPT_HERE[-1])) == set() and moves((True, [KEPT_HERE[-1][1:]])) == set()
    base = private((2, T.N))
    result = (True, [{"row": base[1], "col": base[:, 3]}])
    assert moves(result) == set()  # the local ``base`` holds the base of both views
    del base
    row, col = result[1][0]["row"], result[1][0]["col"]
    assert moves(result) == set()  # and now ``row`` and ``col`` hold them
    result[1].append((row, row))
    del row, col
    row, col = (id(result[1][0]["row"]), id(result[1][0]["col"]))
    assert moves(result) == {row, col, id(result[1][0]["row"].base)}
    KEPT_HERE.append([private(T.N)])  # the list is held elsewhere: what it holds is too
    assert moves((True, KEPT_HERE[-1])) == set()
    result = (True, [private(T.N)])
    result[1].append(result[1])  # a cycle of the result's own
    assert moves(result) == {id(result[1][0])}
    result = (True, private(T.N))
    other = result[1][::2]  # a view kept outside the result pins its base
    assert moves(result) == set()
    del other
    assert moves(result) == {id(result[1])}
    assert moves((True, [[0] * 50_000, [1] * 50_001, private(T.N)])) == set()  # past WALK_MAX: copied, never wrong
    result = (True, [[0.5] * 50_000, private(T.N)])
    assert moves(result) == {id(result[1][1])}  # atoms count toward WALK_MAX, and are never held
    assert moves((True, np.ones(T.N))) == set()  # numpy's own memory: nothing to move
    assert moves((True, [1, "x", None])) == set()
    KEPT_HERE.clear()


def test_small_arrays_beside_a_live_born_private_one_travel_inline_and_whole():
    # _reductions Note [small arrays]: with a born-private array alive (``_shared.owned`` not empty), a small array
    # that owns its data still skips the search for a segment; a small view of the born-private one is searched
    # for, and copied inline too (it is a plain array's memory to any message that does not move it)
    from mp_reductions import _shared

    keep = private(T.N, fill=3.0)
    assert _shared.owned
    small = [np.arange(5.0), np.arange(6, dtype=">i4"), keep[:3], np.ones(8)[::2], np.zeros(4, np.float32)]
    small[4].flags.writeable = False
    a, b = mpr.Pipe()
    with mpr.stats() as counted:
        a.send(small)
        got = b.recv()
    assert counted.arrays_inline == len(small)
    for sent, came in zip(small, got, strict=True):
        assert np.array_equal(sent, came) and sent.dtype == came.dtype
        assert came.flags.writeable == sent.flags.writeable and not np.shares_memory(came, keep)
    got[2][0] = -1.0
    assert keep[0] == 3.0  # a snapshot
    a.close()
    b.close()
    del keep


def test_fork_gives_the_child_born_private_arrays_copy_on_write():
    import shm_core
    from mp_reductions import _attach, _shared

    a = private(T.N, fill=2.0)
    seg = private_segment(a)
    views_before = seg.load(_shared._VIEWS)
    file = shm_core.attach_fd(_attach.fd_for_sending(seg, dup=True))  # the file itself, mapped once more
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its writes are its own, and it sees the array as it was at the fork
        os.close(r)
        try:
            ok = (a == 2).all()
            a[:] = 4
            os.write(w, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 8) == b"ok"
    os.close(r)
    os.waitpid(pid, 0)
    assert (a == 2).all()
    assert private_segment(a) is None and not mpr.is_shared(a)  # this process's memory now: never moved
    assert file.load(_shared._VIEWS) == views_before - 1  # the file's views word was given back
    assert seg.fd < 0 and (np.frombuffer(file, np.float64, T.N) == 2).all()  # its descriptor closed, the file as was
    file.close()
    a[:] = 5  # ordinary memory: written, freed, never pooled
    del a
    again = private(T.N, fill=7.0)
    assert private_segment(again) is not seg and (again == 7).all()
