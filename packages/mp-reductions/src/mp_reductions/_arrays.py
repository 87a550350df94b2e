"""Shared arrays made on purpose: ``empty_shared``, ``zeros_shared``, ``share_memory``, the shared copies the
channels make (``shared_copy``, ``message_copies``), and the allocator that carves small ones out of arenas
(_shared Note [arenas]: how a block is counted; here, how blocks are handed out and taken back).

In the module layers, this is above _shared (segments, views and their counts), _recycle (segments kept for
reuse, and ``new_segment``, which gives them back when shared memory is full) and _alloc (numpy's allocations
born in shared memory), and imported by the channels' reductions and the package's API."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, TypeVar

import numpy as np
import shm_core

from . import _alloc, _recycle, _shared
from ._strategy import get_sharing_strategy

if TYPE_CHECKING:
    from numpy.typing import DTypeLike, NDArray

_T = TypeVar("_T")

ARENA_SIZE = 4 << 20
ARENA_ITEM_MAX = 64 << 10
MAX_ARENAS = 4
_REUSE_TRIES = 8
_HDR = shm_core.HEADER_SIZE


class _Arena:
    """One arena of this process's allocator: its bump pointer and the blocks it may hand out again."""

    __slots__ = ("seg", "used", "starts", "free", "queued")

    def __init__(self, seg: shm_core.Segment):
        # alive while any of its arrays is, or the recycler keeps it (_shared Note [arenas])
        self.seg = weakref.ref(seg)
        self.used = 0
        self.starts = bytearray(seg.size // _shared.ALIGN)  # 1 where a block of this arena starts
        self.free: dict[int, collections.deque] = {}  # data size -> blocks whose local view is gone
        self.queued: set[int] = set()

    def carve(self, seg: shm_core.Segment, size: int) -> int | None:
        block = self.used
        if block + _shared.BLOCK_HEAD + size > seg.size:
            return None
        self.used += _shared.BLOCK_HEAD + size
        self.starts[block // _shared.ALIGN] = 1
        seg.store(_HDR + block + 8, size)
        seg.store(_HDR + block, 1)  # this process's view; nobody else can reach a fresh block
        return block

    def reuse(self, seg: shm_core.Segment, size: int) -> int | None:
        """A block of ``size`` that no process views and no message names, taken (count 0 -> 1)."""
        q = self.free.get(size)
        if not q:
            return None
        for _ in range(min(len(q), _REUSE_TRIES)):
            block = q.popleft()
            if seg.compare_exchange(_HDR + block, 0, 1)[0]:
                self.queued.discard(block)
                return block
            q.append(block)  # still viewed somewhere, or in flight
        return None

    def dropped(self, block: int, size: int) -> None:
        """This process's view of ``block`` is gone: a candidate for reuse."""
        if block < self.used and self.starts[block // _shared.ALIGN] and block not in self.queued:
            self.queued.add(block)
            self.free.setdefault(size, collections.deque()).append(block)


class _Arenas:
    """This process's allocator of small shared arrays (_shared Note [arenas])."""

    def __init__(self):
        self.lock = threading.Lock()
        self.strategy = None
        self.arenas: dict[int, _Arena] = {}  # header id -> arena, oldest first

    def alloc(self, nbytes: int) -> tuple[shm_core.Segment, int, int] | None:
        """``(segment, block, size)`` of a block of at least ``nbytes``; None when no arena fits in memory."""
        size = _shared.aligned(max(nbytes, 1))
        strategy = get_sharing_strategy()
        with self.lock:
            if strategy != self.strategy:
                self.arenas.clear()  # the others' arenas go with their arrays
                self.strategy = strategy
            while _shared.dropped_blocks:
                ident, block, bsize = _shared.dropped_blocks.popleft()
                arena = self.arenas.get(ident)
                if arena is not None:
                    arena.dropped(block, bsize)
            newest = None
            for ident, arena in reversed(list(self.arenas.items())):
                seg = arena.seg()
                if seg is None:
                    del self.arenas[ident]
                    continue
                newest = newest or (arena, seg)
                block = arena.reuse(seg, size)
                if block is not None:
                    return seg, block, size
            if newest is not None:
                block = newest[0].carve(newest[1], size)
                if block is not None:
                    return newest[1], block, size
            try:
                seg = _recycle.new_segment(ARENA_SIZE)
            except shm_core.SharedMemoryFullError:
                return None
            seg.store(shm_core.USER_OFFSET, _shared.ARENA_MARK)
            arena = self.arenas[seg.id] = _Arena(seg)
            if len(self.arenas) > MAX_ARENAS:
                del self.arenas[next(iter(self.arenas))]  # it goes when no process views it
            block = arena.carve(seg, size)
            assert block is not None  # (a fresh arena holds any block up to ARENA_ITEM_MAX)
            return seg, block, size


_arenas = _Arenas()


def _after_fork_in_child() -> None:
    global _arenas
    _arenas = _Arenas()  # the parent's arenas must not be carved twice (_shared Note [fork])


os.register_at_fork(after_in_child=_after_fork_in_child)


def _nbytes(shape, dtype) -> tuple[tuple, np.dtype, int]:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"arrays of dtype {dtype} hold Python objects and cannot live in shared memory")
    shape = (shape,) if np.isscalar(shape) else tuple(int(n) for n in shape)
    return shape, dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def empty_shared(shape: SupportsIndex | Sequence[SupportsIndex], dtype: DTypeLike = float,
                 order: Literal["C", "F"] = "C") -> NDArray[Any]:
    """A new uninitialised array in shared memory (like ``numpy.empty``)."""
    shape, dtype, nbytes = _nbytes(shape, dtype)
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    strides = None if order == "C" else _f_strides(shape, dtype.itemsize)
    got = _arenas.alloc(nbytes) if nbytes <= ARENA_ITEM_MAX else None
    if got is not None:
        seg, block, size = got
        _recycle.received(seg)  # the arena outlives its arrays while in use (_shared Note [arenas])
        return np.ndarray(shape, dtype, buffer=_shared.block_base(seg, block, size, counted=True), strides=strides)
    if nbytes >= _alloc.THRESHOLD and get_sharing_strategy() == "file_descriptor":
        # Born shared (_alloc Note [shared allocation]), in a recycled segment, already faulted in, that goes back
        # to the pool when numpy frees the array, as a shared_allocation() array's does. A new segment per array
        # instead faulted in fresh pages on every write of a batch pipeline (a third of the speed), and each
        # receiver kept one dead segment per batch mapped for a second (1.3 GiB in the run).
        with _alloc.shared_allocation():
            arr = np.empty(shape, dtype, order)
        if _shared.segment_of(arr) is not None:
            return arr
    # large, or no arena fits in memory: a segment of the array's own size (its error names what was asked)
    return _recycle.new_segment(nbytes).ndarray(shape, dtype, 0, strides)


def shared_copy(arr: np.ndarray) -> np.ndarray:
    """A new shared array (under the current strategy) holding a copy of ``arr``, its order kept."""
    out = empty_shared(arr.shape, arr.dtype, copy_order(arr))
    np.copyto(out, arr, casting="no")
    return out


def zeros_shared(shape: SupportsIndex | Sequence[SupportsIndex], dtype: DTypeLike = float,
                 order: Literal["C", "F"] = "C") -> NDArray[Any]:
    """A new zero-filled array in shared memory (like ``numpy.zeros``)."""
    arr = empty_shared(shape, dtype, order)
    arr.fill(0)
    return arr


def _f_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in shape:
        strides.append(step)
        step *= max(n, 1)
    return tuple(strides)


# Note [copies keep their order]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: a copy of an unshared array (into a message's segment, a shared copy, a transport's copy,
# share_memory's) has the memory order pickle gives the array: Fortran order where the array is Fortran-contiguous
# and not C-contiguous (numpy's reduction tells exactly those apart), C order for every other (a non-contiguous view
# arrives C-contiguous, as from pickle). So the receiver sees the stdlib's layout: ``ravel('K')``, ``tobytes('A')``
# and a buffer handed to Fortran code see the sender's data in the sender's order.
def copy_order(arr: np.ndarray) -> Literal["C", "F"]:
    """The order of ``arr``'s copy (Note [copies keep their order])."""
    return "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"


def copy_strides(arr: np.ndarray) -> tuple | None:
    """The strides of ``arr``'s copy: None for C order (Note [copies keep their order])."""
    return _f_strides(arr.shape, arr.itemsize) if copy_order(arr) == "F" else None


def share_memory(obj: _T) -> _T:
    """``obj`` with its arrays in shared memory: an array, or a dict / list / tuple of them (nested).

    Arrays already shared are kept as they are; all the others are copied,
    packed into one segment (one mapping, one descriptor however many arrays),
    which is how a model's parameters should be shared before starting workers.
    A dict or a list is updated in place (each unshared array in it replaced by
    its shared copy) and returned, so the originals go once nothing else holds
    them; a tuple or a lone array cannot be: a new one is returned, and the
    caller must drop its own reference to the original (``params =
    share_memory(params)``), or the program holds both copies.
    """
    todo: list[np.ndarray] = []
    _collect(obj, todo)
    if not todo:
        return obj
    offsets, total = {}, 0
    for a in todo:
        if id(a) not in offsets:
            offsets[id(a)], total = total, _shared.aligned(total + a.nbytes)
    seg = _recycle.new_segment(total)
    copies = {}
    for a in todo:
        if id(a) not in copies:
            dst = seg.ndarray(a.shape, a.dtype, offsets[id(a)], copy_strides(a))
            np.copyto(dst, a, casting="no")
            copies[id(a)] = dst
    return _rebuild(obj, copies)


# Module functions, not closures: a recursive closure is a reference cycle that would keep the copies (and
# so the segment) alive until the next garbage collection.
def _collect(o, todo: list) -> None:
    if type(o) is np.ndarray and not o.dtype.hasobject and _shared.segment_of(o) is None:
        todo.append(o)
    elif isinstance(o, dict):
        for v in o.values():
            _collect(v, todo)
    elif isinstance(o, (list, tuple)):
        for v in o:
            _collect(v, todo)


def _rebuild(o, copies: dict):
    """``o`` with ``copies`` in place of its arrays: dicts and lists updated in place, tuples new."""
    if type(o) is np.ndarray:
        return copies.get(id(o), o)
    if isinstance(o, dict):
        for k, v in o.items():
            o[k] = _rebuild(v, copies)  # (values replaced, no key added: the iteration holds)
        return o
    if isinstance(o, list):
        o[:] = [_rebuild(v, copies) for v in o]
        return o
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*(_rebuild(v, copies) for v in o))
    if isinstance(o, tuple):
        return type(o)(_rebuild(v, copies) for v in o)
    return o


@contextlib.contextmanager
def message_copies():
    """For a message that leaves by another transport (Dask's comms), under the file_system strategy:
    yields ``copy(arr)``, a shared copy of ``arr`` (its layout kept) for the message to carry as a handle
    (``reduce_ndarray``). A small one goes into an arena block; a large one into a recycled segment, back
    to the pool when the block ends and taken again once that message was received and its last view
    dropped (_recycle Note [recycling]). Pickle the message inside the block."""
    if get_sharing_strategy() != "file_system":
        raise RuntimeError("message_copies() makes named segments, which cross any transport: call "
                           "set_sharing_strategy('file_system') first")
    copies: list[shm_core.Segment] = []

    def copy(arr):
        if arr.nbytes <= ARENA_ITEM_MAX:
            out = empty_shared(arr.shape, arr.dtype, copy_order(arr))
        else:
            seg = _recycle.take(arr.nbytes, named=True)
            copies.append(seg)
            out = seg.ndarray(arr.shape, arr.dtype, 0, copy_strides(arr))
        np.copyto(out, arr, casting="no")
        return out

    try:
        yield copy
    finally:
        for seg in copies:
            _recycle.sent(seg)
