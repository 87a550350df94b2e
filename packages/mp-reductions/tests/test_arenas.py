"""Arenas and descriptors (issue 12, defects 1, 2, 3 and the arena fallback): what ``_shared`` Notes
[arenas] and [descriptors] promise, tried across processes."""

import gc
import multiprocessing
import os
import resource
import subprocess
import sys
import time
import weakref

import _arena_targets
import _budget_targets
import _targets
import mp_reductions as mpr
import numpy as np
import pytest
import shm_core
from mp_reductions import _arrays, _shared


def _segments(arrays) -> set:
    return {id(_shared.segment_of(a)[0]) for a in arrays}


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_small_arrays_sent_one_by_one_share_one_arena(strategy, method):
    # defect 1: every put-and-drop abandoned the arena, so the keeper mapped 4 MiB per 128-byte array
    ctx = multiprocessing.get_context(method)
    q = mpr.Queue()
    p = ctx.Process(target=_arena_targets.produce_small, args=(q, 500, strategy))
    p.start()
    kept = []
    while (a := q.get(timeout=60)) is not None:
        kept.append(a)
    p.join(30)
    assert p.exitcode == 0
    assert [int(a[0]) for a in kept] == list(range(500)) and all(int(a[-1]) == i for i, a in enumerate(kept))
    assert len(_segments(kept)) == 1
    kept[7][:] = -1
    assert int(kept[7].sum()) == -16 and int(kept[8][0]) == 8  # blocks do not overlap


def _block(arr) -> tuple:
    """Which block of which arena ``arr`` lies in (addresses alone could repeat once an arena is unmapped)."""
    seg = _shared.segment_of(arr)[0]
    return seg.id, _shared.block_of(arr, seg)


def test_a_freed_block_is_reused_only_once_nobody_holds_it(strategy):
    a = mpr.zeros_shared((16,), np.int64)
    arena_alive = mpr.zeros_shared((16,), np.int64)  # keeps the arena mapped here while the child works
    where = _block(a)
    a[:] = 1
    ctx = multiprocessing.get_context("spawn")
    # a SimpleQueue pickles in put(): no feeder thread keeps a reference to the array after it is sent
    q, ready, release = mpr.SimpleQueue(), mpr.Queue(), mpr.Queue()
    p = ctx.Process(target=_arena_targets.hold_until_told, args=(q, ready, release))
    p.start()
    q.put(a)
    assert ready.get(timeout=60) == 16
    del a
    others = [mpr.zeros_shared((16,), np.int64) for _ in range(50)]  # the child's block must not be among them
    assert where not in {_block(o) for o in others}
    for o in others:
        o[:] = 7
    release.put("go")
    assert ready.get(timeout=60) == 16  # the child's array kept its contents
    assert ready.get(timeout=60) == "dropped"
    p.join(30)
    del others
    # now nobody views the block: the allocator hands it out again
    again = [mpr.empty_shared((16,), np.int64) for _ in range(60)]
    assert where in {_block(x) for x in again}
    del arena_alive


def test_freed_blocks_keep_memory_flat(strategy):
    held = mpr.empty_shared(100)  # keeps its arena alive throughout
    arenas = {_shared.segment_of(held)[0].id}
    for _ in range(20_000):  # 17 MiB of 800-byte blocks if none came back
        arenas.add(_shared.segment_of(mpr.empty_shared(100))[0].id)
    assert len(arenas) == 1


def test_fork_child_counts_the_blocks_it_inherits(strategy):
    ctx = multiprocessing.get_context("fork")
    a = mpr.zeros_shared((16,), np.int64)
    a[:] = 3
    addr = shm_core.address(a)
    ready, release = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_hold_inherited, args=(a, ready, release))
    p.start()
    assert ready.get() == "holding"
    del a
    others = [mpr.zeros_shared((16,), np.int64) for _ in range(50)]
    assert addr not in {shm_core.address(o) for o in others}
    release.put("go")
    assert ready.get() == 48
    p.join(30)
    assert p.exitcode == 0


def _hold_inherited(a, ready, release):
    ready.put("holding")
    release.get()
    ready.put(int(a.sum()))


@pytest.fixture
def small_budget():
    """A soft RLIMIT_NOFILE of 512 for the test (a budget of 128 descriptors): past the budget in few arrays, where
    a segment is sent again only if /proc/self/map_files re-opens it (a normal user gets the error instead:
    test_unprivileged_resend_past_the_budget_raises_never_copies)."""
    if not _budget_targets.can_reopen_mappings():
        pytest.skip("this process may not re-open mappings from /proc/self/map_files (CAP_CHECKPOINT_RESTORE)")
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_old_received_array_is_sent_again_shared(strategy, small_budget):
    # defect 2: past the descriptor LRU, a re-sent received array went as a silent copy
    q = mpr.SimpleQueue()
    n = _shared.fd_budget() + 30
    got = []
    for i in range(n):
        x = mpr.zeros_shared(1 << 15)  # 256 KiB: a segment each
        x[0] = i
        q.put(x)
        got.append(q.get())
        del x
    for old in (got[5], got[-1]):
        q2 = mpr.SimpleQueue()
        q2.put(old)
        back = q2.get()
        assert np.shares_memory(back, old)
        back[1] = 42
        assert old[1] == 42
        q2.close()
    q.close()


