"""Passing file descriptors over AF_UNIX sockets (SCM_RIGHTS).

Like ``socket.send_fds`` / ``socket.recv_fds``, but the receiver is told,
instead of silently losing descriptors, when the message or its ancillary data
did not fit (MSG_TRUNC / MSG_CTRUNC): every descriptor that did arrive is closed
and OSError names the cause.
"""

from __future__ import annotations

import array
import functools
import os
import socket

_FD_SIZE = array.array("i").itemsize


def send_fds(sock: socket.socket, buffers, fds=(), flags: int = 0) -> int:
    """Send ``buffers`` (a list of bytes-like) and ``fds`` in one sendmsg."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    return sock.sendmsg(buffers, anc, flags)


@functools.lru_cache(maxsize=8)
def _space(maxfds: int) -> int:
    return socket.CMSG_SPACE(maxfds * _FD_SIZE)


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int], int]:
    """Receive one message: ``(data, fds, msg_flags)``; raises OSError on truncation."""
    data, anc, msg_flags, _addr = sock.recvmsg(bufsize, _space(maxfds), flags)
    if not anc and not msg_flags & socket.MSG_TRUNC:
        return data, [], msg_flags
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % _FD_SIZE)])
    if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        what = "descriptors" if msg_flags & socket.MSG_CTRUNC else "bytes"
        raise OSError(f"message truncated: more {what} arrived than the receive buffer holds "
                      f"({bufsize} bytes, {maxfds} descriptors); if this says descriptors, "
                      f"raise the open-files limit (ulimit -n)")
    return data, list(fds), msg_flags
