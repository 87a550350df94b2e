"""Messages over AF_UNIX SOCK_SEQPACKET sockets, descriptors in the same sendmsg.

A seqpacket socket delivers each message whole and atomically, to exactly one
reader, so several writers and several readers need no lock between them: a
process killed anywhere leaves no lock held and no half message behind.

Wire format of one message::

    b"P" + pickle                      the pickle inline (up to INLINE bytes), naming no shared memory
    b"H" + pickle                      the same, naming shared memory (handles)
    b"O" + b"P" or b"H"                the pickle and its out-of-band buffers are in a recycled segment, the
                                       last descriptor (_pickling Note [spills])
    b"S" + 8-byte length [+ 2-byte n]  the pickle is in a memfd, the last descriptor (in the last n, one
                                       after the other: _pickling Note [spilled pickles]), where shared memory is full

with the descriptors of the arrays' segments as SCM_RIGHTS in the same sendmsg
(a message that is one array alone has a header in place of the pickle: _bare).
A message may start with a ``head``, a small pickle of its own the receiver can
read before the rest (the Pool's task header); ``loads`` of such a message
returns the head alone.
"""

from __future__ import annotations

import collections
import errno
import os
import pickle
import re
import select
import socket
import struct

import numpy as np
import shm_core

from . import _nofile, _stats
from ._bare import BARE_KINDS, NOTHING, decode, encode
from ._message import MAX_FDS, Incoming, Outgoing, tls
from ._pickling import (
    INLINE,
    _close,
    _InSegment,
    _loads_spilled,
    _pickle,
    _pickle_inline,
    _spill,
    _spill_recycled,
    _unspill,
    spilled,
)

_MESSAGES_SENT, _MESSAGES_RECEIVED = _stats.MESSAGES_SENT, _stats.MESSAGES_RECEIVED
SPIN = int(os.environ.get("ARRAYMP_QUEUE_SPIN", "50"))  # see _queues Note [spin]
SOCKBUF = 1 << 20


# Note [blocking]
# ~~~~~~~~~~~~~~~
# Invariant: every socket of our channels is blocking (timeout None) in every process that holds it, whatever
# socket.setdefaulttimeout() says there; the timeouts a caller asks for (get(timeout=...), poll(t)) are poll()s,
# never socket timeouts.
#
# Why: socket.setdefaulttimeout() gives every Python socket made after it a timeout (a blocking get() would raise
# TimeoutError), and sets O_NONBLOCK on its descriptor: a flag of the open file, shared by every process that holds
# the socket. The stdlib's connections are bare descriptors and ignore that setting; ours ignore it too. Every socket
# made here is set blocking; one rebuilt from a descriptor another process sent is made with SOCK_NONBLOCK in its
# type, which Python takes as given without touching the file, then set blocking: a child under a default timeout
# never makes its parent's blocking reads fail.


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


# Note [plain messages]
# ~~~~~~~~~~~~~~~~~~~~~
# Invariant: a message that names no shared memory (most: a Pool's tasks and results, small arrays) goes as a
# ``plain`` Packet (kind b"P", no descriptor), its Outgoing makes no list (it has nothing to give back), and its
# pickle is made by the thread's reused pickler (_pickling Note [reused pickler]). A Pool batches plain tasks and
# frames plain results on a socket of their own (_pool Note [batches]).
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
            spill = _spill_recycled(out, payload)  # _pickling Note [spills]
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
        (_message Note [kept counts]); its receiver must ``loads`` it with ``kept=True``."""
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
        if spill is not None:  # _pickling Note [spills]
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


# Note [opening named segments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: a receiver unpickles a message that may name a named segment (file_system) only when HEADROOM
# descriptors can be opened; if they cannot, it keeps the message whole in ``pending`` (the channel's, in this
# process), raises OSError(EMFILE) with the remedy, and its next receive returns that message first.
#
# Why: unpickling a handle to a named segment opens its directory and its file (and, the first time, shm-manager's
# connection): descriptors the message did not bring. A message half-read would be lost (the counts it takes over
# cannot be taken twice). ``_NAMED`` is how pickle writes the first "n" of a named reference (_reductions): a message
# without it names no named segment (one with it may only hold the string "n": then the check is merely not needed).
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
