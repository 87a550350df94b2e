"""Pickler reductions for numpy arrays (adapts torch/multiprocessing/reductions.py).

``reduce_ndarray`` decides how an array travels:

- already in shared memory: as a handle (segment reference, offset, shape,
  strides, dtype); no copy, a cost independent of its size;
- smaller than the inline threshold, object dtype, or empty: inside the
  pickle, exactly as the stdlib sends it;
- otherwise: copied once into shared memory. On our channels every such array
  of one message goes into one segment; elsewhere each gets its own.

A segment reference is one of:

    ("m", i)         the i-th descriptor of the message (our channels)
    ("c", i)         the same, for the message's copy segment (recycled, see _recycle)
    ("d", DupFd)     a descriptor passed by multiprocessing.reduction.DupFd
                     (stdlib queues and pipes, Process arguments at spawn)
    ("n", name, dir) a named segment (file_system strategy)

Our channels set a per-thread message context around pickling (Outgoing) and
unpickling (Incoming); the reducer and the rebuilder find it there.

Note [kept counts]: a message naming a named segment carries one count of the
segment's header refcount (_shared Note [named segments]), which its receiver
takes over. A receiver that dies before it unpickles the message (a Pool
worker killed as it took its task) never takes it, and the count stayed until
the group ended. So a Pool's tasks are sent *kept* (``Packet.send(kept=True)``):
the parent keeps each message's counts (``Outgoing.held``) and its worker, which
unpickles with ``loads(kept=True)``, takes a count of its own when it first maps
the segment (``attach_named(counted=False)``), held through the daemon as any.
mp-dask sends its tasks' arguments the same way over Dask's comms
(``keep_counts`` around the pickling, ``counts_kept`` around the unpickling,
``give_back_counts`` when the task is done with or lost with its worker).
The parent gives its counts back (``Packet.settle``, unlinking at zero) once the
message is done with: every result of it read (its worker mapped what it names
before it ran), or its loss settled (the worker is dead: it held nothing, or
the daemon gave back what it held), or, at terminate, when the workers are gone.
So a count is up while the message can still be unpickled: in a socket, moved
unchanged to another slot (_pool Note [lost tasks]), or being unpickled; no
window reads zero, and none outlives it. Results (worker to parent) carry
their counts (the parent outlives its workers), told to the daemon: see Note
[results told].

Note [results told]: a Pool worker killed between its result's in-flight
count and its send left the count up until the group ended (a few segments
per run of kills). Its results are pickled with ``tls.to`` set to the pool's
process, and each in-flight count of a named segment is added by
``shm_manager.send_to``, which tells the daemon of it in the same call (``T``,
in the daemon's socket before the message goes); the handle names the sender,
``("n", name, dir, sender pid)``, and the reader takes the count over with
``take_from`` (``A``), or, mapping the segment already, gives it back itself
and says so (``drop_from``). A message not sent gives its counts back through
the daemon (``take_back``). The pool says ``done_with(pid)`` once it has read
all a dead worker sent (_pool Note [lost tasks]), and the daemon gives back
what that worker told and the pool never took (shm_manager Note [Counts sent
to a reader]). Left: a worker killed in the microseconds between its count
and that ``send``. Where no daemon can be told, the count is added as for any
message; a copy segment's handle names its sender before that is known, and
the reader's take of an untold count is a hold the daemon never gives back
twice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import weakref
from multiprocessing import context as mp_context
from multiprocessing import reduction, resource_sharer  # noqa: F401

# resource_sharer is imported here, not lazily by DupFd: an import running in a
# queue's feeder thread while another thread forks leaves its module lock held
# in the child, which then deadlocks on its first import of that module.
import numpy as np
import shm_core
import shm_manager

from . import _alloc, _arrays, _recycle, _shared, _stats
from ._byvalue import reduce_process
from ._strategy import get_inline_threshold, get_sharing_strategy

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
    spilled: shm_core.Segment | None = None  # its pickle and out-of-band buffers (_channel Note [spills])
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
            self.fds.append(_shared.fd_for_sending(seg, dup=True))
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
        return entry[1]

    def out_of_band(self, buf) -> bool:
        """The pickler's ``buffer_callback``: False (out of band, into the message's spill) for a contiguous
        buffer of at least the inline threshold, True (in the pickle) for any other."""
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: in band, where pickle raises as the stdlib's does
            return True
        n = raw.nbytes
        if n < get_inline_threshold():
            return True
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
        self.fds.append(_shared.fd_for_sending(seg, dup=True))
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
            self.fds[self._copy_ref[1]] = _shared.fd_for_sending(seg, dup=True)
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
            seg = self.segments[i] = _received(_shared.attach_fd(fd, size, owned=True))
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
            seg = self.segments[name] = _received(_shared.attach_named(name, dir, size, not self.kept, sender))
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
    to: int | None = None  # the pid of the reader of the message being pickled, told its counts (Note [results told])


#: this thread's message being pickled (Outgoing) or unpickled (Incoming); set by _channel
tls = _TLS()


def _current():
    return tls.ctx


def _dtype(dt: np.dtype):
    """A dtype as its short string where that names it exactly (cheaper to pickle), else itself."""
    return dt.str if dt.names is None and dt.subdtype is None and dt.metadata is None else dt


def _readonly(arr: np.ndarray) -> bool:
    return not arr.flags.writeable


def reduce_ndarray(arr: np.ndarray, own: bool = False):
    """The reduction of a numpy array (registered for ``numpy.ndarray`` itself). ``own``: ``arr`` is a copy made for
    this message (a transport's: ``message_copies``), its receiver's own (_shared Note [own arrays])."""
    ctx = tls.ctx
    if type(ctx) is Outgoing and arr.base is None and arr.nbytes < get_inline_threshold() \
            and (not _shared.owned or arr.nbytes < _alloc.THRESHOLD) and not arr.dtype.hasobject:
        ctx.arrays += 1
        ctx.arrays_inline += 1
        ctx.bytes_inline += arr.nbytes
        return _inline(arr)  # small, numpy's own memory: in no segment (Note [small arrays])
    if arr.dtype.hasobject:
        return arr.__reduce__()
    found = _shared.segment_of(arr)
    readonly = _readonly(arr)
    outgoing = isinstance(ctx, Outgoing)
    rebuild = rebuild_ndarray
    if found is None and outgoing and id(arr) in ctx.moves:  # _alloc Note [moving results]
        found = _shared.segment_of(arr, _shared.BORN_PRIVATE)
        rebuild = rebuild_own  # the receiver's own (_shared Note [own arrays])
    popen = None if outgoing else mp_context.get_spawning_popen()
    if found is not None and not outgoing and popen is None and not found[0].name:
        found = None  # a memfd on a channel we do not own: copied as an unshared array (Note [channels we do not own])
    if arr.nbytes == 0 or (found is None and (outgoing and ctx.copy_inline or arr.nbytes < get_inline_threshold())) \
            or (not outgoing and popen is None and get_sharing_strategy() == "file_descriptor" and found is None):
        # small, or shared memory is full (_channel._pickle), or on a channel we do not own whose sender may be
        # gone before the receiver asks for the descriptor (Note [channels we do not own]): a copy in the
        # pickle, as the stdlib sends it
        _count_inline(ctx if outgoing else None, arr.nbytes)
        return _inline(arr)
    if found is None:
        shared = ctx.input_copy(arr) if outgoing else _arrays.shared_copy(arr)  # (``readonly`` was read before)
        if shared is None:
            ref, offset, strides = ctx.copy_ref(arr)
            # size None: the message's segment grows while the message is pickled
            return rebuild_own, (ref, None, offset, arr.shape, strides, _dtype(arr.dtype), readonly)
        # each task its own copy, as from the stdlib's pickle; a launch's copy is the child's own
        rebuild = rebuild_own_copy if outgoing else rebuild_own
        arr = shared
        found = _shared.segment_of(arr)
        c = _stats.counts
        c[_stats.ARRAYS_COPIED] += 1
        c[_stats.BYTES_COPIED] += arr.nbytes
    elif not outgoing:
        _stats.counts[_stats.HANDLES_SENT] += 1
    else:
        ctx.arrays += 1
        ctx.n_handles += 1
    if own:
        rebuild = rebuild_own
    seg, offset = found
    strides = None if arr.flags.c_contiguous else arr.strides
    if seg.name:
        ref = ctx.named_ref(seg) if outgoing else _counted(seg, _named_ref_alone(seg))
    else:
        # never a silent copy: fd_for_sending raises when the descriptor cannot be re-opened
        ref = ctx.fd_ref(seg) if outgoing else _counted(seg, ("d", _launch_fd(popen, seg)))
    args = (ref, seg.size, offset, arr.shape, strides, _dtype(arr.dtype), readonly)
    block = _shared.block_of(arr, seg)
    if block is None:
        return rebuild, args
    if outgoing:
        ctx.block_ref(seg, block)
    else:
        seg.fetch_add(shm_core.HEADER_SIZE + block, 1)  # in flight, as _counted
    return rebuild, (*args, block)


def _count_inline(out: Outgoing | None, nbytes: int) -> None:
    """Count an array sent inside the pickle; one of the inline threshold or more was meant for shared memory
    (_stats Note [sharing stopped]). ``out``: the message's, else (a channel we do not own) counted now."""
    fell = nbytes >= get_inline_threshold()
    if out is not None:
        out.arrays += 1
        out.arrays_inline += 1
        out.bytes_inline += nbytes
        if fell:
            out.fallbacks += 1
            out.fallback_bytes += nbytes
        return
    c = _stats.counts
    c[_stats.ARRAYS_INLINE] += 1
    c[_stats.BYTES_INLINE] += nbytes
    if fell:
        c[_stats.FALLBACKS] += 1
        c[_stats.FALLBACK_BYTES] += nbytes
        _stats.sharing_stopped(1, nbytes, "channel")


def _inline(arr: np.ndarray) -> tuple:
    if arr.flags.writeable and arr.dtype.isnative:  # numpy's own, as the stdlib sends it (Note [small arrays])
        return arr.__reduce__()
    order = _arrays.copy_order(arr)
    return rebuild_inline, (arr.tobytes(order), _dtype(arr.dtype), arr.shape, order, _readonly(arr))


# Note [small arrays]: a small array travels in the pickle, every one of a message: a writable one in native byte
# order by numpy's own reduction, as the stdlib sends it (its rebuild is numpy's C: a chunk of 250 small results
# loaded in 196 us, against 603 us through rebuild_inline), any other by rebuild_inline (its bytes, its dtype's
# string, byte order and read-only flag kept). A message of a thousand small arrays is pickled once, at
# about the cost of the stdlib's pickle of it (it was pickled a second time, each of them put in shared memory,
# when its pickle passed INLINE bytes: it is spilled now, Note [spills]). On our channels one that owns its data (no
# base) is in no segment when the process has no shared allocation (_alloc: ``_shared.owned`` empty) or it is under
# _alloc's THRESHOLD (the shared handler holds no allocation under it: its realloc moves data by size): it skips
# the search for one (segment_of, and the walk of _alloc Note [moving results], which leaves it out). A worker
# keeping one born-private array alive sent every small array the slow way: a Pool.map of dicts of 50 small arrays
# ran 1.3x the stdlib's.
def rebuild_inline(data: bytes, dtype, shape, order: str, readonly: bool) -> np.ndarray:
    """Rebuild a small array sent inside the pickle, byte order and read-only flag kept (numpy's own
    protocol-4 reduction, which the stdlib uses, loses both)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise shm_core.SegmentError(f"inline array of dtype {dtype} holds Python objects (forged message)")
    if dtype.itemsize == 0:  # np.dtype("V0"): no bytes whatever the shape (frombuffer refuses the dtype); an
        # unsized "U" or "S" names no array's dtype (numpy makes them 1 character long, with memory for each)
        if dtype.kind != "V" or len(data) or _too_big(shape, 0):
            raise shm_core.SegmentError(f"inline array of dtype {dtype} with {len(data)} bytes and shape "
                                        f"{tuple(shape)!r:.80} (forged message)")
        arr = np.empty(shape, dtype, order=order)
    else:  # read-only: a view of ``data``, which may be a writable buffer (a Pipe's)
        arr = np.frombuffer(data if readonly else bytearray(data), dtype).reshape(shape, order=order)
    if readonly:
        arr.flags.writeable = False
    return arr


# Note [channels we do not own]: outside our channels (no Outgoing context) a memfd
# segment's descriptor can travel only by ``multiprocessing.reduction.DupFd``. While a
# process is being launched (Process arguments under spawn and forkserver: ``mp.spawn``,
# Pool and executor ``initargs``) the launcher passes it with the child's other
# descriptors, so the child gets it whatever the parent does next; we hand the launcher a
# dup, open until the Popen object goes, since the argument's segment (a copy made just
# for the pickle) may be gone before the launch. Anywhere else (the stdlib's Queue and
# Pipe, Manager proxies) DupFd's resource sharer serves the descriptor from a thread of
# the sender, which may have exited by the time the receiver asks: so there, under the
# file_descriptor strategy, every array travels as a copy in the pickle, exactly as the
# stdlib sends it (shared ones too: losing an array is worse than losing the sharing).
# Named segments (file_system) travel by name on every channel: their in-flight count
# keeps them for the receiver whoever exits first. There, under file_system, an array in
# a memfd segment (received, born shared, made before the strategy was set) is copied as
# an unshared one is: into a named segment, or inline when small.
def _launch_fd(popen, seg: shm_core.Segment):
    """A DupFd of ``seg`` for the child ``popen`` launches: one per segment (the spawn launcher rejects a
    descriptor passed twice), a dup kept open until ``popen`` goes (Note [channels we do not own])."""
    table = popen.__dict__.get("_arraymp_dupfds")
    if table is None:
        table = popen._arraymp_dupfds = {}
        weakref.finalize(popen, _close_dups, table)
    entry = table.get(seg.key)
    if entry is None:
        fd = _shared.fd_for_sending(seg, dup=True)
        entry = table[seg.key] = (fd, reduction.DupFd(fd))
    return entry[1]


def _close_dups(table: dict) -> None:
    for fd, _ in table.values():
        os.close(fd)


def _named_ref_alone(seg):
    seg.incref()  # in flight; the receiver takes it over, unless this process keeps it (keep_counts)
    if tls.held is not None:
        tls.held.append(seg)
    return ("n", seg.name, seg.dir)


@contextlib.contextmanager
def keep_counts(held: list):
    """Pickle (for a transport not ours: Dask's comms) with this process keeping the in-flight counts of the named
    segments the pickle names: appended to ``held``; give them back with ``give_back_counts(held)`` once the
    receiver has unpickled it (under ``counts_kept``) or is gone (Note [kept counts])."""
    saved, tls.held = tls.held, held
    try:
        yield
    finally:
        tls.held = saved


@contextlib.contextmanager
def counts_kept():
    """Unpickle what was pickled under ``keep_counts``: each named segment it names is mapped with a count of this
    process's own (Note [kept counts])."""
    saved, tls.kept = tls.kept, True
    try:
        yield
    finally:
        tls.kept = saved


def give_back_counts(held: list) -> None:
    """Give back the counts ``keep_counts`` kept in ``held`` (emptied: a second call gives back nothing)."""
    while held:
        _shared.give_back_named(held.pop())


def _counted(seg: shm_core.Segment, ref: tuple) -> tuple:
    """``ref``, with one in-flight count of ``seg`` for this array (a message outside our channels)."""
    seg.fetch_add(_recycle.REFS, 1)
    return ref


def _received(seg: shm_core.Segment) -> shm_core.Segment:
    """Keep the mapping for the segment's next arrival (once per segment per message), see _recycle."""
    _recycle.received(seg)
    return seg


def _segment_for(ref, size: int) -> shm_core.Segment:
    kind = ref[0] if type(ref) is tuple and ref else None
    if kind in ("m", "c") and len(ref) == 2 and type(ref[1]) is int:
        ctx = _current()
        if not isinstance(ctx, Incoming):
            raise shm_core.SegmentError("a message-descriptor handle was unpickled outside an arraymp channel")
        return ctx.segment(ref[1], size)
    if kind == "d" and len(ref) == 2 and callable(getattr(ref[1], "detach", None)):
        fd = ref[1].detach()
        if type(fd) is not int or fd < 0:
            raise shm_core.SegmentError(f"array handle's DupFd gave {fd!r:.80}, not a descriptor (forged handle)")
        return _received(_shared.attach_fd(fd, size, owned=True))
    if kind == "n" and len(ref) in (3, 4) and type(ref[1]) is str and type(ref[2]) is str and \
            (len(ref) == 3 or (type(ref[3]) is int and 0 < ref[3] < 1 << 31)):
        # shm_core.attach checks the name, and that the directory is this process's (Note [untrusted handles]);
        # a sender (Note [results told]) forged or wrong takes a count it never owned, as a forged name does
        sender = ref[3] if len(ref) == 4 else None
        ctx = _current()
        if isinstance(ctx, Incoming):
            return ctx.named(ref[1], ref[2], size, sender)
        return _received(_shared.attach_named(ref[1], ref[2], size, not tls.kept, sender))
    raise shm_core.SegmentError(f"unknown segment reference {ref!r:.80} (forged or corrupted handle)")


def _check_fields(size, offset, shape, strides, dtype, readonly) -> tuple[np.dtype, tuple]:
    """A handle's dtype and strides (C order when None), once every field is checked: each comes from another
    process, and a forged or corrupted one must raise SegmentError (a ValueError), never crash the receiver."""
    try:
        dtype = np.dtype(dtype)
    except Exception as exc:  # TypeError, ValueError, ...: whatever numpy makes of a forged field
        raise shm_core.SegmentError(f"array handle has dtype {dtype!r:.80}, not a numpy dtype ({exc}); "
                                    "forged or corrupted handle") from None
    if dtype.hasobject:
        # the reducer sends such arrays pickled, never as handles: an array of them over shared
        # bytes would dereference whatever those bytes say as object pointers
        raise shm_core.SegmentError(f"array handle has dtype {dtype}, which holds Python objects: such arrays never "
                                    "travel as shared memory; forged or corrupted handle, not rebuilt")
    if dtype.subdtype is not None:
        raise shm_core.SegmentError(f"array handle has subarray dtype {dtype}, which no array has (numpy moves it "
                                    "into the shape); forged or corrupted handle")
    if type(readonly) is not bool or not (size is None or type(size) is int and size >= 0) or type(offset) is not int:
        raise shm_core.SegmentError(f"array handle has readonly={readonly!r:.80}, size={size!r:.80}, offset="
                                    f"{offset!r:.80}: expected a bool, a non-negative int or None, and an int; "
                                    "forged or corrupted handle")
    if not (type(shape) is tuple and len(shape) <= 64 and all(type(n) is int and n >= 0 for n in shape)):
        raise shm_core.SegmentError(f"array handle has shape {shape!r:.80}: not a tuple of at most 64 (numpy's "
                                    "limit) non-negative ints; forged or corrupted handle")
    if _too_big(shape, dtype.itemsize):
        raise shm_core.SegmentError(f"array handle has shape {shape!r:.80} of {dtype}: more bytes than an array "
                                    "can hold; forged or corrupted handle")
    if strides is None:
        strides = _c_strides(shape, dtype.itemsize)
    if not (type(strides) is tuple and all(type(st) is int and abs(st) < 1 << 63 for st in strides)):
        raise shm_core.SegmentError(f"array handle has strides {strides!r:.80}: not a tuple of 64-bit ints; "
                                    "forged or corrupted handle")
    if len(strides) != len(shape):
        raise shm_core.SegmentError(f"array handle has {len(shape)} dimensions but {len(strides)} strides")
    return dtype, strides


def _too_big(shape, itemsize: int) -> bool:
    """More items or bytes than an array can hold (numpy checks bytes, but takes any count of 0-byte items,
    which every loop over them then never ends)."""
    items = 1
    for n in shape:
        items *= max(n, 1)
    return items * max(itemsize, 1) >= 1 << 63


def _check_extent(size: int, offset: int, shape, strides, itemsize: int) -> None:
    lo = hi = offset
    if all(n > 0 for n in shape):
        for n, st in zip(shape, strides, strict=True):
            if st < 0:
                lo += st * (n - 1)
            else:
                hi += st * (n - 1)
        hi += itemsize
    if offset < 0 or lo < 0 or hi > size:
        raise shm_core.SegmentError(f"array handle out of bounds: offset {offset}, shape {tuple(shape)}, strides "
                                    f"{tuple(strides)} span bytes [{lo}, {hi}) of a {size}-byte segment "
                                    "(forged or corrupted handle)")


def rebuild_own(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """Rebuild an array its sender copied into shared memory for the message, or moved: a view of the segment, as
    this process's own (_shared Note [own arrays])."""
    return _shared.own(rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block))


def rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """Rebuild a shared array: a view of the segment ``ref`` names (of its arena block ``block``, if any)."""
    seg = _segment_for(ref, size)  # first: a refused handle's descriptor or named count is taken over too
    dtype, strides = _check_fields(size, offset, shape, strides, dtype, readonly)
    if block is None:
        if _shared.is_arena(seg):
            raise shm_core.SegmentError("array handle names an arena without its block (forged or corrupted handle)")
        _check_extent(seg.size, offset, shape, strides, dtype.itemsize)
        arr = seg.ndarray(shape, dtype, offset, strides, readonly=readonly)
    else:
        base = _shared.block_view(seg, block)  # counts this process's view of the block, once
        offset -= block + _shared.BLOCK_HEAD
        _check_extent(base.nbytes, offset, shape, strides, dtype.itemsize)
        arr = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)
        if readonly:
            arr.flags.writeable = False
        seg.fetch_add(shm_core.HEADER_SIZE + block, -1)  # the message's count, now that we view it
    ctx = _current()
    if isinstance(ctx, Incoming) and ref[0] != "d":
        ctx.viewed(ref[:2], seg)  # once per segment per message, as the sender counted
    else:
        seg.fetch_add(_recycle.REFS, -1)  # counted per array by the reducer (_counted)
    return arr


# Note [inputs once per call]: a Pool call whose tasks all take the same unshared array (``partial(f, big)``,
# ``starmap`` of ``(big, i)`` pairs) copied it into a new message segment for every task: a 256 MiB input cost a
# copy per task and one segment per task in flight (+0.8 GiB in the run). The Pool gives the messages of one
# call (job) one ``inputs`` table, id -> [weak reference to the array, its shared copy]. An array's first message
# copies it as before (the
# task gets a view of that segment: no copy on arrival); its second makes one shared copy (``shared_copy``: a
# recycled segment) that this and every later message of the call name as a handle. Each such task rebuilds its
# own private copy from it (``rebuild_own_copy``), as the stdlib's unpickling gives each task its own array: a task
# that writes its input never changes another's. An entry holds its array weakly (an id is the array's only while
# it lives: the entry goes with it, and a new array with the same id is a new entry), and the table goes when the
# call's result is complete (the Pool's cache entry goes: _Cache); the shared copy's segment then goes back to the
# recycling pool once the last task's view is gone (_recycle Note [recycling]). Only map-like calls have a table
# (an apply sends one task). A caller who changes the array while the call runs: the stdlib's tasks pickled later
# see the change, ours after the first two do not.
def rebuild_own_copy(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """An input a Pool call shares once for all its tasks (Note [inputs once per call]): this task's own copy."""
    view = rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block)
    arr = view.copy(order="K")
    if readonly:
        arr.flags.writeable = False
    return arr


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def init_reductions() -> None:
    """Register the array reductions with ``multiprocessing.reduction.ForkingPickler`` (once).

    Called by ``import arraymp``, and when a process receives one of our
    channels, so a spawned child sends arrays by shared memory too.
    """
    if reduction.ForkingPickler._extra_reducers.get(np.ndarray) is reduce_ndarray:
        return
    reduction.ForkingPickler.register(np.ndarray, reduce_ndarray)
    for process in (mp_context.SpawnProcess, mp_context.ForkServerProcess):  # _byvalue Note [by value]
        reduction.ForkingPickler.register(process, reduce_process)
    _stats.publish()  # readable by `python -m arraymp stats PID` from now on (_stats Note [stats])
    # Join (or start) this program's shm-manager group now: a child joins its
    # parent's, and a new program sweeps what dead groups left in /dev/shm.
    shm_manager.group()
    if importlib.util.find_spec("cupy") is None:  # no cupy array to reduce: shm_cuda's import (~5 ms) not paid
        return
    try:
        import shm_cuda
    except ImportError:
        return
    shm_cuda.init_reductions(reduction.ForkingPickler.register)
