"""Passing file descriptors over AF_UNIX sockets (SCM_RIGHTS).

Like ``socket.send_fds`` / ``socket.recv_fds``, but the receiver is told,
instead of silently losing descriptors, when the message or its ancillary data
did not fit (MSG_TRUNC / MSG_CTRUNC), and a receiver out of descriptors loses
no message: see Note [descriptor headroom].
"""

from __future__ import annotations

import errno
import os
import resource
import socket

from . import _native

# Note [descriptor headroom]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: recv_fds dequeues a message only when its descriptors fit under RLIMIT_NOFILE, and returns only what its
# own receive dequeued; a receiver short of descriptors gets OSError(EMFILE), the message left queued (but in the one
# race below).
#
# Why: the kernel installs a message's descriptors as it dequeues it, drops those that do not fit and sets
# MSG_CTRUNC: the message is gone (its segments too, once the sender let go). A MSG_PEEK receive installs them too
# (copies) but leaves the message queued. So recv_fds peeks first:
#
#   peek: descriptors installed, closed at once ── MSG_CTRUNC ──▶ OSError(EMFILE); the message stays queued
#     │ they fit: at least that many numbers are free
#   receive (MSG_DONTWAIT) ── EAGAIN: another reader took it ──▶ peek again
#     │
#   the message dequeued, with the descriptors this receive installed
#
# Several readers may share a socket (a Queue's consumers, a process's threads). The peek only measures: no message
# is returned twice, one a reader peeked but another dequeued is the other's, and a reader short of descriptors
# leaves the message to the others. The race no lock-free protocol closes (dequeue and install are one system call,
# and none dequeues a chosen message): the peeked message fit, another reader took it, and the one dequeued in its
# place carries more descriptors than this reader has free (or another thread took them meanwhile). That message is
# lost and the OSError says so; a stream socket is then out of step. The peek costs one more recvmsg per message
# (about 1 us).


def send_fds(sock: socket.socket, buffers, fds=(), flags: int = 0) -> int:
    """Send ``buffers`` (a list of bytes-like) and ``fds`` in one sendmsg; how many bytes went.
    A peer gone raises BrokenPipeError, never SIGPIPE."""
    return _native.send_fds(sock.fileno(), buffers, fds, flags)


# plain ints: the socket module's are enums, whose & and | cost microseconds per message
_CTRUNC, _TRUNC = int(socket.MSG_CTRUNC), int(socket.MSG_TRUNC)


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int], int]:
    """Receive one message: ``(data, fds, msg_flags)``.

    Raises OSError(EMFILE), the message left queued, when its descriptors do not
    fit under this process's limit (Note [descriptor headroom]); OSError when it
    has more than ``bufsize`` bytes or ``maxfds`` descriptors (it is dropped).
    """
    data, fds, msg_flags = _native.recv_fds(sock.fileno(), bufsize, maxfds, int(flags))  # peek, then receive
    if data is None:
        raise _out_of_descriptors("the message stays queued: the next receive returns it once they fit")
    if msg_flags & _CTRUNC and len(fds) <= maxfds:
        _close(fds)
        raise _out_of_descriptors("a message was lost: another reader took the one that fitted, or another "
                                  "thread took descriptors meanwhile (Note [descriptor headroom], shm_core)")
    if msg_flags & _TRUNC or len(fds) > maxfds:
        _close(fds)
        raise OSError(f"message dropped: larger than this channel's messages ({bufsize} bytes, {maxfds} "
                      f"descriptors); only arraymp's own senders may write to it")
    return data, fds, msg_flags


def recv_many(sock: socket.socket, buffer, size: int, flags: int = 0) -> list[tuple[int, int]]:
    """Up to ``len(buffer) // size`` (64 at most) messages of ``sock`` in one system call (recvmmsg), the k-th
    in ``buffer[k * size:]``: their ``(length, msg_flags)``; [] when none is queued and ``flags`` hold
    MSG_DONTWAIT. No descriptors are received: a message that brought some has MSG_CTRUNC set (the kernel
    closed them), one longer than ``size`` has MSG_TRUNC set; the caller drops both."""
    return _native.recv_many(sock.fileno(), buffer, size, int(flags))


def check_headroom(fd: int, n: int, what: str) -> None:
    """Raise OSError(EMFILE), as recv_fds does (``what`` says what became of the message), unless ``n`` more
    descriptors can be opened now (tried with dups of ``fd``, closed at once)."""
    fds = []
    try:
        for _ in range(n):
            fds.append(os.dup(fd))
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise _out_of_descriptors(what, "open a message's shared memory") from None
    finally:
        _close(fds)


def _out_of_descriptors(what: str, doing: str = "receive a message's descriptors") -> OSError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        n = len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:  # not one number free
        n = soft
    return OSError(errno.EMFILE, f"too many open files to {doing}: {n} are open and this "
                                 f"process may open {soft} (RLIMIT_NOFILE); {what}. Raise the limit (ulimit -n, or "
                                 f"resource.setrlimit(resource.RLIMIT_NOFILE, ...) up to the hard limit {hard}), or "
                                 f"hold fewer descriptors: drop received arrays, send fewer segments per message")
