"""How a message is pickled for our channels: the pickler (reused per thread), the context that collects what
the message names (_message.Outgoing), and the spill of a large pickle and its protocol-5 buffers into a
recycled segment (Note [spills]) or, where shared memory is full, into memfds (Note [spilled pickles]). The
sending and receiving of the bytes is _channel's; what an array's reduction writes is _reductions'.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import resource
import struct
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import shm_core

from . import _attach, _byvalue, _recycle, _shared, _stats
from ._bare import NOTHING
from ._message import CopyMiss, Outgoing, _received, tls
from ._strategy import get_inline_threshold

INLINE = 64 * 1024  # bytes of pickle a message carries in its own buffers; a larger one is spilled


def _reducer_override(obj):
    """The pickler's ``reducer_override``, which pickle calls for every object but the builtin scalars and
    containers, before it looks in the dispatch table: an array (the commonest object of a message: a dict of 50
    small ones cost 1.2x the stdlib's pickle) goes to the table's reducer from here, a lookup and a call fewer; a
    function or class a receiver could not import goes by value (_byvalue Note [by value])."""
    if type(obj) is np.ndarray:
        reduce = _Pickler.array_reducer
        if reduce is not None:
            return reduce(obj)
    return _byvalue.reducer_override(obj)


class _Pickler(pickle.Pickler):
    """ForkingPickler's reducers over copyreg's, in a class attribute refreshed only
    when a registration changed (ForkingPickler copies this table for every message)."""

    dispatch_table: dict = {}
    array_reducer = None  # the table's reducer of numpy arrays, which _reducer_override calls
    _key = None

    @classmethod
    def refresh(cls) -> None:
        extra = ForkingPickler._extra_reducers
        key = (len(copyreg.dispatch_table), *extra.values())
        if key != cls._key:
            cls._key, cls.dispatch_table = key, {**copyreg.dispatch_table, **extra}
            cls.array_reducer = cls.dispatch_table.get(np.ndarray)

    reducer_override = staticmethod(_reducer_override)  # (a function: no method frame around each call)


def _pickle(obj, out: Outgoing, head: bytes = b"") -> tuple[Outgoing, memoryview]:
    try:
        try:
            return _pickle_once(obj, out, head)
        except CopyMiss:  # the pooled copy segment was too small: once more, with a new one
            return _pickle_once(obj, Outgoing(pooled=False, moves=out.moves, inputs=out.inputs), head)
    except shm_core.SharedMemoryFullError as exc:
        # No room for the copies of the message's unshared arrays (all in one segment): they travel in the
        # pickle instead, as the stdlib sends them (a Pool's chunk of results each of which would fit, a small
        # /dev/shm); only making a shared array on purpose (empty_shared, share_memory) raises.
        _stats.note_full(exc)
        return _pickle_inline(obj, out.moves, head)


def _pickle_inline(obj, moves: frozenset, head: bytes = b"") -> tuple[Outgoing, memoryview]:
    """The message pickled with every array in the pickle (shared memory is full), and said once per process
    when one of them was meant for shared memory (_stats Note [sharing stopped]): before it is sent."""
    out, payload = _pickle_once(obj, Outgoing(copy_inline=True, moves=moves), head)
    if out.fallbacks:
        try:
            _stats.sharing_stopped(out.fallbacks, out.fallback_bytes, "full")
        except BaseException:  # (a filter made the warning an error: nothing is sent)
            out.abort()
            raise
    return out, payload


# Note [reused pickler]
# ~~~~~~~~~~~~~~~~~~~~~
# Invariant: each thread pickles its messages with one _Pickler and its _Writer, its memo cleared after every message
# (the memo holds the objects it pickled: arrays must not live on in it); a fresh pair is made for a pickle made
# while the thread's own is in use (a reducer that sends a message of its own) and after ForkingPickler's
# registrations changed, and a pickle over FRESH_AFTER bytes retires the pair.
#
# Why: making the pair costs more than pickling a small message. A large pickle retires it because the C pickler's
# memo table never shrinks, and clearing it writes all of it: after one message of 200,000 objects every later
# message paid ~1.3 ms to clear it (a Pool worker's small results after a large one: 2x its CPU); a new pair costs ~1
# us.
SPILL_AT = 64  # where a spill segment's pickle starts (Note [spills])
FRESH_AFTER = 4096  # bytes of pickle past which the thread's pickler is retired, not cleared (Note [reused pickler])


class _InSegment:
    """A pickle written into a spill segment at SPILL_AT: ``length`` bytes of ``seg`` (Note [spills])."""

    __slots__ = ("length", "seg")

    def __init__(self, seg: shm_core.Segment, length: int):
        self.seg, self.length = seg, length

    def __len__(self) -> int:
        return self.length


class _Writer:
    """The file a message is pickled into. Up to INLINE bytes it keeps what the pickler writes as it is (the pickler
    hands it a small message whole, as one bytes object, at the end); past them (unless ``spill`` is off: shared
    memory is full) it moves into a recycled segment, the pickle at SPILL_AT, and into a larger one when full. A
    pickle of megabytes is so written once, into memory already faulted in (_recycle Note [recycling]), never into
    fresh pages nor copied again (Note [spills])."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.size = 0
        self.seg = self.view = None
        self.pos = 0
        self.spill = True

    def reset(self, spill: bool) -> None:
        self.chunks, self.size, self.spill = [], 0, spill

    def write(self, data) -> int:
        if self.view is None:
            n = len(data) if type(data) is bytes else _bytes_view(data).nbytes
            if not self.spill or self.size + n <= INLINE:
                self.chunks.append(data if type(data) is bytes else bytes(_bytes_view(data)))  # (a bytes is kept)
                self.size += n
                return n
            self._move(self.size + n)
        m = _bytes_view(data)
        end = self.pos + m.nbytes
        if end > len(self.view):
            self._move(end - SPILL_AT)
        self.view[self.pos:end] = m
        self.pos = end
        return m.nbytes

    def written(self) -> int:
        """Bytes of pickle written since the reset."""
        return self.pos - SPILL_AT if self.view is not None else self.size

    def _move(self, need: int) -> None:
        """Into a segment of room for ``need`` bytes of pickle and more, what was written carried over."""
        written = self.written()
        seg = _recycle.take(SPILL_AT + max(2 * written, need + need // 8 + INLINE))
        view = memoryview(seg)
        if self.view is None:
            view[SPILL_AT:SPILL_AT + written] = b"".join(self.chunks)
            self.chunks = []
        else:
            view[SPILL_AT:SPILL_AT + written] = self.view[SPILL_AT:self.pos]
            self.abort()
        self.seg, self.view, self.pos = seg, view, SPILL_AT + written

    def abort(self) -> None:
        """The pickle failed: its segment back to the pool."""
        self.chunks = []
        if self.view is not None:
            self.view.release()
            _recycle.sent(self.seg)
            self.seg = self.view = None

    def payload(self) -> bytes | _InSegment:
        """What was written (and nothing kept of it)."""
        if self.view is None:
            chunks, self.chunks = self.chunks, []
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.view.release()
        spilled = _InSegment(self.seg, self.pos - SPILL_AT)
        self.seg = self.view = None
        return spilled


def _bytes_view(data) -> memoryview:
    m = memoryview(data)
    if m.format == "B" and m.ndim == 1:
        return m
    return data.raw() if isinstance(data, pickle.PickleBuffer) else m.cast("B")


class _Reused(threading.local):
    key = pickler = writer = None
    busy = False


_reused = _Reused()


def _pickle_once(obj, out: Outgoing, head: bytes) -> tuple[Outgoing, bytes | _InSegment]:
    _Pickler.refresh()
    r = _reused
    mine = not r.busy
    if not mine:
        writer = _Writer()
        pickler = _Pickler(writer, 5, buffer_callback=_out_of_band)
    else:
        if r.key is not _Pickler._key:
            r.writer = _Writer()
            r.pickler, r.key = _Pickler(r.writer, 5, buffer_callback=_out_of_band), _Pickler._key
        writer, pickler = r.writer, r.pickler
        r.busy = True
    writer.reset(spill=not out.copy_inline)
    saved, tls.ctx = tls.ctx, out
    try:
        if head:
            writer.write(head)
        pickler.dump(obj)
        out.finish()
    except BaseException:
        writer.abort()
        out.abort()
        raise
    finally:
        tls.ctx = saved
        if mine and writer.written() > FRESH_AFTER:
            r.key = r.pickler = None  # its memo goes with it
        else:
            pickler.clear_memo()
        if mine:
            r.busy = False
    return out, writer.payload()


# Note [buffer rebuilds]
# ~~~~~~~~~~~~~~~~~~~~~~
# Invariant: a protocol-5 buffer is rebuilt from the same type of object at every size: what pickle gives in band (a
# ``bytearray`` if the sender's buffer was writable, ``bytes`` if read-only), except the buffers of numpy arrays and
# pyarrow Buffers, which are rebuilt over the shared memory with no copy (a ``memoryview``, read-only where the
# sender's was) at every size past the inline threshold. A type's ``__reduce_ex__(5)`` hands its rebuild whatever
# the unpickler got; code that calls ``buf.extend``, ``buf.decode``, ``hash(buf)`` or checks ``isinstance(buf,
# bytearray)`` works on small data as the stdlib gives it, and must not break on large (it did: out of band, past
# 64 KiB, it got a memoryview). numpy's and pyarrow's rebuilds take any buffer, which is where zero copies pay:
# pandas frames are numpy and pyarrow buffers underneath. The others go in band: their bytes are written into the
# message's pickle, spilled into a recycled segment when it is large (Note [spills]), one copy on each side as the
# stdlib makes, by shared memory.
def _out_of_band(buf) -> bool:
    """The pickler's ``buffer_callback`` (Note [buffer rebuilds])."""
    try:
        raw = buf.raw()
    except BufferError:  # not contiguous: in band, where pickle raises as the stdlib's does
        return True
    if raw.nbytes < get_inline_threshold():
        return True  # small: in band whatever its type
    exporter = raw.obj
    kind = type(exporter)
    if not (isinstance(exporter, np.ndarray) or (kind.__name__ == "Buffer" and kind.__module__.startswith("pyarrow"))):
        return True
    return tls.ctx.out_of_band(buf, raw)


# Note [spilled pickles]
# ~~~~~~~~~~~~~~~~~~~~~~
# Invariant: a pickle of any size goes, as the stdlib's Queue sends any size down its pipe: one over INLINE bytes
# goes in a memfd whose descriptor the message carries, and under a file-size limit (RLIMIT_FSIZE, ``ulimit -f``,
# which a memfd obeys and a pipe does not) in as many memfds as it takes (each at the limit), their descriptors the
# message's last ones, joined by the receiver.
def _spill(payload, room: int) -> list[shm_core.Segment]:
    """Segments holding ``payload`` one after the other: one, or under a file-size limit as many as it takes (at
    most ``room``)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    n = len(payload)
    per = n if limit == resource.RLIM_INFINITY else min(n, (limit - shm_core.HEADER_SIZE) // 4096 * 4096)
    count = -(-n // per) if per > 0 else room + 1
    if count > room or count > 0xFFFF:  # the limit is too small for the parts a message can carry
        raise shm_core.SharedMemoryFullError("memfd (anonymous shared memory)", n, None, fsize=limit)
    spills = []
    for start in range(0, n, per):
        seg = shm_core.create_anonymous(min(per, n - start))
        _stats.counts[_stats.SEGMENTS_MADE] += 1
        memoryview(seg)[:] = memoryview(payload)[start:start + per]
        spills.append(seg)
    return spills


# Note [spills]
# ~~~~~~~~~~~~~
# Invariant: a message whose pickle is over INLINE bytes, or that hands out-of-band buffers (protocol 5's
# pickle.PickleBuffer: numpy's, pyarrow's, any whose __reduce_ex__(5) makes them) of the inline threshold or more,
# goes in one recycled segment (_recycle Note [recycling]: already faulted in on both sides), carried as the
# message's last descriptor; the segment goes back to its sender's pool only once every object rebuilt over it is
# gone::
#
#     | nbuf, table at, pickle at, pickle length | pickle (at SPILL_AT) | table: nbuf x (offset, length) |
#     | buffer 0 | buffer 1 | ...
#
# The sender pickles into it (_Writer: past INLINE bytes the pickle moves from chunks of bytes into a segment) and
# copies each buffer into it once, then counts the message in the segment's views word. The receiver views the
# segment, gives the message's count back (unpack, _unspill), unpickles from the mapping (no copy into bytes) and
# hands pickle the buffers as views of the mapping: an object rebuilt over them (a numpy array, an Arrow buffer)
# holds the mapping, counted in the views word; pickle makes read-only the buffers the sender's were. Every field is
# read from another process: a table that does not fit the segment, a negative count, or buffers that are not exactly
# those the pickle names are a SegmentError. Received, it is a memoryview of the segment (``spilled``), which
# ``loads`` tells apart. Where shared memory is full, the buffers go in the pickle and the pickle in fresh memfds
# (Note [spilled pickles]).
_SPILL = struct.Struct("<qqqq")  # out-of-band buffers, the table's offset, the pickle's offset and length
_ENTRY = struct.Struct("<qq")  # a buffer's offset and length


def _spill_recycled(out: Outgoing, payload) -> tuple[bytes, Outgoing] | None:
    """Lay out the spill of ``payload`` (bytes, or an _InSegment: the pickle written into its segment already) and
    ``out``'s buffers in a recycled segment that ``out`` (a new one for NOTHING) carries; the message's kind bytes
    and its Outgoing, or None where shared memory is full."""
    raws = [buf.raw() for buf in out.buffers]
    length = len(payload)
    table = _shared.aligned(SPILL_AT + length)
    entries, end = [], _shared.aligned(table + _ENTRY.size * len(raws))
    for raw in raws:
        entries.append((end, raw.nbytes))
        end = _shared.aligned(end + raw.nbytes)
    seg = payload.seg if type(payload) is _InSegment else None
    if seg is None or seg.size < end:
        try:
            new = _recycle.take(end)
        except shm_core.SharedMemoryFullError as exc:
            _stats.note_full(exc)
            if seg is not None:
                _recycle.sent(seg)
            return None
        except BaseException:
            if seg is not None:
                _recycle.sent(seg)
            out.abort()
            raise
        with memoryview(new) as view:
            if seg is None:
                view[SPILL_AT:SPILL_AT + length] = payload
            else:
                with memoryview(seg) as old:
                    view[SPILL_AT:SPILL_AT + length] = old[SPILL_AT:SPILL_AT + length]
                _recycle.sent(seg)
        seg = new
    try:
        with memoryview(seg) as view:
            _SPILL.pack_into(view, 0, len(raws), table, SPILL_AT, length)
            for i, ((offset, n), raw) in enumerate(zip(entries, raws, strict=True)):
                _ENTRY.pack_into(view, table + i * _ENTRY.size, offset, n)
                view[offset:offset + n] = raw
        if out is NOTHING:
            out = Outgoing()
        kind = b"OH" if out.handles else b"OP"
        out.spill(seg)
    except BaseException:
        _recycle.sent(seg)
        out.abort()
        raise
    return kind, out


def _unspill(handles: bool, fds: list[int]) -> tuple[memoryview, list[int] | None]:
    """The pickle of a spilled message (a view of its segment, the last of ``fds``) and its other descriptors."""
    try:
        seg = _attach.attach_fd(fds.pop(), None, owned=True)
        view = memoryview(seg)
        nbuf, table, at, length = _SPILL.unpack_from(view) if len(view) >= _SPILL.size else (-1, 0, 0, 0)
        if not (0 <= nbuf and _SPILL.size <= table and _ENTRY.size * nbuf <= len(view) - table
                and _SPILL.size <= at and 0 < length <= len(view) - at):
            raise shm_core.SegmentError(f"spilled message says {nbuf} buffers listed at {table} and a pickle of "
                                        f"{length} bytes at {at} of a {len(view)}-byte segment (forged or corrupted "
                                        "message)")
    except BaseException:
        _close(fds)
        raise
    _received(seg)  # (a refused one is not kept)
    seg.fetch_add(_recycle.REFS, -1)  # the message's count, now that we view it (Note [spills])
    if not handles:
        _close(fds)
    return view[at:at + length], fds if handles else None


def spilled(data) -> bool:
    """``data`` (a received message's pickle) lies in a spill segment (Note [spills])."""
    return type(data) is memoryview and type(data.obj) is shm_core.Segment


def _loads_spilled(data: memoryview):
    """Unpickle a spilled message, its out-of-band buffers views of the mapping (Note [spills])."""
    view = memoryview(data.obj)
    nbuf, table = _SPILL.unpack_from(view)[:2]  # (read again: checked by _unspill, but the sender may write)
    if not (0 <= nbuf and _SPILL.size <= table and _ENTRY.size * nbuf <= len(view) - table):
        raise shm_core.SegmentError(f"spilled message says {nbuf} buffers listed at {table} (forged or corrupted "
                                    "message)")
    buffers = []
    for i in range(nbuf):
        offset, n = _ENTRY.unpack_from(view, table + i * _ENTRY.size)
        if not (0 <= offset and 0 <= n <= len(view) - offset):
            raise shm_core.SegmentError(f"out-of-band buffer {i} of {n} bytes at {offset} is not inside the "
                                        f"{len(view)}-byte segment (forged or corrupted message)")
        buffers.append(view[offset:offset + n])
    used = [0]

    def handed():
        for buf in buffers:
            used[0] += 1
            yield buf
        raise shm_core.SegmentError(f"the pickle names more out-of-band buffers than the {nbuf} its message "
                                    "carries (forged or corrupted message)")

    obj = pickle.loads(data, buffers=handed())
    if used[0] != nbuf:
        raise shm_core.SegmentError(f"the pickle names {used[0]} out-of-band buffers, its message carries {nbuf} "
                                    "(forged or corrupted message)")
    return obj


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
