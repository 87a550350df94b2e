"""Segment recycling: never hand out a segment any process still views; release idle ones."""

import multiprocessing
import os
import subprocess
import sys
import time

import _recycle_targets
import mp_reductions as mpr
import numpy as np
import pytest
from _views import segment_under
from mp_reductions import _recycle, _shared


def memfd_mappings():
    with open("/proc/self/maps") as f:
        return sum("/memfd:arraymp" in line for line in f)


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_recycling_never_overwrites_a_viewed_segment(method, strategy):
    ctx = multiprocessing.get_context(method)
    q, out = mpr.Queue(maxsize=4), mpr.Queue()
    consumers = [ctx.Process(target=_recycle_targets.hold_and_check, args=(q, out, seed)) for seed in (1, 2)]
    for p in consumers:
        p.start()
    n = 600
    for i in range(n):
        q.put(np.full(20_000 + (i % 3) * 1000, i, np.int64))  # 160-184 KB: by shared memory, recycled
    for _ in consumers:
        q.put(None)
    results = [out.get(timeout=120) for _ in consumers]
    for p in consumers:
        p.join(30)
    assert sum(c for c, _ in results) == n
    assert [bad for _, bad in results] == [0, 0]


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_forwarded_copy_is_never_overwritten(method, strategy):
    # producer -> relay -> slow sink: the relay drops each array as soon as it has sent it on,
    # so only the message in flight names the producer's copy segment then
    ctx = multiprocessing.get_context(method)
    q1, q2, out = mpr.Queue(maxsize=4), mpr.Queue(maxsize=32), mpr.Queue()
    procs = [ctx.Process(target=_recycle_targets.relay, args=(q1, q2)),
             ctx.Process(target=_recycle_targets.check_sequence, args=(q2, out))]
    for p in procs:
        p.start()
    n = 1000
    for i in range(n):
        q1.put(np.full(30_000, i, np.int64))  # 240 KB: a recycled copy
    q1.put(None)
    assert out.get(timeout=120) == (n, 0)
    for p in procs:
        p.join(30)


def test_recycled_segment_is_reused_and_arrives_mapped(strategy):
    q = mpr.Queue()
    a = np.arange(100_000.0)
    q.put(a)
    first = segment_under(q.get(timeout=5))
    q.put(a * 2)
    second = q.get(timeout=5)
    assert segment_under(second) is first  # the first array is gone: its segment came round, mapped
    del second
    seen = set()
    for i in range(20):
        q.put(a + i)
        got = q.get(timeout=5)
        assert got[1] == 1 + i
        seen.add(id(segment_under(got)))
        del got
    assert len(seen) <= 2  # the same one or two segments went round


def test_a_held_array_is_never_reused(strategy):
    q = mpr.Queue()
    kept = []
    for i in range(10):
        q.put(np.full(50_000, i, np.float64))
        kept.append(q.get(timeout=5))
    assert [int(k[0]) for k in kept] == list(range(10)) and all((k == i).all() for i, k in enumerate(kept))
    assert len({id(segment_under(k)) for k in kept}) == 10


def test_a_pooled_named_segment_too_small_for_the_message_is_not_used():
    # file_system: the pooled segment is chosen at the message's first copy (its name goes into the
    # pickle), before the message's size is known; a message that outgrows it is pickled again
    mpr.set_sharing_strategy("file_system")
    try:
        q = mpr.Queue()
        q.put(np.zeros(20_000))
        small = segment_under(q.get(timeout=5))
        small_name = small.name
        del small
        assert any(seg.name == small_name for seg, _, _ in _recycle._state.pool)  # the candidate a first copy takes
        msg = [np.full(20_000, 1.0), np.full(200_000, 2.0)]  # the first fits the pooled segment, not both
        q.put(msg)
        got = q.get(timeout=5)
        assert (got[0] == 1).all() and (got[1] == 2).all()
        assert segment_under(got[0]).name != small_name and segment_under(got[0]).size >= 8 * 220_000
    finally:
        mpr.set_sharing_strategy("file_descriptor")


