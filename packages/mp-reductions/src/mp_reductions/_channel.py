"""Messages over AF_UNIX SOCK_SEQPACKET sockets, descriptors in the same sendmsg.

A seqpacket socket delivers each message whole and atomically, to exactly one
reader, so several writers and several readers need no lock between them: a
process killed anywhere leaves no lock held and no half message behind.

Wire format of one message::

    b"P" + pickle                      the pickle inline (up to INLINE bytes), naming no shared memory
    b"H" + pickle                      the same, naming shared memory (handles)
    b"O" + b"P" or b"H"                the pickle and its out-of-band buffers are in a recycled segment, the
                                       last descriptor (Note [spills])
    b"S" + 8-byte length [+ 2-byte n]  the pickle is in a memfd, the last descriptor (in the last n, one
                                       after the other: Note [spilled pickles]), where shared memory is full

with the descriptors of the arrays' segments as SCM_RIGHTS in the same sendmsg
(a message that is one array alone has a header in place of the pickle: _bare).
A message may start with a ``head``, a small pickle of its own the receiver can
read before the rest (the Pool's task header); ``loads`` of such a message
returns the head alone.
"""

from __future__ import annotations

import collections
import copyreg
import errno
import os
import pickle
import re
import resource
import select
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import shm_core

from . import _byvalue, _nofile, _recycle, _shared, _stats
from ._bare import BARE_KINDS, NOTHING, decode, encode
from ._reductions import MAX_FDS, CopyMiss, Incoming, Outgoing, _received, tls

INLINE = 64 * 1024
_MESSAGES_SENT, _MESSAGES_RECEIVED = _stats.MESSAGES_SENT, _stats.MESSAGES_RECEIVED
SPIN = int(os.environ.get("ARRAYMP_QUEUE_SPIN", "50"))  # see _queues Note [spin]
SOCKBUF = 1 << 20


# Note [blocking]: socket.setdefaulttimeout() gives every Python socket made
# after it a timeout (a blocking get() would raise TimeoutError), and sets
# O_NONBLOCK on its descriptor: a flag of the open file, shared by every
# process that holds the socket. The stdlib's connections are bare descriptors
# and ignore that setting; ours ignore it too. Every socket made here is set
# blocking (timeout None); one rebuilt from a descriptor another process sent
# is made with SOCK_NONBLOCK in its type, which Python takes as given without
# touching the file, then set blocking: a child under a default timeout never
# makes its parent's blocking reads fail. The timeouts a caller asks for
# (get(timeout=...), poll(t)) are poll()s, never socket timeouts.


class _Socket(socket.socket):
    """A socket that closes without a ResourceWarning when it is garbage collected.

    Our Connection and Queue close their sockets when they are dropped; but in a
    reference cycle the collector may finalize the socket first. The stdlib's
    connections are bare descriptors, closed silently then; so are ours.
    """

    __slots__ = ()

    def __del__(self):
        self.close()


def socketpair(kind: int = socket.SOCK_SEQPACKET) -> tuple[socket.socket, socket.socket]:
    """A connected pair, blocking whatever the default timeout (Note [blocking])."""
    pair = [_Socket(socket.AF_UNIX, kind, 0, s.detach()) for s in socket.socketpair(socket.AF_UNIX, kind)]
    for s in pair:
        s.settimeout(None)
        if kind == socket.SOCK_SEQPACKET:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
    return pair[0], pair[1]


def wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether ``sock`` has something to read within ``timeout`` seconds (None: wait as long as it takes)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


def socket_from_fd(fd: int, kind: int) -> socket.socket:
    """The socket of a descriptor received from another process, blocking (Note [blocking])."""
    sock = _Socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK, 0, fileno=fd)
    sock.settimeout(None)
    return sock


class _Pickler(pickle.Pickler):
    """ForkingPickler's reducers over copyreg's, in a class attribute refreshed only
    when a registration changed (ForkingPickler copies this table for every message)."""

    dispatch_table: dict = {}
    _key = None

    @classmethod
    def refresh(cls) -> None:
        extra = ForkingPickler._extra_reducers
        key = (len(copyreg.dispatch_table), *extra.values())
        if key != cls._key:
            cls._key, cls.dispatch_table = key, {**copyreg.dispatch_table, **extra}

    def reducer_override(self, obj):
        """Functions and classes a receiver could not import, by value (_byvalue Note [by value])."""
        return _byvalue.reducer_override(obj)


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


