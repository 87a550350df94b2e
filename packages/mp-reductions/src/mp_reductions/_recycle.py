"""Recycling the segments that carry copies of unshared arrays.

Note [recycling]: a fresh tmpfs segment costs a page fault per 4 KiB on first
touch (copying into one runs at ~0.6 GB/s here, into a faulted one at ~9 GB/s),
so a producer that keeps sending fresh large arrays reuses its message
segments, and receivers keep recently used mappings (of every segment they
receive), so a recycled segment arrives already mapped and faulted, and a
shared one sent again and again is mapped once::

    producer                                  receiver
    take(n): a pooled segment that is free,   rebuild: view the segment, then
             else a new one                            pending -= 1
    pending += 1; send; give back to pool     last view dies: views -= 1 (C)
                                              mapping kept in `recent` (idle <= 1 s)

A segment is free when no message naming it is in flight (``pending``, the
header's user word) and no process holds a view of it (``views``, counted by
the C mapping on a process's first and last buffer export). Every message that
names a segment counts in ``pending``, not only the copy's own: a receiver
that sends a view on and drops it at once leaves only that message naming the
segment (on our channels once per segment per message, elsewhere once per
array). The receiver counts its view before it gives back ``pending``, and the
producer reads ``pending`` before ``views``, so a segment is never handed out
while anyone can still see it. A message that is never received keeps
``pending`` up: that segment simply leaves the pool when idle.

Pooled and recent segments are dropped after ``IDLE`` seconds unused (a reaper
thread), at once when memory runs out, and at exit.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import shm_core

from . import _shared

PENDING = shm_core.USER_OFFSET
IDLE = float(os.environ.get("ARRAYMP_RECYCLE_IDLE", "1.0"))
POOL_MAX = 8  # pooled segments per process
RECENT_BYTES = 2 << 30  # mappings a receiver keeps for recycled segments


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.pool: list[tuple[shm_core.Segment, float]] = []  # (segment, last used)
        self.recent: collections.OrderedDict = collections.OrderedDict()  # key -> (segment, last used)
        self.recent_bytes = 0
        self.reaper: threading.Thread | None = None


_state = _State()


def _after_fork_in_child():
    global _state
    _state = _State()  # the parent's pool is not ours to hand out


os.register_at_fork(after_in_child=_after_fork_in_child)


def _free(seg: shm_core.Segment) -> bool:
    return seg.load(PENDING) == 0 and seg.views == 0


def take(nbytes: int) -> shm_core.Segment:
    """A free pooled segment of at least ``nbytes`` (and not much more), else a new one."""
    st = _state
    with st.lock:
        best = None
        for i, (seg, _) in enumerate(st.pool):
            if nbytes <= seg.size <= 2 * nbytes + (1 << 20) and (best is None or seg.size < st.pool[best][0].size) \
                    and _free(seg):
                best = i
        if best is not None:
            return st.pool.pop(best)[0]
    try:
        return _shared.new_segment(nbytes, "file_descriptor")
    except shm_core.SharedMemoryFullError:
        release_all()  # memory pressure: give back what we keep, then try once more
        return _shared.new_segment(nbytes, "file_descriptor")


def sent(seg: shm_core.Segment) -> None:
    """``seg`` went out in a message: keep it for a later take()."""
    st = _state
    with st.lock:
        st.pool.append((seg, time.monotonic()))
        if len(st.pool) > POOL_MAX:
            st.pool.pop(0)[0].close_fd()
        _ensure_reaper(st)


def received(seg: shm_core.Segment) -> None:
    """A receiver keeps the mapping of a segment for its next arrival (recycled or shared)."""
    st = _state
    with st.lock:
        old = st.recent.pop(seg.key, None)
        if old is None:
            st.recent_bytes += seg.length
        st.recent[seg.key] = (seg, time.monotonic())
        while st.recent_bytes > RECENT_BYTES and st.recent:
            _, (old_seg, _) = st.recent.popitem(last=False)
            st.recent_bytes -= old_seg.length
        _ensure_reaper(st)


def _ensure_reaper(st: _State) -> None:
    if st.reaper is None or not st.reaper.is_alive():
        st.reaper = threading.Thread(target=_reap, args=(st,), name="arraymp-recycler", daemon=True)
        st.reaper.start()


def _reap(st: _State) -> None:
    while True:
        time.sleep(min(IDLE / 4, 0.25))
        with st.lock:
            now = time.monotonic()
            keep = []
            for seg, t in st.pool:
                if now - t > IDLE:
                    seg.close_fd()  # the mapping goes with its last array
                else:
                    keep.append((seg, t))
            st.pool = keep
            for key, (seg, t) in list(st.recent.items()):
                if now - t > IDLE:
                    del st.recent[key]
                    st.recent_bytes -= seg.length
            if not st.pool and not st.recent:
                st.reaper = None
                return


def release_all() -> None:
    """Drop every pooled and recently used segment now."""
    st = _state
    with st.lock:
        for seg, _ in st.pool:
            seg.close_fd()
        st.pool, st.recent, st.recent_bytes = [], collections.OrderedDict(), 0