def test_idle_recycled_segments_are_released():
    q = mpr.Queue()
    base = memfd_mappings()  # the queue's own counters are one
    for i in range(5):
        q.put(np.full(100_000, i, np.float64))
        assert q.get(timeout=5)[0] == i
    assert _recycle._state.pool or _recycle._state.recent
    deadline = time.monotonic() + _recycle.IDLE + 1.5
    while (_recycle._state.pool or _recycle._state.recent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _recycle._state.pool and not _recycle._state.recent
    import gc

    gc.collect()
    assert memfd_mappings() <= base


def test_a_reaper_that_failed_is_replaced_at_the_next_arrival(monkeypatch):
    """The reaper clears ``st.reaper`` however it exits (an arrival checks that alone, not is_alive()): one
    that raised is started again by the next arrival, and what was kept is still released."""
    failed = []

    def fail_once(st):
        monkeypatch.setattr(_recycle, "_drop_idle", real)
        failed.append(True)
        raise RuntimeError("reaper failed")

    real = _recycle._drop_idle
    monkeypatch.setattr(_recycle, "_drop_idle", fail_once)
    monkeypatch.setattr("threading.excepthook", lambda args: None)
    q = mpr.Queue()
    q.put(np.full(100_000, 1.0))
    assert q.get(timeout=5)[0] == 1.0
    st = _recycle._state
    deadline = time.monotonic() + 10
    while st.reaper is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert failed and st.reaper is None and (st.pool or st.recent)
    q.put(np.full(100_000, 2.0))
    assert q.get(timeout=5)[0] == 2.0
    assert st.reaper is not None and st.reaper.is_alive()
    deadline = time.monotonic() + _recycle.IDLE + 5
    while (st.pool or st.recent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not st.pool and not st.recent


def test_a_segment_held_longer_than_idle_comes_round_again():
    # idle means free and untaken: a receiver holding the copy for seconds does not get it dropped from the
    # pool (a Pool's map sends all its copies at once and they come back a while later), one whose message is
    # never received leaves BUSY_IDLES * IDLE seconds after it was sent
    q = mpr.Queue()
    q.put(np.arange(100_000.0))
    held = q.get(timeout=5)
    first = segment_under(held)
    time.sleep(_recycle.IDLE + 0.6)
    assert any(seg is first for seg, _, _ in _recycle._state.pool)
    del held
    q.put(np.arange(100_000.0) * 2)
    again = q.get(timeout=5)
    assert segment_under(again) is first and again[1] == 2
    time.sleep(_recycle.BUSY_IDLES * _recycle.IDLE + 0.6)  # ``again`` is held all along
    assert not any(seg is first for seg, _, _ in _recycle._state.pool)
    assert again[1] == 2 and (again == np.arange(100_000.0) * 2).all()


def test_the_pool_keeps_few_descriptors_of_its_own():
    # each pooled memfd segment keeps its descriptor: the pool holds at most a quarter of the descriptor budget,
    # so it never pushes the descriptors of the arrays a program holds out of the LRU (_shared Note [descriptors])
    import resource

    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, old[1]))  # a budget of 32 descriptors
    try:
        q = mpr.Queue()
        kept = []
        for i in range(20):
            q.put(np.full(20_000, i, np.float64))
            kept.append(q.get(timeout=5))
            assert sum(not seg.name for seg, _, _ in _recycle._state.pool) <= _shared.fd_budget() // 4 == 8
        assert [int(k[0]) for k in kept] == list(range(20))
        del kept
        q.close()
        q.join_thread()
    finally:
        _recycle.release_all()
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_memory_pressure_releases_the_pool():
    q = mpr.Queue()
    q.put(np.ones(100_000))
    q.get(timeout=5)
    assert _recycle._state.pool
    _recycle.release_all()
    assert not _recycle._state.pool and not _recycle._state.recent


def test_fork_child_does_not_inherit_the_pool():
    q = mpr.Queue()
    q.put(np.ones(100_000))
    q.get(timeout=5)
    assert _recycle._state.pool
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if not _recycle._state.pool else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.close(w)


def test_message_copies_are_recycled_only_once_received_and_dropped():
    """``message_copies`` (the Dask transport's copies, Note [recycling]): a copy's segment comes round again
    only when its message was received and the receiver dropped the array; never while a message naming it
    is unread or a process views it."""
    from multiprocessing.reduction import ForkingPickler

    mpr.init_reductions()
    with pytest.raises(RuntimeError, match="file_system"), mpr.message_copies():
        pass  # a memfd copy could not cross the transport such messages take
    mpr.set_sharing_strategy("file_system")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_recycle_targets.hold_messages, args=(child,))
    p.start()
    try:

        def message(value, order="C"):
            with mpr.message_copies() as copy:
                c = copy(np.full((256, 512), value, np.float64, order=order))  # 1 MiB: a recycled segment
                name = segment_under(c).name
                assert c.flags.f_contiguous == (order == "F") and c.flags.writeable
                return name, bytes(ForkingPickler.dumps(c))

        n1, m1 = message(1.0)
        parent.send(("load", 1, m1))
        assert parent.recv() == 256 * 512
        n2, m2 = message(2.0, "F")  # the child views n1: another segment
        assert n2 != n1
        parent.send(("drop", 1, None))
        parent.recv()
        n3, m3 = message(3.0)  # n1 is free again; n2's message is unread, so n2 is not
        assert n3 == n1
        n4, m4 = message(4.0)
        assert n4 not in (n1, n2)
        for key, m in ((2, m2), (3, m3), (4, m4)):
            parent.send(("load", key, m))
            parent.recv()
        parent.send(("sums", None, None))
        assert parent.recv() == {2: 2.0 * 256 * 512, 3: 3.0 * 256 * 512, 4: 4.0 * 256 * 512}
        with mpr.message_copies() as copy:  # small arrays go into an arena block, not a segment of their own
            assert segment_under(copy(np.ones(100))).size >= 1 << 20
        parent.send(None)
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        mpr.set_sharing_strategy("file_descriptor")
        _recycle.release_all()


def test_a_full_tmpfs_gives_back_the_pool_before_failing(mount_tmpfs):
    # the pool keeps free copy segments for reuse (Note [recycling]); on a small /dev/shm (a container's 64 MiB)
    # they must never be what makes a new array fail: any new segment that does not fit gives them back first
    d = str(mount_tmpfs("8m"))
    code = (
        "import mp_reductions as m, numpy as np\n"
        "from mp_reductions import _recycle\n"
        "_recycle.IDLE = 60.0  # the reaper does not give them back meanwhile\n"
        "m.init_reductions(); m.set_sharing_strategy('file_system')\n"
        "q = m.SimpleQueue()\n"
        "for i in range(2):\n"
        "    q.put(np.full(3 << 18, i, np.float32)); assert q.get()[0] == i  # a 3 MiB copy, pooled once free\n"
        "assert _recycle._state.pool\n"
        "a = m.empty_shared(6 << 20, np.uint8); a[:] = 1\n"
        "print('ok', len(_recycle._state.pool))\n"
    )
    # (named segments: memfd ones live on the kernel's own tmpfs, which a test cannot make small)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ARRAYMP_SHM_DIR": d}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "0"], r.stderr