# Note [reused pickler]: each thread keeps one _Pickler and its _Writer for the messages it pickles (making
# them costs more than pickling a small message), its memo cleared after every message (the memo holds the
# objects it pickled: arrays must not live on in it). A pickle made while the thread's own is in use (a
# reducer that sends a message of its own) gets a fresh pair; so does one after ForkingPickler's
# registrations changed. A pickle over FRESH_AFTER bytes retires the pair instead: the C pickler's memo table
# never shrinks, and clearing it writes all of it, so after one message of 200,000 objects every later message
# paid ~1.3 ms to clear it (a Pool worker's small results after a large one: 2x its CPU); a new pair costs ~1 us.
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
        exporter = buf.raw().obj
    except BufferError:  # not contiguous: in band, where pickle raises as the stdlib's does
        return True
    kind = type(exporter)
    if not (isinstance(exporter, np.ndarray) or (kind.__name__ == "Buffer" and kind.__module__.startswith("pyarrow"))):
        return True
    return tls.ctx.out_of_band(buf)


# Note [plain messages]: most messages name no shared memory (a Pool's tasks and results, small arrays):
# their Outgoing makes no list (it has nothing to give back), their pickle is made by the thread's reused
# pickler (Note [reused pickler]), and their Packet is ``plain``: kind b"P", no descriptor. A Pool batches
# plain tasks and frames plain results on a socket of their own (_pool Note [batches]).


# Note [spilled pickles]: a pickle over INLINE bytes goes in a memfd whose descriptor the message carries. A memfd
# obeys the file-size limit (RLIMIT_FSIZE, ``ulimit -f``), which a pipe does not: under such a limit the pickle is cut
# into as many memfds as it takes (each at the limit), their descriptors the message's last ones, and the receiver
# joins them; the stdlib's Queue sends any size down its pipe, and so must ours.
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


# Note [spills]: a message whose pickle is over INLINE bytes, or that hands out-of-band buffers (protocol 5's
# pickle.PickleBuffer: numpy's, pyarrow's, any type's whose __reduce_ex__(5) makes them) of the inline threshold
# or more, goes in one recycled segment (_recycle Note [recycling]: already faulted in on both sides), carried as
# the message's last descriptor::
#
#     | nbuf, table at, pickle at, pickle length | pickle (at SPILL_AT) | table: nbuf x (offset, length) |
#     | buffer 0 | buffer 1 | ...
#
# The sender pickles into it (_Writer: past INLINE bytes the pickle moves from its chunks of bytes into a segment) and
# copies each buffer into it once, then counts the message in the segment's views word; the
# receiver views the segment, gives the message's count back (unpack, _unspill), unpickles from the mapping
# where it lies (no copy into bytes) and hands pickle the buffers as views of the mapping: an object rebuilt
# over them (a numpy array, an Arrow buffer) holds the mapping, counted in the views word, so the segment
# goes back to its sender's pool only once every such object is gone; pickle makes read-only the buffers the
# sender's were. Every field is read from another process: a table that does not fit the segment, a negative
# count, or buffers that are not exactly those the pickle names are a SegmentError. Received, such a message
# is a memoryview of the segment (``spilled``), which ``loads`` tells apart from every other kind. Where
# shared memory is full, the buffers go in the pickle and the pickle in fresh memfds (Note [spilled pickles]).
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
        seg = _shared.attach_fd(fds.pop(), None, owned=True)
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


