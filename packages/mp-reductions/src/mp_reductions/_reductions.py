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
"""

from __future__ import annotations

import os
import threading
from multiprocessing import context as mp_context
from multiprocessing import reduction, resource_sharer  # noqa: F401

# resource_sharer is imported here, not lazily by DupFd: an import running in a
# queue's feeder thread while another thread forks leaves its module lock held
# in the child, which then deadlocks on its first import of that module.
import numpy as np
import shm_core
import shm_manager

from . import _recycle, _shared
from ._strategy import get_inline_threshold, get_sharing_strategy

MAX_FDS = 250  # the kernel passes at most 253 descriptors in one message (SCM_MAX_FD)


class Outgoing:
    """What a message being pickled needs besides its bytes: descriptors and copies."""

    def __init__(self, share_all: bool = False, pooled: bool = True):
        self.share_all = share_all  # no array inline: the message would not fit the socket otherwise
        self.pooled = pooled  # file_system: the copy may go into a pooled segment chosen at the first copy
        self.inlined = 0  # arrays that went inline
        self.handles = False  # the message names shared memory (the receiver needs an Incoming)
        self.fds: list[int] = []
        self.keep: list = []  # objects whose descriptors or counts must live until sent
        self.in_flight: list[shm_core.Segment] = []  # segments this message counts in flight (_recycle.REFS)
        self._index: dict[int, int] = {}
        self._copies: list[tuple[np.ndarray, int]] = []
        self._copy_size = 0
        self._copy_ref = None
        self.recycled: shm_core.Segment | None = None  # the message's copy segment, back to the pool once sent

    def fd_ref(self, seg: shm_core.Segment, fd: int) -> tuple:
        self.handles = True
        i = self._index.get(id(seg))
        if i is None:
            if len(self.fds) >= MAX_FDS:
                raise ValueError(f"one message can carry at most {MAX_FDS} shared-memory segments; pack the "
                                 "arrays with arraymp.share_memory(...) (one segment for all) or send them in "
                                 "several messages")
            i = self._index[id(seg)] = len(self.fds)
            self.fds.append(fd)
            self.keep.append(seg)
            self._count_in_flight(seg)
        return ("m", i)

    def _count_in_flight(self, seg: shm_core.Segment) -> None:
        seg.fetch_add(_recycle.REFS, 1)  # see _recycle Note [recycling]: it may be a recycled copy
        self.in_flight.append(seg)

    def named_ref(self, seg: shm_core.Segment) -> tuple:
        self.handles = True
        if id(seg) not in self._index:
            self._index[id(seg)] = -1
            seg.incref()  # the in-flight count, see _shared Note [named segments]
            self.keep.append(seg)
            self._count_in_flight(seg)
        return ("n", seg.name, seg.dir)

    def copy_ref(self, arr: np.ndarray) -> tuple[tuple, int]:
        self.handles = True
        offset = self._copy_size
        self._copy_size = _shared._aligned(offset + arr.nbytes)
        self._copies.append((arr, offset))
        if self._copy_ref is None:
            if get_sharing_strategy() == "file_system":
                # the name goes into the pickle now, the size is known at finish(): a pooled segment
                # at least as large as this first array, else a new one made then (see CopyMiss)
                seg = self.recycled = _recycle.take_named(arr.nbytes) if self.pooled else None
                self._copy_ref = ("n", seg.name, seg.dir) if seg else \
                    ("n", shm_manager.new_name(), shm_core.shm_dir())
            else:
                self._copy_ref = ("c", len(self.fds))
                self.fds.append(-1)  # filled by finish()
        return self._copy_ref, offset

    def finish(self) -> None:
        """Create the message's segment and copy the arrays into it."""
        if not self._copies:
            return
        kind = self._copy_ref[0]
        if kind == "n":
            seg = self.recycled
            if seg is None:
                seg = self.recycled = _shared.new_segment(self._copy_size, "file_system", name=self._copy_ref[1])
            elif seg.size < self._copy_size:
                raise CopyMiss
            seg.incref()  # in flight, see _shared Note [named segments]; this process holds it for its pool
            self.keep.append(seg)
            self._index[id(seg)] = -1  # abort() gives the in-flight count back
        else:
            seg = self.recycled = _recycle.take(self._copy_size)
            self.fds[self._copy_ref[1]] = seg.fd
        self._count_in_flight(seg)
        for arr, offset in self._copies:
            np.copyto(seg.ndarray(arr.shape, arr.dtype, offset), arr, casting="no")
        self._copies.clear()

    def sent(self) -> None:
        """The message is in the socket: what it held may go, its copy segment back to the pool."""
        self.keep.clear()
        self.in_flight.clear()
        if self.recycled is not None:
            _recycle.sent(self.recycled)
            self.recycled = None

    def abort(self) -> None:
        """The message will not be sent: give back the in-flight counts taken."""
        for obj in self.keep:
            if isinstance(obj, shm_core.Segment) and obj.name and self._index.get(id(obj)) == -1:
                obj.decref()
        self.keep.clear()
        for seg in self.in_flight:
            seg.fetch_add(_recycle.REFS, -1)
        self.in_flight.clear()
        if self.recycled is not None:
            _recycle.sent(self.recycled)
            self.recycled = None


class CopyMiss(Exception):
    """The pooled segment chosen at a message's first copy is too small for all its copies: pickle the
    message again with ``Outgoing(pooled=False)`` (a new segment of the exact size)."""


