"""``Pipe()``: a pair of connections over a stream socketpair (adapts multiprocessing/connection.py).

Same API as the stdlib's ``Connection``; ``send`` carries the arrays'
descriptors in the same sendmsg, so the receiver gets shared memory, not copies.
Our Connection subclasses the stdlib's and overrides each of its public
methods, so ``isinstance(end, multiprocessing.connection.Connection)`` holds.
The stdlib's class is no ABC (it cannot ``register`` a virtual subclass), and a
``__class__`` that lies would make pickling rebuild the stdlib's class; a real
subclass has neither problem, and reducers keyed by exact type (the
ForkingPickler's registry) still pick our ``__reduce__``. ``fileno()`` lets
``multiprocessing.connection.wait`` and ``select`` wait on it.
"""

from __future__ import annotations

import collections
import os
import socket
from multiprocessing import connection as mp_connection
from multiprocessing import reduction, util
from typing import Any, Generic, TypeVar

from ._channel import Packet, loads_kept, recv_raw, recv_stream, send_stream, socket_from_fd, socketpair, wait_readable
from ._reductions import init_reductions

_SendT_contra = TypeVar("_SendT_contra", contravariant=True)
_RecvT_co = TypeVar("_RecvT_co", covariant=True)


class Connection(mp_connection.Connection, Generic[_SendT_contra, _RecvT_co]):
    """One end of a ``Pipe`` (a stream socket), or of a SimpleQueue (a seqpacket one); as the stdlib's, generic
    over what it sends and receives for a type checker: ``Connection[Request, Reply]``."""

    _sock: socket.socket = None  # type: ignore[assignment]  # None once closed: _check() raises

    def __init__(self, sock: socket.socket, readable: bool = True, writable: bool = True) -> None:
        if not readable and not writable:
            raise ValueError("at least one of `readable` and `writable` must be True")
        self._sock, self._readable, self._writable = sock, readable, writable
        # taken but not opened yet (_channel Note [opening named segments])
        self._pending: collections.deque[Any] = collections.deque()
        if sock.type == socket.SOCK_STREAM:
            self._send, self._recv = self._send_stream, self._recv_stream  # type: ignore[method-assign]

    def _send(self, obj=None, raw=None) -> None:
        Packet(obj, raw=raw).send(self._sock)

    def _recv(self):
        return recv_raw(self._sock)

    def _send_stream(self, obj=None, raw=None) -> None:
        send_stream(self._sock, obj, raw=raw)

    def _recv_stream(self):
        return recv_stream(self._sock)

    def _check(self, readable: bool = False, writable: bool = False) -> None:
        if self._sock is None:
            raise OSError("handle is closed")
        if readable and not self._readable:
            raise OSError("connection is write-only")
        if writable and not self._writable:
            raise OSError("connection is read-only")

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def fileno(self) -> int:
        self._check()
        return self._sock.fileno()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None  # type: ignore[assignment]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def send(self, obj: _SendT_contra) -> None:
        self._check(writable=True)
        self._send(obj)

    def recv(self) -> _RecvT_co:
        self._check(readable=True)
        msg = self._next()
        try:
            return loads_kept(msg, self._pending, self._sock)
        except OSError:
            if self._pending:  # kept: a fork child must not return it too
                util.register_after_fork(self, Connection._drop_pending)
            raise

    def _next(self):
        return self._pending.popleft() if self._pending else self._recv()

    def _drop_pending(self) -> None:
        while self._pending:
            _close_all(self._pending.popleft()[1])

    def send_bytes(self, buf, offset: int = 0, size: int | None = None) -> None:
        self._check(writable=True)
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("offset is negative or bigger than buffer")
        size = len(m) - offset if size is None else size
        if size < 0 or offset + size > len(m):
            raise ValueError("size is negative or buffer too small")
        self._send(raw=m[offset:offset + size])

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        self._check(readable=True)
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        data, fds = self._next()
        _close_all(fds)
        if maxlength is not None and len(data) > maxlength:
            raise OSError("bad message length")
        return bytes(data)

    def recv_bytes_into(self, buf, offset: int = 0) -> int:
        self._check(readable=True)
        data, fds = self._next()
        _close_all(fds)
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("negative offset or offset beyond buffer")
        if len(data) > len(m) - offset:
            from multiprocessing import BufferTooShort

            raise BufferTooShort(bytes(data))
        m[offset:offset + len(data)] = data
        return len(data)

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check(readable=True)
        return bool(self._pending) or wait_readable(self._sock, timeout)

    def __reduce__(self):
        self._check()
        return _rebuild_connection, (reduction.DupFd(self.fileno()), self._readable, self._writable, self._sock.type)


def _close_all(fds) -> None:
    for fd in fds or ():  # a bytes message carries no descriptors; never leak any
        os.close(fd)


def _rebuild_connection(dupfd, readable, writable, kind):
    init_reductions()
    return Connection(socket_from_fd(dupfd.detach(), kind), readable, writable)


def Pipe(duplex: bool = True) -> tuple[Connection[Any, Any], Connection[Any, Any]]:
    """Two connected ends; ``duplex=False`` gives (receive-only, send-only) as the stdlib does."""
    a, b = socketpair(socket.SOCK_STREAM)
    if duplex:
        return Connection(a), Connection(b)
    return Connection(a, writable=False), Connection(b, readable=False)
