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

import importlib.util
import os
import weakref
from multiprocessing import context as mp_context
from multiprocessing import reduction, resource_sharer  # noqa: F401

# resource_sharer is imported here, not lazily by DupFd: an import running in a
# queue's feeder thread while another thread forks leaves its module lock held
# in the child, which then deadlocks on its first import of that module.
import numpy as np
import shm_core
import shm_manager

from . import _alloc, _arrays, _attach, _recycle, _shared, _stats
from ._byvalue import reduce_process
from ._handles import check_extent, check_fields, too_big
from ._message import Incoming, Outgoing, _received, tls
from ._strategy import get_inline_threshold, get_sharing_strategy


def _dtype(dt: np.dtype):
    """A dtype as its short string where that names it exactly (cheaper to pickle), else itself."""
    return dt.str if dt.names is None and dt.subdtype is None and dt.metadata is None else dt


def _readonly(arr: np.ndarray) -> bool:
    return not arr.flags.writeable


def reduce_ndarray(arr: np.ndarray, own: bool = False):
    """The reduction of a numpy array (registered for ``numpy.ndarray`` itself). ``own``: ``arr`` is a copy made for
    this message (a transport's: ``message_copies``), its receiver's own (_shared Note [own arrays])."""
    ctx = tls.ctx
    n = arr.nbytes
    if type(ctx) is Outgoing and arr.base is None and n < get_inline_threshold() \
            and (n < _alloc.THRESHOLD or not _shared.owned) and not arr.dtype.hasobject:
        ctx.arrays += 1
        ctx.arrays_inline += 1
        ctx.bytes_inline += n
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
        # small, or shared memory is full (_pickling._pickle), or on a channel we do not own whose sender may be
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
        if outgoing:  # the call's shared copy (counted as copied when made: input_copy), named by a handle
            ctx.arrays += 1
            ctx.n_handles += 1
        else:
            c = _stats.counts
            c[_stats.ARRAYS_COPIED] += 1
            c[_stats.BYTES_COPIED] += arr.nbytes
        arr = shared
        found = _shared.segment_of(arr)
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
    if arr.dtype.isnative and arr.flags.writeable:  # numpy's own, as the stdlib sends it (Note [small arrays])
        return arr.__reduce__()
    order = _arrays.copy_order(arr)
    return rebuild_inline, (arr.tobytes(order), _dtype(arr.dtype), arr.shape, order, _readonly(arr))


