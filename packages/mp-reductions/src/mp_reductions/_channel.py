"""Messages over AF_UNIX SOCK_SEQPACKET sockets, descriptors in the same sendmsg.

A seqpacket socket delivers each message whole and atomically, to exactly one
reader, so several writers and several readers need no lock between them: a
process killed anywhere leaves no lock held and no half message behind.

Wire format of one message::

    b"P" + pickle                      the pickle inline (up to INLINE bytes), naming no shared memory
    b"H" + pickle                      the same, naming shared memory (handles)
    b"S" + 8-byte length [+ 2-byte n]  the pickle is in a memfd, the last descriptor (in the last n, one
                                       after the other: Note [spilled pickles])

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
import io
import os
import pickle
import resource
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import shm_core

from . import _nofile
from ._bare import BARE_KINDS, NOTHING, decode, encode
from ._reductions import MAX_FDS, CopyMiss, Incoming, Outgoing, tls

INLINE = 64 * 1024
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


def _pickle(obj, out: Outgoing, head: bytes = b"") -> tuple[Outgoing, memoryview]:
    try:
        try:
            return _pickle_once(obj, out, head)
        except CopyMiss:  # the pooled copy segment was too small: once more, with a new one
            return _pickle_once(obj, Outgoing(out.share_all, pooled=False, moves=out.moves), head)
    except shm_core.SharedMemoryFullError:
        # No room for the copies of the message's unshared arrays (all in one segment): they travel in the
        # pickle instead, as the stdlib sends them (a Pool's chunk of results each of which would fit, a small
        # /dev/shm); only making a shared array on purpose (empty_shared, share_memory) raises.
        return _pickle_once(obj, Outgoing(copy_inline=True, moves=out.moves), head)


# Note [reused pickler]: each thread keeps one _Pickler and its BytesIO for the messages it pickles (making
# them costs more than pickling a small message), its memo cleared after every message (the memo holds the
# objects it pickled: arrays must not live on in it). A pickle made while the thread's own is in use (a
# reducer that sends a message of its own) gets a fresh pair; so does one after ForkingPickler's
# registrations changed. A buffer grown past _REUSE_MAX is dropped with its message.
_REUSE_MAX = 1 << 20


class _Reused(threading.local):
    key = pickler = buf = None
    busy = False


_reused = _Reused()


def _pickle_once(obj, out: Outgoing, head: bytes) -> tuple[Outgoing, bytes | memoryview]:
    _Pickler.refresh()
    r = _reused
    mine = not r.busy
    if not mine:
        buf = io.BytesIO()
        pickler = _Pickler(buf, 4)
    else:
        if r.key is not _Pickler._key:
            r.buf = io.BytesIO()
            r.pickler, r.key = _Pickler(r.buf, 4), _Pickler._key
        buf, pickler = r.buf, r.pickler
        buf.seek(0)
        buf.truncate()
        r.busy = True
    buf.write(head)
    saved, tls.ctx = tls.ctx, out
    try:
        pickler.dump(obj)
        out.finish()
    except BaseException:
        out.abort()
        raise
    finally:
        tls.ctx = saved
        pickler.clear_memo()
        if mine:
            r.busy = False
    if not mine or buf.tell() > _REUSE_MAX:  # a buffer that goes with its message: no copy
        if mine:
            r.key = None  # a new pair next time
        return out, buf.getbuffer()
    return out, buf.getvalue()


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
        memoryview(seg)[:] = memoryview(payload)[start:start + per]
        spills.append(seg)
    return spills


class Packet:
    """One pickled message ready to send: its buffers, descriptors and keep-alives.

    ``head``: the bytes of a pickle made already, sent before ``obj``'s (not with ``raw``). ``moves``: the ids of
    born-private arrays in ``obj`` that go as handles (_alloc Note [moving results]).
    """

    __slots__ = ("buffers", "fds", "keep", "out")

    def __init__(self, obj=None, *, raw: bytes | None = None, head: bytes = b"", moves: frozenset = frozenset()):
        bare = encode(obj) if raw is None and not head and type(obj) is np.ndarray else None
        if bare is not None:  # Note [bare arrays]
            payload, out = bare
        elif raw is None:
            out, payload = _pickle(obj, Outgoing(moves=moves), head)
            if len(payload) > INLINE and out.inlined and not out.copy_inline:
                # Too big for one socket message: rather than spill the whole
                # pickle, send its small arrays by shared memory too.
                out.abort()
                out, payload = _pickle(obj, Outgoing(share_all=True, moves=moves), head)
        else:
            out, payload = NOTHING, raw
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

    def send(self, sock: socket.socket, flags: int = 0) -> None:
        shm_core.send_fds(sock, self.buffers, self.fds, flags)
        self.keep = None
        self.out.sent()

    def send_nowait(self, sock: socket.socket) -> bool:
        """Send unless the socket is full (then False: nothing was sent)."""
        try:
            self.send(sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        return True

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
    head = _HEAD.pack(len(payload), ord("H" if out.handles else "P"))
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
    return data, fds


def unpack(data: bytes, fds: list[int]) -> tuple[bytes | memoryview, list[int]]:
    """A dequeued message's pickle bytes and its array descriptors (None: a plain pickle). A message that
    fits no kind of the wire format comes from another process, forged or corrupted: SegmentError, its
    descriptors closed."""
    kind = data[:1]
    if kind == b"H":
        return memoryview(data)[1:], fds
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
_NAMED = b"\x8c\x01n"


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
    # (a bare array names none; the bytes under a view: a memoryview's ``in`` compares its items, never a substring)
    return not (data and data[0] in BARE_KINDS) and _NAMED in (data.obj if isinstance(data, memoryview) else data)


def loads_kept(msg: tuple, pending: collections.deque, sock: socket.socket):
    """``loads`` of a received message ``(data, fds)``, kept first in ``pending`` when it cannot be opened now."""
    data, fds = msg
    try:
        check_openable(data, fds, sock.fileno())
    except OSError:
        pending.appendleft(msg)
        raise
    return loads(data, fds)


def loads(data: bytes, fds: list[int] | None):
    if data and data[0] in BARE_KINDS:  # Note [bare arrays]
        return decode(data, fds)
    if fds is None:
        return pickle.loads(data)
    inc = Incoming(fds)
    saved, tls.ctx = tls.ctx, inc
    try:
        return pickle.loads(data)
    finally:
        tls.ctx = saved
        inc.close()
