"""Queue, JoinableQueue and SimpleQueue over seqpacket sockets (adapts multiprocessing/queues.py).

What changed from the stdlib, and why::

    putters ──sendmsg(pickle + fds)──▶ [ socketpair, SOCK_SEQPACKET ] ──recvmsg──▶ getters
        │                                                                   │
        └──── counters in a memfd segment (qsize, unfinished tasks) ────────┘
              atomics + futex: no named semaphore, no lock to die holding

- No locks between processes: a seqpacket socket delivers each message whole
  to one reader, so a process killed in the middle of ``put`` or ``get``
  leaves nothing held and no half message; the others go on.
- Nothing has a name: the counters live in a memfd, so SIGKILL of every
  process leaves no ``/dev/shm/sem.mp-*`` behind.
- Arrays' descriptors travel in the same sendmsg as the message: the sender
  may exit as soon as ``put`` returns.
- ``put`` pickles at once (errors are raised to the caller, and the array's
  contents are those at the time of ``put``), then sends directly when the
  socket has room; only a full socket hands the message to a feeder thread,
  which is joined at exit as the stdlib's is.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from multiprocessing import context as mp_context
from multiprocessing import reduction, util

import shm_core

from ._channel import SPIN, Packet, loads, recv_raw, socketpair
from ._reductions import init_reductions

_COUNT = shm_core.HEADER_SIZE  # items put and not yet got
_UNFINISHED = _COUNT + 8  # JoinableQueue: items put and not yet task_done()
_WAITERS = _COUNT + 16  # putters waiting for room

# Note [spin]: a getter that finds the queue empty retries a few times (yielding
# the CPU) before it sleeps in poll(): in a steady stream the next message is
# usually microseconds away, and a sleep plus wake-up costs tens of them
# (ARRAYMP_QUEUE_SPIN tries, 50 by default, 0 to turn it off).


def _wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _attach_state(fd: int) -> shm_core.Segment:
    seg = shm_core.attach_fd(fd, expected_size=24)
    seg.fd = fd
    return seg


class SimpleQueue:
    """``multiprocessing.SimpleQueue`` whose arrays travel by shared memory.

    Like the stdlib's, it exposes ``_reader`` / ``_writer`` connections, so
    ``multiprocessing.pool.Pool`` runs on it; ``_rlock`` / ``_wlock`` are
    per-process locks only: the socket needs none between processes.
    """

    def __init__(self, *, ctx=None):
        from ._connection import Connection

        a, b = socketpair()
        self._reader, self._writer = Connection(a, writable=False), Connection(b, readable=False)
        self._reset()

    def _reset(self):
        self._rlock, self._wlock = threading.Lock(), threading.Lock()
        self._poll = self._reader.poll

    def __getstate__(self):
        mp_context.assert_spawning(self)
        return self._reader, self._writer

    def __setstate__(self, state):
        init_reductions()  # a process that receives our channel sends arrays by shared memory too
        self._reader, self._writer = state
        self._reset()

    def empty(self) -> bool:
        return not self._reader.poll()

    def put(self, obj) -> None:
        self._writer.send(obj)

    def get(self):
        return self._reader.recv()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    __class_getitem__ = classmethod(types.GenericAlias)


class Queue:
    """``multiprocessing.Queue`` whose arrays travel by shared memory; no lock between processes."""

    def __init__(self, maxsize: int = 0, *, ctx=None):
        if maxsize <= 0:
            from multiprocessing.synchronize import SEM_VALUE_MAX as maxsize
        self._maxsize = maxsize
        self._reader, self._writer = socketpair()
        self._state = shm_core.create_anonymous(24)
        self._reset()
        util.register_after_fork(self, Queue._reset)

    def __getstate__(self):
        mp_context.assert_spawning(self)
        return self._maxsize, self._reader, self._writer, reduction.DupFd(self._state.fd)

    def __setstate__(self, state):
        init_reductions()
        self._maxsize, self._reader, self._writer, dupfd = state
        self._state = _attach_state(dupfd.detach())
        self._reset()
        util.register_after_fork(self, Queue._reset)

    def _reset(self):
        self._closed = False
        self._joincancelled = False
        self._notempty = threading.Condition(threading.Lock())
        self._buffer = collections.deque()
        self._thread = None
        self._closing = False

    # -- putting -----------------------------------------------------------
    def _take_slot(self, block: bool, timeout: float | None) -> None:
        st, maxsize = self._state, self._maxsize
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            n = st.load(_COUNT)
            if n < maxsize:
                if st.compare_exchange(_COUNT, n, n + 1)[0]:
                    return
                continue
            remaining = _remaining(deadline)
            if not block or (remaining is not None and remaining <= 0):
                raise queue.Full
            st.fetch_add(_WAITERS, 1)
            try:
                st.futex_wait(_COUNT, n, 1.0 if remaining is None else min(remaining, 1.0))
            finally:
                st.fetch_add(_WAITERS, -1)

    def _give_slot(self) -> None:
        st = self._state
        st.fetch_add(_COUNT, -1)
        if st.load(_WAITERS):
            st.futex_wake(_COUNT, 1)

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        self._take_slot(block, timeout)
        try:
            packet = Packet(obj)
        except BaseException:
            self._give_slot()
            raise
        self._count_task()
        with self._notempty:
            if not self._buffer and packet.send_nowait(self._writer):
                return
            self._buffer.append(packet)
            if self._thread is None:
                self._start_thread()
            self._notempty.notify()

    def _count_task(self) -> None:
        pass

    def put_nowait(self, obj) -> None:
        return self.put(obj, False)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=Queue._feed, args=(weakref.ref(self), self._notempty, self._buffer,
                                                                    self._writer), name="QueueFeederThread",
                                        daemon=True)
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = util.Finalize(self._thread, Queue._finalize_join, [weakref.ref(self._thread)],
                                             exitpriority=-5)
        self._close = util.Finalize(self, Queue._finalize_close, [self._notempty, self], exitpriority=10)

    @staticmethod
    def _feed(qref, notempty, buffer, writer) -> None:
        while True:
            with notempty:
                while not buffer:
                    q = qref()
                    if q is None or q._closing:
                        return
                    del q
                    notempty.wait(0.1)
                packet = buffer[0]
            try:
                packet.send(writer)
            except Exception:
                q = qref()
                if q is not None and q._closing and isinstance(sys.exc_info()[1], BrokenPipeError):
                    packet.discard()
                else:
                    traceback.print_exc()
                    packet.discard()
            with notempty:
                buffer.popleft()

    @staticmethod
    def _finalize_close(notempty, q) -> None:
        with notempty:
            q._closing = True
            notempty.notify()

    @staticmethod
    def _finalize_join(twr) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    # -- getting -----------------------------------------------------------
    def get(self, block: bool = True, timeout: float | None = None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        spin = SPIN if block else 0
        while True:
            try:
                data, fds = recv_raw(self._reader, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                if spin:  # Note [spin]
                    spin -= 1
                    os.sched_yield()
                    continue
                remaining = _remaining(deadline)
                if not block or (remaining is not None and remaining <= 0):
                    raise queue.Empty from None
                _wait_readable(self._reader, remaining)
        self._give_slot()
        return loads(data, fds)

    def get_nowait(self):
        return self.get(False)

    # -- state -------------------------------------------------------------
    def qsize(self) -> int:
        return self._state.load(_COUNT)

    def empty(self) -> bool:
        return not _wait_readable(self._reader, 0)

    def full(self) -> bool:
        return self.qsize() >= self._maxsize

    def close(self) -> None:
        """No more puts from this process; the feeder flushes what is buffered, then quits."""
        self._closed = True
        with self._notempty:
            self._closing = True
            self._notempty.notify()

    def join_thread(self) -> None:
        """Wait for the feeder thread to flush (only after close())."""
        assert self._closed, f"Queue {self!r} not closed"
        if self._thread is not None:
            self._thread.join()

    def cancel_join_thread(self) -> None:
        """Do not wait for buffered data at exit (it may be lost)."""
        self._joincancelled = True
        jt = getattr(self, "_jointhread", None)
        if jt is not None:
            jt.cancel()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} at {id(self):#x} maxsize={self._maxsize}>"

    __class_getitem__ = classmethod(types.GenericAlias)


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``: ``task_done()`` / ``join()`` over a shared counter."""

    def _count_task(self) -> None:
        self._state.fetch_add(_UNFINISHED, 1)

    def task_done(self) -> None:
        st = self._state
        left = st.fetch_add(_UNFINISHED, -1) - 1
        if left < 0:
            st.fetch_add(_UNFINISHED, 1)
            raise ValueError("task_done() called too many times")
        if left == 0:
            st.futex_wake(_UNFINISHED)

    def join(self) -> None:
        st = self._state
        while (n := st.load(_UNFINISHED)) > 0:
            st.futex_wait(_UNFINISHED, n, 1.0)

