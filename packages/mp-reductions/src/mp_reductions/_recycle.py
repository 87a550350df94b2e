"""Recycling the segments that carry copies of unshared arrays, and the spills of large pickles and of
protocol-5 buffers (_pickling Note [spills]).

Note [recycling]
~~~~~~~~~~~~~~~~
Invariant: a pooled segment is taken again only when its views word (``REFS``: Note [views word]) reads zero: no
message naming it in flight and no process holding a view of it.

Why recycle: a fresh tmpfs segment costs a page fault per 4 KiB on first touch (copying into one runs at ~0.6 GB/s
here, into a faulted one at ~9 GB/s). So a producer that keeps sending fresh large arrays reuses its message
segments, and receivers keep recently used mappings (of every segment they receive): a recycled segment arrives
already mapped and faulted, and a shared one sent again and again is mapped once::

    producer                                  receiver
    take(n): a pooled segment that is free,   rebuild: view the segment (refs += 1, C),
             else a new one                            then refs -= 1 (the message's)
    refs += 1; send; give back to pool        last view dies: refs -= 1 (C)
                                              mapping kept in `recent` (idle <= 1 s)

How long what is kept stays: Note [idle segments].

Note [views word]
~~~~~~~~~~~~~~~~~
Invariant: a segment's ``views`` header word (``REFS``) is above zero while any process can reach the segment, by a
view or by a message naming it in flight, so one read of it tells whether the segment is free.

How: the C mapping adds one on a process's first buffer export and takes it off on its last, and every message that
names a segment adds one when it is made and its receiver takes one off once it views the segment (on our channels
once per segment per message, elsewhere once per array). Not only the copy's own message counts: a receiver that
sends a view on and drops it at once leaves only that message naming the segment. A receiver views before it gives
the message's count back, a sender counts its message before it drops its view. Two words, read one after the other,
could both read zero while a reference moved from a view to a message and on to another view: a pipeline stage
corrupted arrays that way. A message that is never received, or a holder killed, keeps the word up for good (Note
[idle segments]: how long such a segment stays pooled).

Note [idle segments]
~~~~~~~~~~~~~~~~~~~~
Invariant: a pooled segment leaves the pool once it has been free and untaken for ``IDLE`` seconds, and at most
``(BUSY_IDLES + 1) * IDLE`` seconds after it was sent, busy or not; a kept mapping goes ``IDLE`` seconds after its
last arrival; the pool and the kept mappings each hold at most ``keep_bytes()`` (an eighth of the memory, 2 GiB at
most; the oldest go first), and both go at once when memory runs out, and at exit.

Why: a segment is dropped by the time it has been idle, however long its receivers held it first: a Pool's map sends
all its copies at once and they come back together, a second or more later, and dropping them by the time they were
sent would make the next map fault in fresh ones. A message that is never received, or a holder killed, keeps the
views word up for good: such a segment counts as busy for ``BUSY_IDLES * IDLE`` seconds after it was sent at most
(``copies_lost``: none, where the receiver is known dead). A reaper thread drops them (it looks every ``IDLE / 4``
seconds, 0.25 at most).
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time

import numpy as np
import shm_core
import shm_manager

from . import _attach, _shared, _stats

REFS = shm_core.VIEWS_OFFSET  # messages in flight + processes with views (Note [views word])
IDLE = float(os.environ.get("ARRAYMP_RECYCLE_IDLE", "1.0"))
POOL_MAX = 128  # pooled segments per process (a Pool's whole map in flight: its copies come back together)
KEEP_MAX = 2 << 30  # bytes each of the pool and the kept mappings may hold at most (keep_bytes)
KEEP_SHARE = 8  # ... and at most this fraction of the machine's memory


def keep_bytes() -> int:
    """The bytes each of the pool and the kept mappings may hold: kept segments hold memory (tmpfs pages are
    memory) that no array uses, so a bound in bytes and not only in time (IDLE): KEEP_MAX, or 1/KEEP_SHARE of
    the machine's memory, the smaller. (A full shm dir needs no bound here: a segment that does not fit gives
    the pool back first, new_segment.) Read once."""
    global _keep_bytes
    if _keep_bytes is None:
        try:
            _keep_bytes = min(KEEP_MAX, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // KEEP_SHARE)
        except (OSError, ValueError):
            _keep_bytes = KEEP_MAX
    return _keep_bytes


_keep_bytes: int | None = None
BUSY_IDLES = 5  # IDLE periods a pooled segment may stay busy (Note [idle segments]: a message never received)


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.pool: list[list] = []  # [segment, sent at, last seen busy] (Note [idle segments])
        self.recent: collections.OrderedDict = collections.OrderedDict()  # key -> (segment, last used)
        self.recent_bytes = 0
        self.reaper: threading.Thread | None = None
        # segments of arrays numpy freed, pooled at the next take or reap (_alloc Note [shared allocation])
        self.returned: collections.deque = collections.deque()
        self.lent = 0  # segments lent to numpy arrays (lend) and not yet back in the pool: the reaper runs meanwhile


_state = _State()


def _after_fork_in_child():
    global _state
    _state = _State()  # the parent's pool is not ours to hand out


os.register_at_fork(after_in_child=_after_fork_in_child)


def _free(seg: shm_core.Segment) -> bool:
    return seg.load(REFS) == 0


def _pick(fits) -> shm_core.Segment | None:
    """Take the smallest free pooled segment that ``fits``."""
    st = _state
    with st.lock:
        _pool_returned(st)
        best = None
        for i, (seg, _, _) in enumerate(st.pool):
            if fits(seg) and (best is None or seg.size < st.pool[best][0].size) and _free(seg):
                best = i
        return st.pool.pop(best)[0] if best is not None else None


def take(nbytes: int, named: bool = False, zero: bool = False) -> shm_core.Segment:
    """A free pooled segment (memfd, or ``named``) of at least ``nbytes`` (and not much more), else a new one;
    ``zero``: its first ``nbytes`` read as zeros (a new segment's do already)."""
    seg = _pick(lambda s: bool(s.name) == named and nbytes <= s.size <= 2 * nbytes + (1 << 20))
    if seg is not None:
        try:
            if not named:
                _attach.fd_for_sending(seg)  # its descriptor may have been closed (_shared Note [descriptors])
            if zero:
                np.frombuffer(seg, np.uint8, nbytes).fill(0)
            _stats.counts[_stats.SEGMENTS_REUSED] += 1
            return seg
        except OSError:
            pass
    # a segment that does not fit gives this pool back and is tried again (new_segment)
    return new_segment(nbytes, "file_system" if named else "file_descriptor")


def new_segment(size: int, strategy: str | None = None, name: str | None = None) -> shm_core.Segment:
    """A fresh segment of ``size`` data bytes under the current (or given) strategy (file_system: ``name``,
    from shm_manager.new_name(), or a new one). Where it does not fit, the segments this process keeps for
    reuse are given back and it is tried again: they never make a new array fail. (A named one goes when its
    daemon has taken the last count back: the tries go on for up to a second.)"""
    try:
        return _shared.create_segment(size, strategy, name)
    except shm_core.SharedMemoryFullError as exc:
        if exc.errno == errno.EFBIG or not release_all():  # (the file-size limit: no room to make)
            raise
    shm_manager.flush()
    deadline, delay = time.monotonic() + 1.0, 0.005
    while True:
        try:
            return _shared.create_segment(size, strategy, name)
        except shm_core.SharedMemoryFullError:
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.1)