def test_an_old_array_past_the_budget_goes_shared_as_a_spawn_argument(strategy, small_budget):
    # its descriptor was closed by the LRU: the launcher gets it re-opened (Note [channels we do not own])
    q = mpr.SimpleQueue()
    got = []
    for _ in range(_shared.fd_budget() + 5):
        q.put(mpr.zeros_shared(1 << 15))
        got.append(q.get())
    p = multiprocessing.get_context("spawn").Process(target=_targets.write_inherited, args=(got[0],))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert (got[0] == 42).all()
    q.close()


@pytest.mark.parametrize("size", [1 << 15, 1 << 17])
def test_creator_keeps_hundreds_of_segments_under_ulimit_64(strategy, size):
    if strategy == "file_descriptor" and size > _arrays.ARENA_ITEM_MAX and not _budget_targets.can_reopen_mappings():
        pytest.skip("300 segments of their own under ulimit -n 64: sending the oldest re-opens it from "
                    "/proc/self/map_files, which this process may not (CAP_CHECKPOINT_RESTORE)")
    # defect 3: one descriptor per live segment; stopped at 59 arrays under ulimit -n 64
    ctx = multiprocessing.get_context("spawn")
    out = mpr.Queue()
    p = ctx.Process(target=_arena_targets.create_under_limit, args=(strategy, 64, 300, size, out))
    p.start()
    assert out.get(timeout=120) == (300, True, 200)
    p.join(30)
    assert p.exitcode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as an unprivileged user")
def test_unprivileged_resend_past_the_budget_raises_never_copies(tmp_path):
    # /proc/self/map_files needs CAP_CHECKPOINT_RESTORE: an ordinary user past the descriptor budget gets an
    # error that says what to do, never a silent copy
    code = (
        "import resource, mp_reductions as m, numpy as np\n"
        "m.init_reductions()\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "live = [m.zeros_shared(1 << 15) for _ in range(40)]\n"
        "q = m.SimpleQueue()\n"
        "q.put(live[-1]); assert np.shares_memory(q.get(), live[-1])\n"
        "try:\n"
        "    q.put(live[0])\n"
        "except OSError as e:\n"
        "    assert 'ulimit -n' in str(e) and 'file_system' in str(e), e\n"
        "    print('raised')\n"
        "else:\n"
        "    print('sent', np.shares_memory(q.get(), live[0]))\n"
    )
    env = {**os.environ, "ARRAYMP_SHM_DIR": "/dev/shm", "HOME": str(tmp_path)}
    os.chmod(tmp_path, 0o777)
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
                        "--bounding-set=-all", sys.executable, "-c", code], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "raised"


def test_small_array_on_a_tiny_tmpfs_falls_back_to_its_own_segment(mount_tmpfs):
    d = str(mount_tmpfs("1m"))
    code = (
        "import mp_reductions as m, numpy as np\n"
        "m.init_reductions(); m.set_sharing_strategy('file_system')\n"
        "a = m.zeros_shared(1000, np.uint8); a[:] = 5; assert a.sum() == 5000\n"
        "try:\n"
        "    m.empty_shared(2 << 20, np.uint8)\n"
        "except OSError as e:\n"
        "    assert '2,097,152' in str(e) and '4,194,304' not in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error for 2 MiB on a 1 MiB tmpfs')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "ARRAYMP_SHM_DIR": d}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_forged_block_handles_raise(strategy):
    q = mpr.SimpleQueue()
    q.put((mpr.zeros_shared((16,), np.int64), mpr.zeros_shared(1 << 17, np.uint8)))
    small, big = q.get()
    seg = _shared.segment_of(small)[0]
    block = _shared.block_of(small, seg)
    for bad in (block + 8, -64, seg.size + 64, "0", None):
        with pytest.raises(shm_core.SegmentError):
            _shared.block_view(seg, bad)
    with pytest.raises(shm_core.SegmentError, match="not an arena"):
        _shared.block_view(_shared.segment_of(big)[0], 0)
    q.close()


def test_share_memory_frees_its_segment_without_a_collection(strategy):
    # its recursive helpers were closures: a reference cycle that kept the copies until the next collection
    gc.disable()
    try:
        d = mpr.share_memory({"a": np.ones(100_000), "b": [np.zeros(5_000)]})
        ref = weakref.ref(_shared.segment_of(d["a"])[0])
        del d
        assert ref() is None
    finally:
        gc.enable()


def _double(x):
    return x * 2


def test_pool_gives_back_its_cached_segments_when_joined(monkeypatch):
    # issue 12: one arraymp_* segment (the recycling cache) stayed in /dev/shm until the program exited
    from mp_reductions import _recycle

    monkeypatch.setattr(_recycle, "IDLE", 600.0)  # nothing goes by idling here: only join() gives it back
    mpr.set_sharing_strategy("file_system")
    try:
        with mpr.Pool(2, context=multiprocessing.get_context("fork")) as pool:
            results = pool.map(_double, [np.ones(100_000) for _ in range(8)])
        pool.join()
        assert all(float(r[0]) == 2.0 for r in results)
        del results
        deadline = time.monotonic() + 3  # the group's daemon unlinks what was given back to it
        while (mine := [n for n in os.listdir("/dev/shm") if f"_{os.getpid()}_" in n]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mine == []
    finally:
        mpr.set_sharing_strategy("file_descriptor")
