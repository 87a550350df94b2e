"""Note [fork] (issue 20): whatever a fork child does with what it inherited (drop it, collect a garbage cycle
holding it, exit) never changes what its parent sees. Every shared count a fork child inherits (a segment's views
word, an arena block's count, a named segment's refcount) is taken for it before the fork and given back by it."""

import gc
import multiprocessing
import threading
import time

import mp_reductions as mpr
import numpy as np
import shm_core
from _views import via_shared_memory
from mp_reductions import _recycle, _shared

fork = multiprocessing.get_context("fork")
HELD = []


def _producer(cmd, q):
    mpr.init_reductions()
    while (k := cmd.get(timeout=60)) is not None:
        q.put(np.full(1 << 17, float(k)))  # 1 MiB: a copy into this producer's recycled segment


class Cycle:
    pass


def _drop_held():
    HELD.clear()
    gc.collect()


def _collect():
    gc.collect()


def _raise():
    raise RuntimeError("the child fails (its traceback on stderr is expected)")


def test_a_fork_child_dropping_an_inherited_array_keeps_the_parents_data(strategy):
    # the repro: the parent holds array 1 of a producer's recycled segment; a fork child drops it and
    # collects the parent's garbage cycle that holds a view of it; the producer must not reuse that segment
    cmd, q = fork.Queue(), mpr.Queue()
    producer = fork.Process(target=_producer, args=(cmd, q))
    producer.start()
    try:
        cmd.put(1)
        HELD.append(q.get(timeout=60))
        assert via_shared_memory(HELD[0])  # a copy in the producer's recycled segment, the parent's own
        cycle = Cycle()
        cycle.self, cycle.view = cycle, HELD[0][10:20]
        del cycle  # garbage: collected in the child, then in the parent
        c = fork.Process(target=_drop_held)
        c.start()
        c.join(60)
        gc.collect()
        for k in range(2, 6):
            cmd.put(k)
            assert q.get(timeout=60)[0] == k
            assert HELD[0].min() == HELD[0].max() == 1.0, "the producer reused the parent's segment"
    finally:
        HELD.clear()
        cmd.put(None)
        producer.join(60)
        q.close()
        cmd.close()


def test_a_segment_privatized_at_a_fork_is_never_viewed_for_a_new_message(strategy, monkeypatch):
    # Note [privatized segments]: the parent's own array (a producer's copy) goes private at a fork, which gives the
    # producer's segment back, and the producer puts its next array into it at once. A thread that receives that
    # array while the fork's hook is still at work must map the segment again, never view the private copy (the old
    # values: the soak's wrong Pool results). The hook is held open here until that thread is done, or for 2 s
    cmd, q = fork.Queue(), mpr.Queue()
    producer = fork.Process(target=_producer, args=(cmd, q))
    producer.start()
    privatize, received, threads = shm_core.Segment.privatize, [], []

    def privatize_then_receive(seg):
        privatize(seg)
        if not threads:
            cmd.put(2)
            threads.append(threading.Thread(target=lambda: received.append(q.get(timeout=60))))
            threads[0].start()
            threads[0].join(2)

    try:
        cmd.put(1)
        held = q.get(timeout=60)
        assert via_shared_memory(held)
        monkeypatch.setattr(shm_core.Segment, "privatize", privatize_then_receive)
        c = fork.Process(target=_collect)
        c.start()
        monkeypatch.undo()
        c.join(60)
        assert threads, "the fork privatized nothing"
        threads[0].join(60)
        assert received[0].min() == received[0].max() == 2.0, "a new message viewed the privatized copy"
        assert held.min() == held.max() == 1.0
    finally:
        cmd.put(None)
        producer.join(60)
        q.close()
        cmd.close()


def _words(seg, block, named, expected=None):
    """The views word, the block's count and (file_system) the refcount; with ``expected``, once they read so (a
    named count comes back through shm-manager's daemon) or 10 s have passed."""
    deadline = time.monotonic() + 10
    while True:
        words = [seg.load(_recycle.REFS), block[0].load(shm_core.HEADER_SIZE + block[1])]
        if named is not None:
            words.append(named.refcount)
        if expected is None or words == expected or time.monotonic() > deadline:
            return words
        time.sleep(0.01)


def _hold_until(ready, go, arrays):
    ready.set()
    go.wait(60)
    assert all((a == 7).all() for a in arrays)  # the parent dropped its views: the memory is still ours


def test_every_count_a_fork_child_inherits_is_its_own(strategy):
    big = mpr.empty_shared(1 << 17)  # a segment of its own
    small = mpr.empty_shared(16)  # an arena block
    big[:] = small[:] = 7
    seg = _shared.segment_of(big)[0]
    aseg = _shared.segment_of(small)[0]
    block = (aseg, _shared.block_of(small, aseg))
    named = seg if strategy == "file_system" else None
    before = _words(seg, block, named)
    assert before[:2] == [1, 1]
    for target in (_drop_held, _collect, _raise, lambda: None):
        HELD[:] = [big, small]
        c = fork.Process(target=target)
        c.start()
        c.join(60)
        HELD.clear()
        assert _words(seg, block, named, before) == before, target
    # a child keeps what it inherited after the parent let go: the counts say it still holds them
    ready, go = fork.Event(), fork.Event()
    c = fork.Process(target=_hold_until, args=(ready, go, [big, small]))
    c.start()
    assert ready.wait(60)
    assert _words(seg, block, named) == [n + 1 for n in before]
    go.set()
    c.join(60)
    assert c.exitcode == 0
    assert _words(seg, block, named, before) == before


def test_forks_while_another_thread_makes_and_drops_views(strategy):
    # the counts are taken before the fork and reconciled in the child with what it holds after it: another thread
    # running in between (the interpreter may switch threads inside os.fork's hooks) must not skew them
    big = mpr.empty_shared(1 << 17)
    seg = _shared.segment_of(big)[0]
    del big  # only the thread's views remain, coming and going
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            view = seg.ndarray((16,), np.float64)
            view[0] = 1
            del view

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(30):
            c = fork.Process(target=_collect)
            c.start()
            c.join(60)
            assert c.exitcode == 0
    finally:
        stop.set()
        t.join(60)
    assert seg.load(_recycle.REFS) == 0  # no view left here, none counted for a child that is gone


EARLY_DEATH = """
import os, sys, time
os.register_at_fork(after_in_child=lambda: os._exit(0))  # before arraymp's hooks: the child dies before it claims
import mp_reductions as mpr, numpy as np, shm_core
mpr.init_reductions()
mpr.set_sharing_strategy("file_system")
arrays = [mpr.empty_shared(1 << 17) for _ in range(3)]
names = sorted(n for n in os.listdir(shm_core.shm_dir()) if n.startswith("arraymp_") and f"_{os.getpid()}_" in n)
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
del arrays
deadline = time.monotonic() + 10
while time.monotonic() < deadline and any(os.path.exists(os.path.join(shm_core.shm_dir(), n)) for n in names):
    time.sleep(0.05)
print(len(names), sum(os.path.exists(os.path.join(shm_core.shm_dir(), n)) for n in names))
"""


def test_named_counts_of_a_fork_child_killed_before_it_ran_go_back():
    # shm_manager Note [Counts given at fork]: the parent gives the child's counts to the daemon by pid, so a child
    # that dies before any hook of ours ran (a Pool worker killed at once) leaves nothing for its group's end
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", EARLY_DEATH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    made, left = map(int, r.stdout.split())
    assert made == 3 and left == 0, f"{left} of {made} named segments outlived their last holder"