def take_named(min_bytes: int) -> shm_core.Segment | None:
    """A free pooled named segment of at least ``min_bytes`` (file_system), or None: the caller makes one.

    Only a lower bound is known when the segment's name must go into the pickle (see
    _message.CopyMiss)."""
    return _pick(lambda s: bool(s.name) and s.size >= min_bytes)


def sent(seg: shm_core.Segment) -> None:
    """``seg`` went out in a message: keep it for a later take()."""
    st = _state
    with st.lock:
        _pool_add(st, seg, time.monotonic())
        _ensure_reaper(st)


def _pool_add(st: _State, seg: shm_core.Segment, now: float) -> None:
    st.pool.append([seg, now, now])
    while _over(st.pool):
        _shared.release_fd(st.pool.pop(0)[0])


def lend(nbytes: int, zero: bool) -> shm_core.Segment:
    """A memfd segment for a numpy array's data (the shared handler, _alloc Note [shared allocation]): as
    take(); it comes back through give_back() when numpy frees the data."""
    seg = take(nbytes, zero=zero)
    st = _state
    with st.lock:
        st.lent += 1
        _ensure_reaper(st)
    return seg


def give_back(seg: shm_core.Segment) -> None:
    """numpy freed the array whose data ``seg`` held: pooled at the next take or reap. Called from numpy's
    free, in any thread, maybe inside a garbage collection that runs while this thread holds the lock: so it
    takes none."""
    _state.returned.append(seg)