class Packet:
    """One pickled message ready to send: its buffers, descriptors and keep-alives.

    ``head``: the bytes of a pickle made already, sent before ``obj``'s (not with ``raw``). ``moves``: the ids of
    born-private arrays in ``obj`` that go as handles (_alloc Note [moving results]).
    """

    __slots__ = ("buffers", "fds", "keep", "out")

    def __init__(self, obj=None, *, raw: bytes | None = None, head: bytes = b"", moves: frozenset = frozenset(),
                 inputs: dict | None = None):
        bare = encode(obj) if raw is None and not head and type(obj) is np.ndarray else None
        if bare is not None:  # Note [bare arrays]
            payload, out = bare
        elif raw is None:
            out, payload = _pickle(obj, Outgoing(moves=moves, inputs=inputs), head)
        else:
            out, payload = NOTHING, raw
        if len(payload) > INLINE or out.buffers:
            spill = _spill_recycled(out, payload)  # Note [spills]
            if spill is not None:
                kind, self.out = spill
                self.fds, self.keep, self.buffers = self.out.fds, self.out.keep, [kind]
                return
            if out.buffers or type(payload) is _InSegment:  # shared memory is full: all in the pickle, in memfds
                out.abort()
                out, payload = _pickle_inline(obj, moves, head)
        self.out = out
        self.fds, self.keep = out.fds, out.keep
        if len(payload) <= INLINE:
            self.buffers = [b"H" if out.handles else b"P", payload]
        else:
            try:
                spills = _spill(payload, MAX_FDS + 1 - len(self.fds))
            except BaseException:
                out.abort()
                raise
            self.fds = [*self.fds, *(seg.fd for seg in spills)]
            self.keep = [*self.keep, *spills]
            self.buffers = [b"S" + len(payload).to_bytes(8, "little")
                            + (len(spills).to_bytes(2, "little") if len(spills) > 1 else b"")]

    @property
    def plain(self) -> bool:
        """Inline and naming no shared memory: no descriptor, nothing to give back (Note [plain messages])."""
        return self.buffers[0] == b"P"

    def send(self, sock: socket.socket, flags: int = 0, kept: bool = False) -> None:
        """``kept``: this process keeps the in-flight counts of the named segments it names until ``settle``
        (_reductions Note [kept counts]); its receiver must ``loads`` it with ``kept=True``."""
        shm_core.send_fds(sock, self.buffers, self.fds, flags)
        self.keep = None
        self.out.sent(kept)
        _stats.counts[_MESSAGES_SENT] += 1

    def settle(self) -> None:
        """Sent ``kept``, and done with: give back the counts kept."""
        self.out.settle()

    def send_nowait(self, sock: socket.socket) -> bool:
        """Send unless the socket is full (then False: nothing was sent)."""
        try:
            self.send(sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        return True

    def sent_along(self) -> None:
        """Sent inside another message's buffers (a Pool's batch of plain tasks, a short result): counted as
        that message's (``messages_sent``), its arrays now. Plain: nothing else to give back."""
        self.out.sent()

    def discard(self) -> None:
        """Never sent: give back what the message held."""
        self.out.abort()
        self.keep = None


# -- byte streams (Pipe): one writer and one reader per end, so no need for
# seqpacket's atomic messages; a stream socket wakes its peer faster.
_HEAD = struct.Struct("<QB")  # payload length, b"P" or b"H"


def send_stream(sock: socket.socket, obj=None, *, raw=None) -> None:
    """Send one framed message on a stream socket, the descriptors with its first byte."""
    bare = encode(obj) if raw is None and type(obj) is np.ndarray else None  # Note [bare arrays]
    if bare is not None:
        payload, out = bare
    else:
        out, payload = _pickle(obj, Outgoing()) if raw is None else (NOTHING, raw)
    kind = b"H" if out.handles else b"P"
    if len(payload) > INLINE or out.buffers:
        spill = _spill_recycled(out, payload)
        if spill is not None:  # Note [spills]
            kind, payload, out = spill[0][:1], spill[0][1:], spill[1]
        elif out.buffers or type(payload) is _InSegment:  # shared memory is full: all in the pickle
            out.abort()
            out, payload = _pickle_inline(obj, frozenset())
    head = _HEAD.pack(len(payload), kind[0])
    try:
        sent = shm_core.send_fds(sock, [head, payload], out.fds)
        if sent < len(head):  # a large message: the rest goes without descriptors
            sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(payload):
            sock.sendall(memoryview(payload)[sent - len(head):])
    except BaseException:  # (the peer gone, a signal): never received whole, so never rebuilt
        out.abort()
        raise
    out.sent()
    _stats.counts[_MESSAGES_SENT] += 1


def _recv_exactly(sock: socket.socket, n: int, first: bytes = b"") -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    view[: len(first)] = first
    got = len(first)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end of the connection closed in the middle of a message")
        got += k
    return buf


def recv_stream(sock: socket.socket) -> tuple[bytearray, list[int] | None]:
    """One framed message from a stream socket: its pickle and descriptors (None: a plain pickle)."""
    for _ in range(SPIN):  # see _queues Note [spin]
        try:
            head, fds, _ = recv_fds(sock, _HEAD.size, MAX_FDS, socket.MSG_DONTWAIT)
            break
        except BlockingIOError:
            os.sched_yield()
    else:
        head, fds, _ = recv_fds(sock, _HEAD.size, MAX_FDS)
    if not head:
        for fd in fds:
            os.close(fd)
        raise EOFError("the other end of the connection is closed")
    try:
        n, kind = _HEAD.unpack(_recv_exactly(sock, _HEAD.size, head))
        data = _recv_exactly(sock, n)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    _stats.counts[_MESSAGES_RECEIVED] += 1
    if kind == ord("O") and data in (b"H", b"P") and fds:
        return _unspill(data == b"H", fds)
    return data, (fds if kind == ord("H") else None)


def recv_raw(sock: socket.socket, flags: int = 0) -> tuple[bytes | memoryview, list[int]]:
    """One message's pickle bytes and its array descriptors (raises BlockingIOError, EOFError)."""
    return unpack(*dequeue(sock, flags))


def dequeue(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int]]:
    """Take one message off the socket, as sent (raises BlockingIOError, EOFError: then nothing was taken)."""
    data, fds, _ = recv_fds(sock, INLINE + 16, MAX_FDS + 1, flags)
    if not data:
        _close(fds)
        raise EOFError("the other end of the channel is closed")
    _stats.counts[_MESSAGES_RECEIVED] += 1
    return data, fds


