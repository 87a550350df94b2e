"""Messages that are one array alone, sent with no pickle (Note [bare arrays]).

Queue ping-pongs of a small array and streams of shared arrays are the messages
whose cost is all per message: pickling them cost more than the system calls
that carry them. A message that is exactly one ``numpy.ndarray`` goes as a
fixed header and its bytes (a small array) or its handle (a shared one)::

    b"A" <BBB flags, len(code), ndim> code shape          the array's bytes
    b"B" <qqq size, offset, block> <BBB ...> code shape [strides]   + its segment's descriptor

``code`` is the dtype's string (``dtype.str``), shape and strides are int64s,
flags: read-only 1, Fortran order 2 (b"A"), strides follow 4 (b"B").
"""

from __future__ import annotations

import os
import struct
from multiprocessing.reduction import ForkingPickler

import numpy as np
import shm_core

from . import _attach, _recycle, _shared, _stats
from ._arrays import copy_order
from ._message import Outgoing, _received
from ._reductions import reduce_ndarray
from ._strategy import get_inline_threshold

# Note [bare arrays]
# ~~~~~~~~~~~~~~~~~~
# Invariant: a message that is one array goes bare exactly when reduce_ndarray is the reducer registered for ndarray
# (one registered in its place is honoured) and would send the array as the only thing in its pickle, and the
# receiver rebuilds what the pickled form would rebuild. That is an ndarray itself (no subclass) of a dtype its
# string names exactly (no Python objects, fields, subarray or metadata), and either
#
# - inline (b"A", a plain message): no bytes, or under the inline threshold and in no segment;
# - a handle (b"B", one descriptor): in a memfd segment (an arena block too), counted in flight and given back as a
#   pickled handle is (Note [bare handles]).
#
# Everything else (a copy into a new segment, a named segment) is pickled; a pickle starts with b"\x80", so
# ``_channel.loads`` tells them apart. Every field comes from another process: one that names no array is a
# SegmentError before anything is made (shm_core.array_from checks the header: a dtype with no Python objects, fields
# or subarray, dimensions that fit an array, its bytes exactly the array's or its view inside the segment).
#
# Note [bare handles]
# ~~~~~~~~~~~~~~~~~~~
# Invariant: a bare handle is counted as a pickled handle to the same memory is: its in-flight count is _recycle's
# REFS word (an arena block's likewise: _shared Note [arenas]), taken by Outgoing.fd_ref (block_ref) and given back
# by the receiver once its view exists (a view made here counts as this process's, through the segment's memoryview,
# the array's base); a message lost unreceived keeps its counts.
#
# A bare handle is a message with one descriptor: the receive's peek (shm_core Note [descriptor headroom]) and the
# descriptor LRU (_shared Note [descriptors]: attach_fd) treat it as any. The shared allocator's arrays (_alloc) are
# found by segment_of and go the same way. The caches here hold dtypes only (a fork child's are as good as its
# parent's).
_HANDLE = struct.Struct("<cqqq")
BARE_MAX = 64 * 1024 - 1024  # _pickling.INLINE less the largest header (255 dtype bytes, 64 dimensions)
READONLY, FORTRAN, STRIDES = 1, 2, 4
BARE_KINDS = b"AB"  # a bare message's first byte: its bytes, its handle
_A, _B = BARE_KINDS
_CACHE_MAX = 256

_codes: dict[int, tuple[np.dtype, bytes | None]] = {}  # id(dtype) -> (dtype, its code or None: not bare)


def _code(dt: np.dtype) -> bytes | None:
    entry = _codes.get(id(dt))
    if entry is not None and entry[0] is dt:  # (the entry keeps dt alive: its id names no other dtype)
        return entry[1]
    code = None if dt.hasobject or dt.names is not None or dt.subdtype is not None or dt.metadata is not None \
        else dt.str.encode()
    if code is not None and len(code) > 255:
        code = None
    if len(_codes) >= _CACHE_MAX:
        _codes.clear()
    _codes[id(dt)] = (dt, code)
    return code