def _pool_returned(st: _State) -> None:
    """Pool what give_back() returned (lock held): only the segments this process made and lent; a fork
    child's inherited ones go (_alloc Note [shared allocation])."""
    now = time.monotonic()
    while st.returned:
        seg = st.returned.popleft()
        if seg.creator_pid == os.getpid():
            st.lent -= 1
            _pool_add(st, seg, now)


def _over(pool: list) -> bool:
    """More pooled than POOL_MAX segments, keep_bytes() bytes, or memfd segments than a quarter of the
    descriptor budget (each keeps its descriptor: more would push live arrays' out of the LRU, _shared
    Note [descriptors])."""
    memfds = sum(not entry[0].name for entry in pool)
    return (len(pool) > POOL_MAX or memfds > _shared.fd_budget() // 4
            or sum(entry[0].length for entry in pool) > keep_bytes())


def copies_lost(segments) -> None:
    """The message that carried these pooled copies went to a process that died holding them (a Dask worker
    killed mid-task): they leave the pool now instead of counting as busy for ``BUSY_IDLES * IDLE`` seconds (Note
    [idle segments]); each goes when its last view here goes."""
    lost = {id(seg) for seg in segments}
    st = _state
    with st.lock:
        for entry in st.pool:
            if id(entry[0]) in lost:
                _shared.release_fd(entry[0])
        st.pool = [entry for entry in st.pool if id(entry[0]) not in lost]


def received(seg: shm_core.Segment) -> None:
    """A receiver keeps the mapping of a segment for its next arrival (recycled or shared)."""
    st, now = _state, time.monotonic()
    with st.lock:
        recent = st.recent
        known = recent.pop(seg.key, None)
        recent[seg.key] = (seg, now)
        if known is None:
            st.recent_bytes += seg.length
            while st.recent_bytes > keep_bytes() and recent:
                _, (old_seg, _) = recent.popitem(last=False)
                st.recent_bytes -= old_seg.length
        _ensure_reaper(st)


def _ensure_reaper(st: _State) -> None:
    """(Lock held.) The reaper clears ``st.reaper`` as it exits, under the lock: a check of it is enough."""
    if st.reaper is None:
        st.reaper = threading.Thread(target=_reap, args=(st,), name="arraymp-recycler", daemon=True)
        st.reaper.start()


def _reap(st: _State) -> None:
    try:
        while True:
            time.sleep(min(IDLE / 4, 0.25))
            if _drop_idle(st):
                return
    finally:  # (an error: the next arrival starts another)
        with st.lock:
            if st.reaper is threading.current_thread():
                st.reaper = None


def _drop_idle(st: _State) -> bool:
    """Drop what has been idle longer than IDLE (Note [idle segments]); True (and no reaper) once nothing is
    kept or lent. A function of its own: no local of the reaper's loop may keep a dropped segment alive while it
    sleeps."""
    with st.lock:
        _pool_returned(st)
        now = time.monotonic()
        keep = []
        for entry in st.pool:
            seg, sent_at, busy_at = entry
            if not _free(seg) and now - sent_at < BUSY_IDLES * IDLE:
                entry[2] = busy_at = now
            if now - busy_at > IDLE:
                _shared.release_fd(seg)  # the mapping goes with its last array
            else:
                keep.append(entry)
        st.pool = keep
        for key, (seg, t) in list(st.recent.items()):
            if now - t > IDLE:
                del st.recent[key]
                st.recent_bytes -= seg.length
        if not st.pool and not st.recent and not st.lent:
            st.reaper = None
            return True
        return False


def release_all() -> int:
    """Drop every pooled and recently used segment now; how many were kept."""
    st = _state
    with st.lock:
        _pool_returned(st)
        for seg, _, _ in st.pool:
            _shared.release_fd(seg)
        kept = len(st.pool) + len(st.recent)
        st.pool, st.recent, st.recent_bytes = [], collections.OrderedDict(), 0
        return kept
