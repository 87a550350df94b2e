"""Segment recycling: never hand out a segment any process still views; release idle ones."""

import multiprocessing
import os
import time

import _recycle_targets
import mp_reductions as mpr
import numpy as np
import pytest
from mp_reductions import _recycle
from mp_reductions._shared import segment_of


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
    first = segment_of(q.get(timeout=5))[0]
    q.put(a * 2)
    second = q.get(timeout=5)
    assert segment_of(second)[0] is first  # the first array is gone: its segment came round, mapped
    del second
    seen = set()
    for i in range(20):
        q.put(a + i)
        got = q.get(timeout=5)
        assert got[1] == 1 + i
        seen.add(id(segment_of(got)[0]))
        del got
    assert len(seen) <= 2  # the same one or two segments went round


def test_a_held_array_is_never_reused(strategy):
    q = mpr.Queue()
    kept = []
    for i in range(10):
        q.put(np.full(50_000, i, np.float64))
        kept.append(q.get(timeout=5))
    assert [int(k[0]) for k in kept] == list(range(10)) and all((k == i).all() for i, k in enumerate(kept))
    assert len({id(segment_of(k)[0]) for k in kept}) == 10


def test_a_pooled_named_segment_too_small_for_the_message_is_not_used():
    # file_system: the pooled segment is chosen at the message's first copy (its name goes into the
    # pickle), before the message's size is known; a message that outgrows it is pickled again
    mpr.set_sharing_strategy("file_system")
    try:
        q = mpr.Queue()
        q.put(np.zeros(20_000))
        small = segment_of(q.get(timeout=5))[0]
        small_name = small.name
        del small
        assert any(seg.name == small_name for seg, _ in _recycle._state.pool)  # the candidate a first copy takes
        msg = [np.full(20_000, 1.0), np.full(200_000, 2.0)]  # the first fits the pooled segment, not both
        q.put(msg)
        got = q.get(timeout=5)
        assert (got[0] == 1).all() and (got[1] == 2).all()
        assert segment_of(got[0])[0].name != small_name and segment_of(got[0])[0].size >= 8 * 220_000
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