class Incoming:
    """The descriptors that came with a message, resolved to segments on first use."""

    def __init__(self, fds: list[int]):
        self.fds = fds
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

    def named(self, name: str, dir: str, size: int | None) -> shm_core.Segment:
        # one in-flight count per segment per message, see Outgoing.named_ref
        seg = self.segments.get(name)
        if seg is None:
            seg = self.segments[name] = _received(_shared.attach_named(name, dir, size))
        return seg

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []


class _TLS(threading.local):
    ctx = None


#: this thread's message being pickled (Outgoing) or unpickled (Incoming); set by _channel
tls = _TLS()


def _current():
    return tls.ctx


def _dtype(dt: np.dtype):
    """A dtype as its short string where that names it exactly (cheaper to pickle), else itself."""
    return dt.str if dt.names is None and dt.subdtype is None and dt.metadata is None else dt


def _readonly(arr: np.ndarray) -> bool:
    return not arr.flags.writeable


def reduce_ndarray(arr: np.ndarray):
    """The reduction of a numpy array (registered for ``numpy.ndarray`` itself)."""
    if arr.dtype.hasobject:
        return arr.__reduce__()
    found = _shared.segment_of(arr)
    ctx = _current()
    if found is None:
        if arr.nbytes == 0 or (arr.nbytes < get_inline_threshold() and not (ctx and ctx.share_all)):
            if isinstance(ctx, Outgoing):
                ctx.inlined += 1
            return arr.__reduce__()
        if isinstance(ctx, Outgoing):
            ref, offset = ctx.copy_ref(arr)
            # size None: the message's segment grows while the message is pickled
            return rebuild_ndarray, (ref, None, offset, arr.shape, None, _dtype(arr.dtype), _readonly(arr))
        arr = _shared.share_memory(arr)
        found = _shared.segment_of(arr)
    seg, offset = found
    strides = None if arr.flags.c_contiguous else arr.strides
    if seg.name:
        ref = ctx.named_ref(seg) if isinstance(ctx, Outgoing) else _counted(seg, _named_ref_alone(seg))
    else:
        fd = _shared.fd_for_sending(seg)
        if fd < 0:
            _shared.warn_copy_resend()
            return reduce_ndarray(np.array(arr, copy=True))
        ref = ctx.fd_ref(seg, fd) if isinstance(ctx, Outgoing) else _counted(seg, ("d", _dupfd(fd)))
    return rebuild_ndarray, (ref, seg.size, offset, arr.shape, strides, _dtype(arr.dtype), _readonly(arr))


def _dupfd(fd: int):
    """One DupFd per descriptor per spawning: the spawn launcher rejects a descriptor passed twice."""
    popen = mp_context.get_spawning_popen()
    if popen is None:
        return reduction.DupFd(fd)
    table = popen.__dict__.setdefault("_arraymp_dupfds", {})
    if fd not in table:
        table[fd] = reduction.DupFd(fd)
    return table[fd]


def _named_ref_alone(seg):
    seg.incref()  # in flight; the receiver takes it over
    return ("n", seg.name, seg.dir)


def _counted(seg: shm_core.Segment, ref: tuple) -> tuple:
    """``ref``, with one in-flight count of ``seg`` for this array (a message outside our channels)."""
    seg.fetch_add(_recycle.REFS, 1)
    return ref


def _received(seg: shm_core.Segment) -> shm_core.Segment:
    """Keep the mapping for the segment's next arrival (once per segment per message), see _recycle."""
    _recycle.received(seg)
    return seg


def _segment_for(ref, size: int) -> shm_core.Segment:
    kind = ref[0]
    if kind in ("m", "c"):
        ctx = _current()
        if not isinstance(ctx, Incoming):
            raise shm_core.SegmentError("a message-descriptor handle was unpickled outside an arraymp channel")
        return ctx.segment(ref[1], size)
    if kind == "d":
        return _received(_shared.attach_fd(ref[1].detach(), size, owned=True))
    if kind == "n":
        ctx = _current()
        if isinstance(ctx, Incoming):
            return ctx.named(ref[1], ref[2], size)
        return _received(_shared.attach_named(ref[1], ref[2], size))
    raise shm_core.SegmentError(f"unknown segment reference {ref!r}")


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


def rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly):
    """Rebuild a shared array: a view of the segment ``ref`` names."""
    dtype = np.dtype(dtype)
    if strides is None:
        strides = _c_strides(shape, dtype.itemsize)
    if len(strides) != len(shape):
        raise shm_core.SegmentError(f"array handle has {len(shape)} dimensions but {len(strides)} strides")
    seg = _segment_for(ref, size)
    _check_extent(seg.size, offset, shape, strides, dtype.itemsize)
    arr = seg.ndarray(shape, dtype, offset, strides, readonly=readonly)
    ctx = _current()
    if isinstance(ctx, Incoming) and ref[0] != "d":
        ctx.viewed(ref[:2], seg)  # once per segment per message, as the sender counted
    else:
        seg.fetch_add(_recycle.REFS, -1)  # counted per array by the reducer (_counted)
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
    # Join (or start) this program's shm-manager group now: a child joins its
    # parent's, and a new program sweeps what dead groups left in /dev/shm.
    shm_manager.group()
    try:
        import shm_cuda
    except ImportError:
        return
    shm_cuda.init_reductions(reduction.ForkingPickler.register)