def encode(arr: np.ndarray) -> tuple[bytes, Outgoing] | None:
    """The payload of a message that is ``arr`` alone, and its Outgoing (descriptors, counts); None: pickle it."""
    code = _code(arr.dtype)
    if code is None or ForkingPickler._extra_reducers.get(np.ndarray) is not reduce_ndarray:
        return None
    n = arr.nbytes
    found = _shared.segment_of(arr) if n else None
    flags = not arr.flags.writeable
    if found is None:
        if n and (n >= get_inline_threshold() or n > BARE_MAX):
            return None  # a copy into shared memory
        if copy_order(arr) == "F":
            flags |= FORTRAN
        return shm_core.pack_array(b"A", arr, code, flags, True), _Inline(n)
    seg, offset = found
    if seg.name:
        return None  # a named segment: pickled (Outgoing.named_ref)
    if not arr.flags.c_contiguous:
        flags |= STRIDES
    block = _shared.block_of(arr, seg)
    out = _Handle(seg, block)
    try:
        return shm_core.pack_array(_HANDLE.pack(b"B", seg.size, offset, -1 if block is None else block), arr,
                                   code, flags, False), out
    except BaseException:
        out.abort()
        raise


class _Handle:
    """What a bare handle holds until it is sent (an Outgoing of one array, Outgoing.fd_ref / block_ref's counts):
    a dup of its segment's descriptor, and the in-flight counts of the segment and its arena block."""

    __slots__ = ("block", "fds", "keep")
    handles = True
    buffers = ()  # never out-of-band ones

    def __init__(self, seg: shm_core.Segment, block: int | None):
        self.fds = [_attach.fd_for_sending(seg, dup=True)]  # (raises when it cannot be re-opened: nothing taken)
        self.keep, self.block = [seg], block
        seg.fetch_add(_recycle.REFS, 1)
        if block is not None:
            seg.fetch_add(shm_core.HEADER_SIZE + block, 1)

    def sent(self, kept: bool = False) -> None:
        """In the socket: the receiver gives the counts back (``kept`` or not: it names no named segment)."""
        if self.keep:
            os.close(self.fds.pop())
            self.keep.clear()
            _stats.counts[_stats.HANDLES_SENT] += 1

    def abort(self) -> None:
        """Never sent: the counts back."""
        if self.keep:
            os.close(self.fds.pop())
            seg = self.keep.pop()
            seg.fetch_add(_recycle.REFS, -1)
            if self.block is not None:
                seg.fetch_add(shm_core.HEADER_SIZE + self.block, -1)

    def settle(self) -> None:
        """Nothing kept (Outgoing.settle)."""


NOTHING = Outgoing()  # a raw message's: nothing to give back


class _Inline:
    """A bare inline array's Outgoing: nothing to give back; counted once sent (_stats Note [stats])."""

    __slots__ = ("nbytes",)
    handles = False
    fds = keep = buffers = ()

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def sent(self, kept: bool = False) -> None:
        c = _stats.counts
        c[_stats.ARRAYS_INLINE] += 1
        c[_stats.BYTES_INLINE] += self.nbytes

    def abort(self) -> None:
        pass

    def settle(self) -> None:
        pass


def decode(data, fds: list[int] | None) -> np.ndarray:
    """The array of a bare message's payload ``data`` (and ``fds``, its descriptors: closed or kept here)."""
    try:
        kind = data[0]
        if kind == _A and fds is None:
            return shm_core.array_from(data, 1, None, 0)
        if kind == _B and fds is not None and len(fds) == 1:
            return _handle(data, fds)
        raise ValueError(f"kind {bytes(data[:1])!r} with {0 if fds is None else len(fds)} descriptors")
    except (ValueError, TypeError, IndexError, struct.error) as e:  # (SegmentError is a ValueError)
        raise shm_core.SegmentError(f"bare array message names no array: {e} (forged or corrupted message)") \
            from None
    finally:
        for fd in fds or ():
            if fd >= 0:
                os.close(fd)


def _handle(data, fds: list[int]) -> np.ndarray:
    _, size, offset, block = _HANDLE.unpack_from(data)
    fd, fds[0] = fds[0], -1
    if size < 0:
        os.close(fd)
        raise ValueError(f"size {size}")
    seg = _received(_attach.attach_fd(fd, size, owned=True))
    if block < 0:
        if _shared.is_arena(seg):
            raise ValueError("a handle names an arena without its block")
        view = memoryview(seg)  # the array's base: a buffer export, counted as this process's view of seg
        arr = shm_core.array_from(data, _HANDLE.size, view.toreadonly() if data[_HANDLE.size] & READONLY else view,
                                  offset)
    else:
        base = _shared.block_view(seg, block)  # counts this process's view of the block, once
        arr = shm_core.array_from(data, _HANDLE.size, base, offset - block - _shared.BLOCK_HEAD)
        seg.fetch_add(shm_core.HEADER_SIZE + block, -1)  # the message's count, now that we view it
    seg.fetch_add(_recycle.REFS, -1)  # the message's in-flight count (Outgoing.fd_ref)
    return arr