def unpack(data: bytes, fds: list[int]) -> tuple[bytes | memoryview, list[int]]:
    """A dequeued message's pickle bytes and its array descriptors (None: a plain pickle). A message that
    fits no kind of the wire format comes from another process, forged or corrupted: SegmentError, its
    descriptors closed."""
    kind = data[:1]
    if kind == b"H":
        return memoryview(data)[1:], fds
    if kind == b"O" and data[1:] in (b"H", b"P") and fds:
        return _unspill(data[1:] == b"H", fds)
    if kind == b"S" and len(data) in (9, 11) and fds:
        n = int.from_bytes(data[1:9], "little")
        count = int.from_bytes(data[9:11], "little") if len(data) == 11 else 1
        if not 0 < count <= len(fds) or n < count:
            _close(fds)
            raise shm_core.SegmentError(f"message spilled {n} bytes into {count} of its {len(fds)} descriptors "
                                        "(forged or corrupted message)")
        try:
            parts = [shm_core.attach_fd(fd, expected_size=n if count == 1 else None) for fd in fds[-count:]]
            if sum(seg.size for seg in parts) != n:
                raise shm_core.SegmentError(f"spilled parts hold {sum(seg.size for seg in parts)} bytes, not the "
                                            f"message's {n} (forged or corrupted message)")
        except BaseException:
            _close(fds)
            raise
        _close(fds[-count:])
        data = b"".join(memoryview(seg) for seg in parts)
        for seg in parts:
            seg.close()
        return data, fds[:-count]
    _close(fds)  # a plain pickle names no descriptor
    if kind == b"P":
        return memoryview(data)[1:], None
    raise shm_core.SegmentError(f"message of kind {bytes(kind)!r} with {len(data)} bytes and {len(fds)} "
                                "descriptors fits no kind of arraymp's wire format (forged or corrupted message)")


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# Note [opening named segments]: unpickling a handle to a named segment (file_system)
# opens its directory and its file (and, the first time, shm-manager's connection):
# descriptors the message did not bring. A receiver without them must not lose the
# message half-read (the counts it takes over cannot be taken twice), so before
# unpickling a message that may name one, the receiver checks that HEADROOM
# descriptors can be opened; if not, it keeps the message whole in ``pending`` (the
# channel's, in this process), raises OSError(EMFILE) with the remedy, and its next
# receive returns that message first. ``_NAMED`` is how pickle writes the first "n" of
# a named reference (_reductions): a message without it names no named segment (one
# with it may only hold the string "n": then the check is merely not needed).
HEADROOM = 3
_NAMED = re.compile(re.escape(b"\x8c\x01n"))


def check_openable(data, fds: list[int] | None, fd: int) -> None:
    """Raise OSError(EMFILE) when the received message ``(data, fds)`` may name a named segment and this process
    could not open it now (Note [opening named segments]); ``fd``: any descriptor of ours, dup'ed to try."""
    if fds is not None and _names_named(data):
        _raising_nofile(shm_core.check_headroom, fd, HEADROOM, "the message is kept: the next receive returns it")


def recv_fds(sock: socket.socket, size: int, maxfds: int, flags: int = 0):
    """shm_core.recv_fds, the open-files limit raised before a message is refused for want of descriptors."""
    return _raising_nofile(shm_core.recv_fds, sock, size, maxfds, flags)


def _raising_nofile(call, *args):
    """``call(*args)``, once more after raising the open-files limit where it failed for want of descriptors
    (_nofile Note [open-files limit]: raised before refusing)."""
    try:
        return call(*args)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE) or not _nofile.raise_for_budget():
            raise
    return call(*args)


def _names_named(data) -> bool:
    # (a bare array names none; a search, not ``in``: a memoryview's ``in`` compares its items, never a substring)
    return not (data and data[0] in BARE_KINDS) and _NAMED.search(data) is not None


def loads_kept(msg: tuple, pending: collections.deque, sock: socket.socket):
    """``loads`` of a received message ``(data, fds)``, kept first in ``pending`` when it cannot be opened now."""
    data, fds = msg
    try:
        check_openable(data, fds, sock.fileno())
    except OSError:
        pending.appendleft(msg)
        raise
    return loads(data, fds)


def loads(data: bytes, fds: list[int] | None, kept: bool = False):
    """A received message's object; ``kept``: sent with ``Packet.send(kept=True)``."""
    if data and data[0] in BARE_KINDS:  # Note [bare arrays]
        return decode(data, fds)
    load = _loads_spilled if spilled(data) else pickle.loads
    if fds is None:
        return load(data)
    inc = Incoming(fds, kept)
    saved, tls.ctx = tls.ctx, inc
    try:
        return load(data)
    finally:
        tls.ctx = saved
        inc.close()
