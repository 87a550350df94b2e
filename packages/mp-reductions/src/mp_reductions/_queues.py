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
  which is joined at exit as the stdlib's is. A subclass that overrides
  ``_on_queue_feeder_error`` gets it called instead of the raise, as the
  stdlib's feeder calls it (the item is dropped, ``put`` returns).

The classes subclass the stdlib's of the same names (each method of theirs is
overridden): ``isinstance(q, multiprocessing.queues.Queue)`` holds, and code
that subclasses for the hook above works unchanged.
"""

from __future__ import annotations

import collections
import os
import queue
import socket
import threading
import time
import traceback
import types
import weakref
from multiprocessing import context as mp_context
from multiprocessing import queues as mp_queues
from multiprocessing import reduction, util
from typing import Any, Generic, TypeVar

import shm_core

from ._channel import SPIN, Packet, dequeue, loads_kept, socket_from_fd, socketpair, unpack, wait_readable
from ._connection import Connection
from ._reductions import init_reductions

_T = TypeVar("_T")

_COUNT = shm_core.HEADER_SIZE  # items put and not yet got
_UNFINISHED = _COUNT + 8  # JoinableQueue: items put and not yet task_done()
_WAITERS = _COUNT + 16  # putters waiting for room

# Note [slots]
# ~~~~~~~~~~~~
# Invariant: every message in a Queue(maxsize)'s socket or in a feeder's buffer holds one slot of _COUNT (the count
# that bounds it), and no slot outlives its message: a getter killed anywhere (SIGKILL right after recvmsg dequeued a
# message included) never leaves the count too high, so it never blocks putters for good.
#
# How: a putter takes a slot (CAS below maxsize) before it sends. A getter gives the slot back *before* each receive
# attempt and takes it again if that attempt dequeued nothing. The price is on the safe side: for the instant of an
# attempt the count is one low per getter (a put may then go past maxsize by that many; qsize() never shows less than
# 0), and a getter killed inside an attempt that dequeued nothing leaves it one low for good (one more item fits).

# Note [spin]
# ~~~~~~~~~~~
# Rule: a getter that finds the queue empty retries ARRAYMP_QUEUE_SPIN times (50 by default, 0 to turn it off),
# yielding the CPU, before it sleeps in poll(): in a steady stream the next message is usually microseconds away, and
# a sleep plus wake-up costs tens of them.


# Note [closing]
# ~~~~~~~~~~~~~~
# Invariant: as the stdlib's, Queue.close() means no more puts from this process, and once what it buffered is sent,
# this process's descriptors of both sockets are closed (then get() raises ValueError, as the stdlib's does); the
# other processes' descriptors of the same sockets stay open: the queue lives on for them.
#
# As in the stdlib (whose ends close only once a put started its feeder, which closes both connections), close() of a
# queue this process never put on only marks it closed: empty() still answers, and its ends close when it is dropped;
# once closed, empty() raises the stdlib's OSError.
#
#   close() ─ no put yet ───────────────────────────────────▶ marked closed; ends closed when dropped
#          ├─ no feeder thread ─────────────────────────────▶ both ends closed now
#          └─ feeder: _CLOSE queued after the buffered packets ─▶ it sends them, closes both, exits;
#                                                                 join_thread() waits for that
#
# A queue dropped without close() does the same (__del__, or the feeder told by a Finalize), so no socket is left for
# the garbage collector to warn about. A get() in progress in another thread sees the reader close as a closed Python
# socket (number -1: never another descriptor reusing the number) and raises ValueError, dequeuing nothing: a message
# it had not yet dequeued is left for the queue's other readers.
_CLOSE = object()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _attach_state(fd: int) -> shm_core.Segment:
    seg = shm_core.attach_fd(fd, expected_size=24)
    seg.fd = fd
    return seg


class SimpleQueue(mp_queues.SimpleQueue, Generic[_T]):
    """``multiprocessing.SimpleQueue`` whose arrays travel by shared memory.

    Like the stdlib's, it exposes ``_reader`` / ``_writer`` connections, so
    ``multiprocessing.pool.Pool`` runs on it; ``_rlock`` / ``_wlock`` are
    per-process locks only: the socket needs none between processes.
    """

    def __init__(self, *, ctx: Any = None) -> None:
        a, b = socketpair()
        self._reader: Connection[Any, Any] = Connection(a, writable=False)
        self._writer: Connection[Any, Any] = Connection(b, readable=False)
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

    def put(self, obj: _T) -> None:
        self._writer.send(obj)

    def get(self) -> _T:
        return self._reader.recv()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    __class_getitem__ = classmethod(types.GenericAlias)  # type: ignore[var-annotated]  # (Generic's, typed)


class Queue(mp_queues.Queue, Generic[_T]):
    """``multiprocessing.Queue`` whose arrays travel by shared memory; no lock between processes."""

    # a half-built queue is safe to drop (None only there, where nothing but close() and __del__ runs)
    _reader: socket.socket = None  # type: ignore[assignment]
    _writer: socket.socket = None  # type: ignore[assignment]
    _thread: threading.Thread | None = None

    @staticmethod
    def _on_queue_feeder_error(e: Exception, obj: object) -> None:
        """The stdlib's feeder hook (undocumented), ours: ``put`` raises instead of calling this one; a subclass
        written for the stdlib that overrides it gets it called with ``(e, obj)`` and the item dropped, as the
        stdlib's feeder does, and its ``super()`` call prints the traceback, as the stdlib's does."""
        traceback.print_exc()

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        if maxsize <= 0:
            from multiprocessing.synchronize import SEM_VALUE_MAX as maxsize  # type: ignore[attr-defined,no-redef]
        self._maxsize = maxsize
        self._reader, self._writer = socketpair()
        self._state = shm_core.create_anonymous(24)
        self._reset()
        util.register_after_fork(self, Queue._reset)

    def __getstate__(self):
        mp_context.assert_spawning(self)
        return (self._maxsize, reduction.DupFd(self._reader.fileno()), reduction.DupFd(self._writer.fileno()),
                reduction.DupFd(self._state.fd))

    def __setstate__(self, state):
        init_reductions()
        self._maxsize, reader, writer, state_fd = state
        self._reader = socket_from_fd(reader.detach(), socket.SOCK_SEQPACKET)
        self._writer = socket_from_fd(writer.detach(), socket.SOCK_SEQPACKET)
        self._state = _attach_state(state_fd.detach())
        self._reset()
        util.register_after_fork(self, Queue._reset)

    def _reset(self):
        for _, fds in getattr(self, "_pending", ()):  # a fork child: the parent's to return
            for fd in fds or ():
                os.close(fd)
        self._pending = collections.deque()  # taken but not opened yet (_channel Note [opening named segments])
        self._closed = False
        self._used = False  # a put was made in this process (Note [closing])
        self._joincancelled = False
        self._notempty = threading.Condition(threading.Lock())
        self._buffer = collections.deque()
        self._thread = None
        self._close = None  # once a feeder runs: tells it to flush and close (Note [closing])

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
        self._state.fetch_add(_COUNT, -1)
        self._wake_putter()

    def _wake_putter(self) -> None:
        st = self._state
        if st.load(_WAITERS):
            st.futex_wake(_COUNT, 1)

    def put(self, obj: _T, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        self._used = True
        self._take_slot(block, timeout)
        try:
            packet = Packet(obj)
        except BaseException as e:
            self._give_slot()
            if not isinstance(e, Exception) or type(self)._on_queue_feeder_error is Queue._on_queue_feeder_error:
                raise
            self._on_queue_feeder_error(e, obj)  # a subclass's hook, written for the stdlib: the item is dropped
            return
        with self._notempty:
            if self._closed:  # by another thread meanwhile: the writer may be closed (Note [closing])
                packet.discard()
                self._give_slot()
                raise ValueError(f"Queue {self!r} is closed")
            self._count_task()
            if not self._buffer and packet.send_nowait(self._writer):
                return
            self._buffer.append(packet)
            if self._thread is None:
                self._start_thread()
            self._notempty.notify()

    def _count_task(self) -> None:
        pass

    def put_nowait(self, obj: _T) -> None:
        return self.put(obj, False)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=Queue._feed, args=(self._notempty, self._buffer, self._reader,
                                                                    self._writer), name="QueueFeederThread",
                                        daemon=True)
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = util.Finalize(self._thread, Queue._finalize_join, [weakref.ref(self._thread)],
                                             exitpriority=-5)
        # at close(), at exit, or when the queue is dropped (Note [closing])
        self._close = util.Finalize(self, Queue._finalize_close, [self._notempty, self._buffer], exitpriority=10)

    @staticmethod
    def _feed(notempty, buffer, reader, writer) -> None:
        while True:
            with notempty:
                while not buffer:
                    notempty.wait()
                packet = buffer[0]
            if packet is _CLOSE:
                reader.close()
                writer.close()
                return
            try:
                packet.send(writer)
            except Exception as e:
                if not (isinstance(e, BrokenPipeError) and buffer[-1] is _CLOSE):  # no reader left while closing
                    traceback.print_exc()
                packet.discard()
            with notempty:
                buffer.popleft()

    @staticmethod
    def _finalize_close(notempty, buffer) -> None:
        with notempty:
            buffer.append(_CLOSE)
            notempty.notify()

    @staticmethod
    def _finalize_join(twr) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    # -- getting -----------------------------------------------------------
    def get(self, block: bool = True, timeout: float | None = None) -> _T:
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        spin = SPIN if block else 0
        st = self._state
        while True:
            if self._closed:  # also by another thread while this one waited (Note [closing])
                raise ValueError(f"Queue {self!r} is closed")
            if self._pending:
                return loads_kept(self._pending.popleft(), self._pending, self._reader)
            st.fetch_add(_COUNT, -1)  # the slot back before the receive (Note [slots])
            try:
                msg = dequeue(self._reader, socket.MSG_DONTWAIT)
                break
            except BaseException as e:
                st.fetch_add(_COUNT, 1)  # nothing dequeued: the slot is still taken
                if not isinstance(e, BlockingIOError):
                    raise
                if spin:  # Note [spin]
                    spin -= 1
                    os.sched_yield()
                    continue
                remaining = _remaining(deadline)
                if not block or (remaining is not None and remaining <= 0):
                    raise queue.Empty from None
                wait_readable(self._reader, remaining)
        self._wake_putter()
        return loads_kept(unpack(*msg), self._pending, self._reader)

    def get_nowait(self) -> _T:
        return self.get(False)

    # -- state -------------------------------------------------------------
    def qsize(self) -> int:
        return max(0, self._state.load(_COUNT))  # Note [slots]

    def empty(self) -> bool:
        if self._reader.fileno() < 0:
            raise OSError("handle is closed")  # as the stdlib's, once close() closed it (Note [closing])
        return not self._pending and not wait_readable(self._reader, 0)

    def full(self) -> bool:
        return self.qsize() >= self._maxsize

    def close(self) -> None:
        """No more puts or gets in this process; what it buffered is sent, then its ends close (Note [closing])."""
        with self._notempty:
            self._closed = True
            if self._thread is None and self._used:
                self._close_ends()
        close, self._close = self._close, None
        if close is not None:
            close()

    def _close_ends(self) -> None:
        for sock in (self._reader, self._writer):
            if sock is not None:
                sock.close()

    def __del__(self):
        if self._thread is None:  # a feeder closes them itself, once told (Note [closing])
            self._close_ends()

    def join_thread(self) -> None:
        """Wait for the feeder thread to flush and close (only after close())."""
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

    __class_getitem__ = classmethod(types.GenericAlias)  # type: ignore[var-annotated]  # (Generic's, typed)


class JoinableQueue(Queue[_T], mp_queues.JoinableQueue):
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

