"""What a message being pickled or unpickled holds besides its bytes: the descriptors and segments it names, the
copies it makes, the in-flight counts it takes or takes over (``Outgoing``, ``Incoming``), and the thread's context
that the reductions (_reductions) find them in; our channels (_pickling, _channel) set it around each message.

Note [kept counts]
~~~~~~~~~~~~~~~~~~
Invariant: a Pool task's message naming a named segment holds one count of its header refcount (_shared Note [named
segments]) while it can still be unpickled (in a socket, moved unchanged to another slot: _pool Note [lost tasks], or
being unpickled), and that count goes back exactly once after, even if its worker is killed before unpickling it.

Why: a receiver takes over the counts of the message it unpickles; one that dies first (a worker killed as it took its
task) never does, and the count stayed up until the group ended.

How: a Pool's tasks are sent *kept* (``Packet.send(kept=True)``): the parent keeps each message's counts
(``Outgoing.held``); its worker, unpickling with ``loads(kept=True)``, takes a count of its own when it first maps the
segment (``attach_named(counted=False)``), held through the daemon as any. The parent gives its counts back
(``Packet.settle``, unlinking at zero) once the message is done with: every result of it read (its worker mapped what it
names before it ran), its loss settled (the worker is dead: it held nothing, or the daemon gave back what it held), or,
at terminate, the workers gone. mp-dask sends its tasks' arguments the same way over Dask's comms (``keep_counts``
around the pickling, ``counts_kept`` around the unpickling, ``give_back_counts`` when the task is done with or lost with
its worker). Results (worker to parent) carry their counts instead (the parent outlives its workers), told to the
daemon: Note [results told].

Note [results told]
~~~~~~~~~~~~~~~~~~~
Invariant: the daemon is told of each in-flight count of a named segment in a Pool worker's result before the result is
sent, so each goes back exactly once: taken over by the reader, or by the daemon once the pool is done with that worker.

Why: a worker killed between a result's count and its send left the count up until the group ended.

How: a worker pickles its results with ``tls.to`` set to the pool's process; ``shm_manager.send_to`` adds each count and
tells the daemon at once (``T``, before the message goes); the handle names the sender,
``("n", name, dir, sender pid)``. The reader takes the count over (``take_from``: ``A``) or, mapping the segment
already, gives it back and says so (``drop_from``); a message not sent gives its counts back through the daemon
(``take_back``). Once the pool has read all a dead worker sent (_pool Note [lost tasks]) it says ``done_with(pid)``, and
the daemon gives back what that worker told and the pool never took (shm_manager Note [Counts sent to a reader]).
mp-dask does the same over Dask's comms (``tell_counts(reader)``; its pools say ``done_with`` for the workers they saw
die). Where no daemon can be told, the count is added as for any message (a copy segment's handle names its sender
before that is known; the reader's take of an untold count is a hold the daemon never gives back twice).

Not covered: a worker killed in the microseconds between adding a count and sending the daemon's frame.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import weakref
from multiprocessing.reduction import ForkingPickler

import numpy as np
import shm_core
import shm_manager

from . import _arrays, _attach, _recycle, _shared, _stats
from ._strategy import get_sharing_strategy

MAX_FDS = 250  # the kernel passes at most 253 descriptors in one message (SCM_MAX_FD)


class Outgoing:
    """What a message being pickled needs besides its bytes: descriptors and copies.

    A message that names no shared memory (most: _channel Note [plain messages]) makes none of the lists
    below: they are made at its first reference (``_start``), until then empty tuples of the class.
    """

    handles = False  # the message names shared memory (the receiver needs an Incoming)
    fds: list[int] = ()  # dups, owned here (Note [descriptors] in _shared): closed once sent
    keep: list = ()  # objects whose descriptors or counts must live until sent
    in_flight: list[shm_core.Segment] = ()  # segments this message counts in flight (_recycle.REFS)
    blocks: list[tuple[shm_core.Segment, int]] = ()  # arena blocks it counts (_shared Note [arenas])
    held: list[shm_core.Segment] = ()  # named segments whose in-flight counts it kept once sent (Note [kept counts])
    told: list[shm_core.Segment] = ()  # named segments whose in-flight counts it told to ``to`` (Note [results told])
    to: int | None = None  # the reader it goes to, when told (tls.to)
    _index: dict[int, int] = None
    _copies: list[tuple[np.ndarray, int, tuple | None]] = ()
    _copy_size = 0
    _copy_ref = None
    recycled: shm_core.Segment | None = None  # the message's copy segment, back to the pool once sent
    spilled: shm_core.Segment | None = None  # its pickle and out-of-band buffers (_pickling Note [spills])
    buffers: list = ()  # the out-of-band buffers (pickle.PickleBuffer) the pickle names, in order
    # what its arrays cost, added to this process's counters once it is sent (_stats Note [stats]): a message
    # pickled again (CopyMiss, shared memory full) is counted once, as sent
    arrays = n_handles = arrays_copied = bytes_copied = arrays_inline = bytes_inline = 0
    fallbacks = fallback_bytes = 0
    buffers_copied = buffer_bytes_copied = 0  # of arrays_copied, those of buffers that are no numpy array's

    def __init__(self, pooled: bool = True, copy_inline: bool = False, moves: frozenset = frozenset(),
                 inputs: dict | None = None):
        self.pooled = pooled  # file_system: the copy may go into a pooled segment chosen at the first copy
        self.copy_inline = copy_inline  # unshared arrays and buffers inline whatever their size: shared memory is full
        self.moves = moves  # ids of born-private arrays it moves as handles (_alloc Note [moving results])
        self.inputs = inputs  # the unshared arrays a Pool call sent (Note [inputs once per call]), or None

    def _start(self) -> None:
        """The message names shared memory: make its lists."""
        if not self.handles:
            self.handles = True
            self.fds, self.keep, self.in_flight, self.blocks, self._copies = [], [], [], [], []
            self._index = {}

    def fd_ref(self, seg: shm_core.Segment) -> tuple:
        self._start()
        i = self._index.get(id(seg))
        if i is None:
            if len(self.fds) >= MAX_FDS:
                raise ValueError(f"one message can carry at most {MAX_FDS} shared-memory segments; pack the "
                                 "arrays with arraymp.share_memory(...) (one segment for all) or send them in "
                                 "several messages")
            i = self._index[id(seg)] = len(self.fds)
            self.fds.append(_attach.fd_for_sending(seg, dup=True))
            self.keep.append(seg)
            self._count_in_flight(seg)
        return ("m", i)

    def block_ref(self, seg: shm_core.Segment, block: int) -> int:
        """Count one array handle naming arena block ``block`` in flight (its receiver gives it back)."""
        self._start()
        seg.fetch_add(shm_core.HEADER_SIZE + block, 1)
        self.blocks.append((seg, block))
        return block

    def _count_in_flight(self, seg: shm_core.Segment) -> None:
        seg.fetch_add(_recycle.REFS, 1)  # see _recycle Note [recycling]: it may be a recycled copy
        self.in_flight.append(seg)

    def named_ref(self, seg: shm_core.Segment) -> tuple:
        self._start()
        if id(seg) not in self._index:
            self._index[id(seg)] = -1
            self._count_named(seg)  # the in-flight count, see _shared Note [named segments]
            self.keep.append(seg)
            self._count_in_flight(seg)
        if any(told is seg for told in self.told):
            return ("n", seg.name, seg.dir, os.getpid())
        return ("n", seg.name, seg.dir)

    def _named_handle(self, name: str, dir: str) -> tuple:
        """A named segment's handle made before its count: naming this process when the message goes to a reader
        the daemon is told of (Note [results told])."""
        return ("n", name, dir) if tls.to is None else ("n", name, dir, os.getpid())

    def _count_named(self, seg: shm_core.Segment) -> None:
        """One in-flight count of ``seg``, told to the daemon as it is added when the message goes to a reader that
        says when it is done with this process (Note [results told])."""
        if tls.to is not None and shm_manager.send_to(tls.to, seg.name, seg.dir, seg.incref):
            if not self.told:
                self.told, self.to = [], tls.to
            self.told.append(seg)
        else:
            seg.incref()

    def copy_ref(self, arr: np.ndarray) -> tuple[tuple, int, tuple | None]:
        """(segment reference, offset, strides: None for C order) of ``arr``'s copy in the message's segment, made
        by ``finish``; in Fortran order where pickle would give it (Note [copies keep their order])."""
        self._start()
        self.arrays += 1
        self.arrays_copied += 1
        self.bytes_copied += arr.nbytes
        offset = self._copy_size
        self._copy_size = _shared.aligned(offset + arr.nbytes)
        strides = _arrays.copy_strides(arr)
        self._copies.append((arr, offset, strides))
        if self._copy_ref is None:
            if get_sharing_strategy() == "file_system":
                # the name goes into the pickle now, the size is known at finish(): a pooled segment
                # at least as large as this first array, else a new one made then (see CopyMiss)
                seg = self.recycled = _recycle.take_named(arr.nbytes) if self.pooled else None
                self._copy_ref = self._named_handle(seg.name, seg.dir) if seg else \
                    self._named_handle(shm_manager.new_name(), shm_core.shm_dir())
            else:
                self._copy_ref = ("c", len(self.fds))
                self.fds.append(-1)  # filled by finish()
        return self._copy_ref, offset, strides

    def input_copy(self, arr: np.ndarray) -> np.ndarray | None:
        """The shared copy of ``arr`` made for this message's call, when the call sent ``arr`` before (made now, at
        its second message); None: copy it into this message (Note [inputs once per call])."""
        if self.inputs is None or self.copy_inline:
            return None
        key = id(arr)
        entry = self.inputs.get(key)
        if entry is None or entry[0]() is not arr:
            # weakly: an imap over a generator must not keep every input alive; the entry goes with the array
            self.inputs[key] = [weakref.ref(arr, lambda _, table=self.inputs, key=key: table.pop(key, None)), None]
            return None
        if entry[1] is None:
            try:
                entry[1] = _arrays.shared_copy(arr)
            except OSError:  # shared memory full: a copy in each message, as before
                return None
            c = _stats.counts  # copied once, here; each message then names it as a handle
            c[_stats.ARRAYS_COPIED] += 1
            c[_stats.BYTES_COPIED] += arr.nbytes
        return entry[1]

    def out_of_band(self, buf, raw: memoryview) -> bool:
        """The pickler's ``buffer_callback`` for ``buf``, contiguous (``raw``: its bytes), of at least the inline
        threshold and of a type that may go out of band (``_pickling._out_of_band`` tests those): False (out of band,
        into the message's spill), or True (in the pickle) where shared memory is full."""
        n = raw.nbytes
        if self.copy_inline:  # meant for shared memory, which is full (_stats Note [sharing stopped])
            self.arrays += 1
            self.fallbacks += 1
            self.fallback_bytes += n
            return True
        self.arrays += 1
        self.arrays_copied += 1
        self.bytes_copied += n
        if not isinstance(raw.obj, np.ndarray):  # (_stats Note [copy hints])
            self.buffers_copied += 1
            self.buffer_bytes_copied += n
        if not self.buffers:
            self.buffers = []
        self.buffers.append(buf)
        return False

    def spill(self, seg: shm_core.Segment) -> int:
        """The message carries ``seg`` (a recycled segment holding its pickle and out-of-band buffers) as its
        last descriptor, counted in flight; it goes back to the pool once sent. Returns its descriptor's index."""
        self._start()
        self.spilled = seg
        self.fds.append(_attach.fd_for_sending(seg, dup=True))
        self.keep.append(seg)
        self._count_in_flight(seg)
        return len(self.fds) - 1

    def finish(self) -> None:
        """Create the message's segment and copy the arrays into it."""
        if not self._copies:
            return
        kind = self._copy_ref[0]
        if kind == "n":
            seg = self.recycled
            if seg is None:
                seg = self.recycled = _recycle.new_segment(self._copy_size, "file_system", name=self._copy_ref[1])
            elif seg.size < self._copy_size:
                raise CopyMiss
            else:
                _stats.counts[_stats.SEGMENTS_REUSED] += 1  # (take_named counts nothing: it may miss)
        else:
            seg = self.recycled = _recycle.take(self._copy_size)
            self.fds[self._copy_ref[1]] = _attach.fd_for_sending(seg, dup=True)
        for arr, offset, strides in self._copies:
            np.copyto(seg.ndarray(arr.shape, arr.dtype, offset, strides), arr, casting="no")
        self._copies.clear()
        if kind == "n":  # counted once made and filled; this process holds it for its pool
            self._count_named(seg)  # in flight, see _shared Note [named segments]
            self.keep.append(seg)
            self._index[id(seg)] = -1  # abort() gives the in-flight count back
        self._count_in_flight(seg)

    def sent(self, kept: bool = False) -> None:
        """The message is in the socket: what it held may go, its copy segment back to the pool. ``kept``: the
        in-flight counts of the named segments it names stay this process's until ``settle`` (Note [kept
        counts]); else its receiver takes them over."""
        if self.arrays:
            _stats.commit(self)
        if not self.handles:
            return
        self._close_fds()
        if kept:
            self.held = self._named_counts()
        self.keep.clear()
        self.in_flight.clear()
        self.blocks.clear()
        self._pool_back()

    def _pool_back(self) -> None:
        for seg in (self.recycled, self.spilled):
            if seg is not None:
                _recycle.sent(seg)
        self.recycled = self.spilled = None

    def abort(self) -> None:
        """The message will not be sent: give back the in-flight counts taken."""
        if not self.handles:
            return
        self._close_fds()
        for seg, block in self.blocks:
            seg.fetch_add(shm_core.HEADER_SIZE + block, -1)
        self.blocks.clear()
        told = {id(seg) for seg in self.told}
        for seg in self._named_counts():
            if id(seg) not in told or not shm_manager.take_back(self.to, seg.name, seg.dir):
                seg.decref()  # (this process holds one more: never the last)
        self.told = []
        self.keep.clear()
        for seg in self.in_flight:
            seg.fetch_add(_recycle.REFS, -1)
        self.in_flight.clear()
        self._pool_back()

    def settle(self) -> None:
        """A message sent ``kept`` is done with: its receiver holds counts of its own, or died, or never took it
        (Note [kept counts]). Give back the in-flight counts it kept (once)."""
        give_back_counts(self.held)

    def _named_counts(self) -> list[shm_core.Segment]:
        """The named segments this message took an in-flight count of (named_ref, a named copy segment)."""
        return [obj for obj in self.keep
                if isinstance(obj, shm_core.Segment) and obj.name and self._index.get(id(obj)) == -1]

    def _close_fds(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds.clear()


class CopyMiss(Exception):
    """The pooled segment chosen at a message's first copy is too small for all its copies: pickle the
    message again with ``Outgoing(pooled=False)`` (a new segment of the exact size)."""


class Incoming:
    """The descriptors that came with a message, resolved to segments on first use."""

    def __init__(self, fds: list[int], kept: bool = False):
        self.fds = fds
        self.kept = kept  # its sender kept the in-flight counts of the named segments (Note [kept counts])
        self.segments: dict = {}
        self.viewed_keys: set = set()

    def segment(self, i: int, size: int) -> shm_core.Segment:
        seg = self.segments.get(i)
        if seg is None:
            if not 0 <= i < len(self.fds) or self.fds[i] < 0:
                raise shm_core.SegmentError(f"handle names descriptor {i} but the message carried {len(self.fds)}")
            fd, self.fds[i] = self.fds[i], -1
            seg = self.segments[i] = _received(_attach.attach_fd(fd, size, owned=True))
        return seg

    def viewed(self, key, seg: shm_core.Segment) -> None:
        """A view of a segment the message names exists: give back its in-flight count (once per message)."""
        if key not in self.viewed_keys:
            self.viewed_keys.add(key)
            seg.fetch_add(_recycle.REFS, -1)

    def named(self, name: str, dir: str, size: int | None, sender: int | None) -> shm_core.Segment:
        # one in-flight count per segment per message (Outgoing.named_ref), taken over unless kept
        seg = self.segments.get(name)
        if seg is None:
            seg = self.segments[name] = _received(_attach.attach_named(name, dir, size, not self.kept, sender))
        return seg

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []


class _TLS(threading.local):
    ctx = None
    held: list | None = None  # keep_counts: the in-flight counts this thread's pickle takes, kept (Note [kept counts])
    kept = False  # counts_kept: the pickle being loaded was made under keep_counts
    borrowed = False  # KeptCounts: the pickle being loaded takes no count: its sender keeps them for our life
    to: int | None = None  # the pid of the reader of the message being pickled, told its counts (Note [results told])


#: this thread's message being pickled (Outgoing) or unpickled (Incoming); set by _channel
tls = _TLS()



def _received(seg: shm_core.Segment) -> shm_core.Segment:
    """Keep the mapping for the segment's next arrival (once per segment per message), see _recycle."""
    _recycle.received(seg)
    return seg


@contextlib.contextmanager
def _set(**values):
    """This thread's ``tls`` attributes set to ``values`` for the block, as they were after."""
    saved = {name: getattr(tls, name) for name in values}
    for name, value in values.items():
        setattr(tls, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(tls, name, value)


@contextlib.contextmanager
def keep_counts(held: list):
    """Pickle (for a transport not ours: Dask's comms) with this process keeping the in-flight counts of the named
    segments the pickle names: appended to ``held``; give them back with ``give_back_counts(held)`` once the
    receiver has unpickled it (under ``counts_kept``) or is gone (Note [kept counts])."""
    with _set(held=held):
        yield


@contextlib.contextmanager
def tell_counts(reader: int):
    """Pickle (for a transport not ours: Dask's comms) a message to the process ``reader`` (a pid of this pid
    namespace) with the in-flight count of each named segment it names told to the daemon as sent to ``reader``:
    once ``reader`` says it is done with this process (``shm_manager.done_with``), the counts it never took go
    back, this process dead or alive (Note [results told])."""
    with _set(to=reader):
        yield


@contextlib.contextmanager
def counts_kept():
    """Unpickle what was pickled under ``keep_counts``: each named segment it names is mapped with a count of this
    process's own (Note [kept counts])."""
    with _set(kept=True):
        yield


class KeptCounts:
    """``obj``, pickled inside whatever pickles this as a pickle of its own made under ``keep_counts(held)``, and
    unpickled taking no count of the named segments it names (only mapped): the caller keeps their counts for the
    receiver's whole life and gives them back once it is gone (a pool worker's launch: _pool.core Note [launch
    counts]), so nothing the receiver does, or fails to do when killed, counts. Its pickle needs
    ``multiprocessing``'s spawning Popen where it names a memfd segment, as any."""

    __slots__ = ("obj", "held")

    def __init__(self, obj, held: list):
        self.obj, self.held = obj, held

    def __reduce__(self):
        with keep_counts(self.held):
            data = bytes(ForkingPickler.dumps(self.obj))
        return _load_kept, (data,)


def _load_kept(data: bytes):
    with _set(borrowed=True):
        return pickle.loads(data)


def give_back_counts(held: list) -> None:
    """Give back the counts ``keep_counts`` kept in ``held`` (emptied: a second call gives back nothing)."""
    while held:
        _shared.give_back_named(held.pop())
