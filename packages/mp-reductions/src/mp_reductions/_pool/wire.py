"""What the pool's parent and its workers send each other, over our seqpacket SimpleQueues (_channel's wire
format underneath).

Every message starts with a head read before the rest: ``(job, i)`` for a task, ``(job, i, seconds)`` for a
result, ``None`` to stop a worker, or a control head (``STARTED``, ``START_FAILED``, ``WAKE``); so a task whose
arguments fail to unpickle in the worker, or a result that fails to unpickle in the parent, is that task's error
and the pool goes on. A batch of plain tasks (slots Note [batches]) has the head ``[((job, i), length of its
pickle), ...]`` and the tasks' pickles one after another; a short result goes on a socket of its own, framed by
``RESULT`` (job, index, seconds) with no pickle head.
"""

from __future__ import annotations

import array
import fcntl
import os
import pickle
import socket
import struct
import termios

from .._channel import INLINE, Packet, loads, recv_raw

DEPTH = 4  # messages sent to a worker's queue and unfinished: the one it runs and the next ones (slots Note)
BATCH_MAX = 64  # tasks in one message at most (slots Note [batches])
BATCH_TIME = 0.002  # seconds of work a batch of short tasks is made to hold
BATCH_BYTES = INLINE - 4096  # a batch's bodies at most: its head and kind byte fit in the rest of a message
RESULT = struct.Struct("<qqd")  # a short result's frame: job, index, seconds its task took
SHORT_MAX = 4096  # bytes of a short result's message at most
SHORT_READ = 64  # short results read per system call at most (shm_core.recv_many's limit)
TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)  # an int: the enum's & costs microseconds
WAKE = "wake"  # the worker handler's nudge to the result handler: deaths were recorded
STARTED, START_FAILED = "started", "start failed"  # a worker's start report (slots Note [start failures])


def send(sock, head, obj) -> None:
    """Send ``obj`` with its head first."""
    Packet(obj, head=pickle.dumps(head)).send(sock)


def split(data, fds):
    """A message as (head, the rest's pickle, its descriptors): only the head is unpickled."""
    f = _Reader(data)
    try:
        head = pickle.Unpickler(f).load()
    except BaseException:
        for fd in fds or ():
            os.close(fd)
        raise
    return head, f.view[f.pos:], fds


class _Reader:
    """A file over a message's bytes for pickle.Unpickler, which reads the head alone: io.BytesIO would copy
    them all (a spilled result's pickle: megabytes)."""

    def __init__(self, data):
        self.view, self.pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else self.pos + n
        out = bytes(self.view[self.pos:end])
        self.pos += len(out)
        return out

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self.view) - self.pos)
        buf[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def readline(self) -> bytes:
        rest = self.view[self.pos:]
        end = bytes(rest[:4096]).find(b"\n")  # (heads are a few bytes: a longer line is a forged message's)
        return self.read(min(len(rest), 4096) if end < 0 else end + 1)


def unbatch(head, body, fds):
    """The tasks of one message as ((job, i), body, fds): a batch's one by one."""
    if type(head) is not list:
        yield head, body, fds
        return
    start = 0
    for task, n in head:
        yield task, body[start:start + n], None
        start += n


def message(items: list[tuple]) -> list:
    """The buffers of one message holding ``items`` ((job, i), Packet made with the head (job, i), the head's
    length): one as it is, or plain ones as a batch."""
    if len(items) == 1:
        return items[0][1].buffers
    bodies = [memoryview(packet.buffers[1])[n:] for _, packet, n in items]
    return [b"P", pickle.dumps([(task, len(body)) for (task, _, _), body in zip(items, bodies, strict=True)]),
            *bodies]


def message_bytes(items: list[tuple]) -> bytes:
    """The bytes of the message that holds ``items`` (as ``message`` makes it)."""
    return b"".join(map(bytes, message(items)))


def queued_bytes(q) -> int:
    """Bytes of the messages queued in ``q`` (SIOCINQ sums every queued message on a seqpacket socket)."""
    n = array.array("i", [0])
    fcntl.ioctl(q._reader.fileno(), termios.FIONREAD, n)
    return n[0]


def queued(sent, left: int) -> int:
    """How many of a slot's unfinished messages (``sent``, in the order sent) are still queued, ``left`` bytes in
    all: the last ones (slots Note [lost tasks])."""
    n = size = 0
    while n < len(sent) and size + sent[-1 - n][1] <= left:
        size += sent[-1 - n][1]
        n += 1
    return n


def drain(q) -> None:
    """Take every message queued in ``q`` now, unpickling each so that the shared memory it names is given back."""
    while True:
        try:
            _, body, fds = split(*recv_raw(q._reader._sock, socket.MSG_DONTWAIT))
        except (EOFError, OSError):  # empty (BlockingIOError), or closed
            return
        if fds is None:  # plain (batches are): it names no shared memory
            continue
        try:
            loads(body, fds, kept=True)
        except Exception:  # the worker would have made it the task's error; nobody waits for it now
            pass