# Note [small arrays]
# ~~~~~~~~~~~~~~~~~~~
# Invariant: a small array travels in the pickle, every one of a message: a writable one in native byte order by
# numpy's own reduction, as the stdlib sends it, any other by rebuild_inline (its bytes, its dtype's string, byte
# order and read-only flag kept). On our channels one that owns its data (no base) skips the search for a segment
# (segment_of, and the walk of _alloc Note [moving results], which leaves it out) when the process has no shared
# allocation (``_shared.owned`` empty) or it is under _alloc's THRESHOLD (the shared handler holds no allocation
# under it: its realloc moves data by size).
#
# Measured: numpy's rebuild is C: a chunk of 250 small results loaded in 196 us, against 603 us through
# rebuild_inline. A message of a thousand small arrays is pickled once, at about the cost of the stdlib's pickle of
# it (it was pickled a second time, each of them put in shared memory, when its pickle passed INLINE bytes: it is
# spilled now, Note [spills]). A worker keeping one born-private array alive sent every small array the slow way: a
# Pool.map of dicts of 50 small arrays ran 1.3x the stdlib's.
def rebuild_inline(data: bytes, dtype, shape, order: str, readonly: bool) -> np.ndarray:
    """Rebuild a small array sent inside the pickle, byte order and read-only flag kept (numpy's own
    protocol-4 reduction, which the stdlib uses, loses both)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise shm_core.SegmentError(f"inline array of dtype {dtype} holds Python objects (forged message)")
    if dtype.itemsize == 0:  # np.dtype("V0"): no bytes whatever the shape (frombuffer refuses the dtype); an
        # unsized "U" or "S" names no array's dtype (numpy makes them 1 character long, with memory for each)
        if dtype.kind != "V" or len(data) or too_big(shape, 0):
            raise shm_core.SegmentError(f"inline array of dtype {dtype} with {len(data)} bytes and shape "
                                        f"{tuple(shape)!r:.80} (forged message)")
        arr = np.empty(shape, dtype, order=order)
    else:  # read-only: a view of ``data``, which may be a writable buffer (a Pipe's)
        arr = np.frombuffer(data if readonly else bytearray(data), dtype).reshape(shape, order=order)
    if readonly:
        arr.flags.writeable = False
    return arr


# Note [channels we do not own]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: outside our channels (no Outgoing context) under the file_descriptor strategy, every array travels as a
# copy in the pickle, exactly as the stdlib sends it (shared ones too: losing an array is worse than losing the
# sharing), but in the arguments of a process being launched; named segments (file_system) travel by name on every
# channel.
#
# Why: there a memfd segment's descriptor can travel only by ``multiprocessing.reduction.DupFd``. While a process is
# being launched (Process arguments under spawn and forkserver: ``mp.spawn``, Pool and executor ``initargs``) the
# launcher passes it with the child's other descriptors, so the child gets it whatever the parent does next; we hand
# the launcher a dup, open until the Popen object goes, since the argument's segment (a copy made just for the
# pickle) may be gone before the launch. Anywhere else (the stdlib's Queue and Pipe, Manager proxies) DupFd's
# resource sharer serves the descriptor from a thread of the sender, which may have exited by the time the receiver
# asks. A named segment's in-flight count keeps it for the receiver whoever exits first. Under file_system, an array
# in a memfd segment (received, born shared, made before the strategy was set) is copied as an unshared one is: into
# a named segment, or inline when small.
def _launch_fd(popen, seg: shm_core.Segment):
    """A DupFd of ``seg`` for the child ``popen`` launches: one per segment (the spawn launcher rejects a
    descriptor passed twice), a dup kept open until ``popen`` goes (Note [channels we do not own])."""
    table = popen.__dict__.get("_arraymp_dupfds")
    if table is None:
        table = popen._arraymp_dupfds = {}
        weakref.finalize(popen, _close_dups, table)
    entry = table.get(seg.key)
    if entry is None:
        fd = _attach.fd_for_sending(seg, dup=True)
        entry = table[seg.key] = (fd, reduction.DupFd(fd))
    return entry[1]


def _close_dups(table: dict) -> None:
    for fd, _ in table.values():
        os.close(fd)


def _named_ref_alone(seg):
    if tls.held is None and tls.to is not None and shm_manager.send_to(tls.to, seg.name, seg.dir, seg.incref):
        return ("n", seg.name, seg.dir, os.getpid())  # in flight, told (tell_counts: Note [results told])
    seg.incref()  # in flight; the receiver takes it over, unless this process keeps it (keep_counts)
    if tls.held is not None:
        tls.held.append(seg)
    return ("n", seg.name, seg.dir)


def _counted(seg: shm_core.Segment, ref: tuple) -> tuple:
    """``ref``, with one in-flight count of ``seg`` for this array (a message outside our channels)."""
    seg.fetch_add(_recycle.REFS, 1)
    return ref


def _segment_for(ref, size: int) -> shm_core.Segment:
    kind = ref[0] if type(ref) is tuple and ref else None
    if kind in ("m", "c") and len(ref) == 2 and type(ref[1]) is int:
        ctx = tls.ctx
        if not isinstance(ctx, Incoming):
            raise shm_core.SegmentError("a message-descriptor handle was unpickled outside an arraymp channel")
        return ctx.segment(ref[1], size)
    if kind == "d" and len(ref) == 2 and callable(getattr(ref[1], "detach", None)):
        fd = ref[1].detach()
        if type(fd) is not int or fd < 0:
            raise shm_core.SegmentError(f"array handle's DupFd gave {fd!r:.80}, not a descriptor (forged handle)")
        return _received(_attach.attach_fd(fd, size, owned=True))
    if kind == "n" and len(ref) in (3, 4) and type(ref[1]) is str and type(ref[2]) is str and \
            (len(ref) == 3 or (type(ref[3]) is int and 0 < ref[3] < 1 << 31)):
        # shm_core.attach checks the name, and that the directory is this process's (Note [untrusted handles]);
        # a sender (Note [results told]) forged or wrong takes a count it never owned, as a forged name does
        sender = ref[3] if len(ref) == 4 else None
        ctx = tls.ctx
        if isinstance(ctx, Incoming):
            return ctx.named(ref[1], ref[2], size, sender)
        return _received(_attach.attach_named(ref[1], ref[2], size, not tls.kept, sender, borrowed=tls.borrowed))
    raise shm_core.SegmentError(f"unknown segment reference {ref!r:.80} (forged or corrupted handle)")


def rebuild_own(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """Rebuild an array its sender copied into shared memory for the message, or moved: a view of the segment, as
    this process's own (_shared Note [own arrays])."""
    return _shared.own(rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block))


def rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """Rebuild a shared array: a view of the segment ``ref`` names (of its arena block ``block``, if any)."""
    seg = _segment_for(ref, size)  # first: a refused handle's descriptor or named count is taken over too
    dtype, strides = check_fields(size, offset, shape, strides, dtype, readonly)
    if block is None:
        if _shared.is_arena(seg):
            raise shm_core.SegmentError("array handle names an arena without its block (forged or corrupted handle)")
        check_extent(seg.size, offset, shape, strides, dtype.itemsize)
        arr = seg.ndarray(shape, dtype, offset, strides, readonly=readonly)
    else:
        base = _shared.block_view(seg, block)  # counts this process's view of the block, once
        offset -= block + _shared.BLOCK_HEAD
        check_extent(base.nbytes, offset, shape, strides, dtype.itemsize)
        arr = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)
        if readonly:
            arr.flags.writeable = False
        seg.fetch_add(shm_core.HEADER_SIZE + block, -1)  # the message's count, now that we view it
    ctx = tls.ctx
    if isinstance(ctx, Incoming) and ref[0] != "d":
        ctx.viewed(ref[:2], seg)  # once per segment per message, as the sender counted
    else:
        seg.fetch_add(_recycle.REFS, -1)  # counted per array by the reducer (_counted)
    return arr


# Note [inputs once per call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: an unshared array that several tasks of one map-like Pool call take is copied into shared memory at most
# twice in that call, whatever the number of tasks, and each task still gets its own private copy: a task that writes
# its input never changes another's.
#
# Why: such a call (``partial(f, big)``, ``starmap`` of ``(big, i)`` pairs) copied it into a new segment per task: a
# 256 MiB input cost a copy per task and a segment per task in flight.
#
# How: the Pool gives one call's (job's) messages one ``inputs`` table, id -> [weak reference to the array, its shared
# copy]. An array's first message copies it (its task views that segment); its second makes one shared copy
# (``shared_copy``: a recycled segment) that it and every later message of the call name, each task rebuilding its own
# copy from it (``rebuild_own_copy``). A new array reusing a dead one's id is a new entry (the reference is weak). The
# table goes when the call's result is complete (its _Cache entry goes); the shared copy's segment goes back to the
# recycling pool once the last task's view is gone. Only map-like calls have a table; the executor's ``map`` (a call per
# chunk) shares one among its calls, found by their chunk function (executor._Call). ``stats()`` counts the shared copy
# once, when made.
#
# Not covered: a caller who changes the array while the call runs: the stdlib's tasks pickled later see the change, ours
# after the first two do not.
def rebuild_own_copy(ref, size, offset, shape, strides, dtype, readonly, block=None):
    """An input a Pool call shares once for all its tasks (Note [inputs once per call]): this task's own copy."""
    view = rebuild_ndarray(ref, size, offset, shape, strides, dtype, readonly, block)
    arr = view.copy(order="K")
    if readonly:
        arr.flags.writeable = False
    return arr


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
