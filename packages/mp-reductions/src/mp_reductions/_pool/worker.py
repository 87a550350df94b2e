"""The pool's worker process: takes its slot's messages in order, runs each task, sends each result (adapts the
``worker`` of CPython's Lib/multiprocessing/pool.py and ``_process_worker`` of concurrent/futures/process.py).

What changed from the stdlib's, and why:

- It joins the parent's shm_manager group (Note [group]) and sends its arrays by shared memory.
- A message is one task or a batch of plain ones (slots Note [batches]); each result is sent as soon as it is
  made, a short plain one on the ``short`` socket (wire.RESULT), any other on the outqueue.
- It writes its clock row as each task starts and ends (clock Note [task clock]), and exits at once, without
  the result, when the watchdog ended the task.
- Its arrays of 1 MiB or more are born in shared memory and move with no copy when it keeps no reference to
  them (_alloc Note [moving results]); the in-flight counts of its results' named segments are told to the
  daemon as sent to the parent (_message Note [results told]).
- It collects garbage when idle, at most every GC_INTERVAL while busy (so views of shared memory caught in
  cycles do not pin segments), after freezing what it holds once started (``gc.freeze``: a collection looks
  at what tasks made only; none comes before the freeze: a fork child's collection writes to every page it
  shares with its parent).
- ``executor=True`` gives concurrent.futures' semantics: a call's BaseException (``sys.exit()``) is its
  result's error and the worker goes on; a result that fails to pickle fails with that very error (not
  ``MaybeEncodingError``); a failing initializer is logged to the ``concurrent.futures`` logger, as the
  stdlib's worker logs it.
- It exits when the pool's process is gone (it polls the parent's sentinel too: under fork a sibling holds
  every slot's writing end).

Note [group]
~~~~~~~~~~~~
Invariant: every pool worker is a member of its parent's shm_manager group (its token is a worker argument), whatever
the start method.

Why: a worker in a group of its own (a forkserver child, or a fork made before the parent joined a group) would leave
its named segments to a daemon that unlinks them when the worker exits, while the parent still holds the results.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import socket
import sys
import time
from multiprocessing import parent_process, util
from multiprocessing import pool as mp_pool

import shm_manager

from .. import _stats
from .._alloc import moves, set_shared_allocation
from .._channel import Packet, loads, recv_raw
from .._message import tls
from .._reductions import init_reductions
from .results import short_repr
from .wire import RESULT, SHORT_MAX, START_FAILED, STARTED, send, split, unbatch

GC_INTERVAL = 0.1  # seconds between full collections in a busy worker (after gc.freeze: only what tasks made) ...
GC_SHARE = 100  # ... or GC_SHARE times the last one's length, so they take at most 1% of its time ...
GC_MAX_INTERVAL = 2.0  # ... but never more than this apart
_IDLE_WAIT = 0.05  # a worker that finds no task within this collects before blocking
OOM_FIRST = 1000  # a worker's oom_score_adj: the highest (Note [out of memory])


class _Collector:
    """A worker's full garbage collections: while it is busy, one GC_INTERVAL after the last, or GC_SHARE times
    the last one's length if that is longer (at most GC_MAX_INTERVAL); when idle, as soon as one is due (at least
    _IDLE_WAIT after its last task), then it blocks."""

    def __init__(self):
        self.last, self.every, self.dirty = time.perf_counter(), GC_INTERVAL, False

    def collect(self) -> None:
        t0 = time.perf_counter()
        gc.collect()
        self.last = time.perf_counter()
        self.every = min(GC_MAX_INTERVAL, max(GC_INTERVAL, GC_SHARE * (self.last - t0)))
        self.dirty = False

    def after_task(self, now: float) -> None:
        if now - self.last >= self.every:
            self.collect()
        else:
            self.dirty = True

    def idle_wait_ms(self) -> float:
        return max(_IDLE_WAIT, self.last + self.every - time.perf_counter()) * 1000


def _next_task(sock, waiter, collector: _Collector):
    """The next message as wire.split's; collect garbage first when none comes before a collection is due;
    EOFError once the pool's process is gone. The receive never blocks: the parent may take back the message
    that woke the poll (slots Note [lost tasks])."""
    while True:
        try:
            return split(*recv_raw(sock, socket.MSG_DONTWAIT))  # as a rule the next one is queued already
        except BlockingIOError:
            pass
        events = waiter.poll(collector.idle_wait_ms()) if collector.dirty else None
        if not events:
            if collector.dirty:
                collector.collect()
            events = waiter.poll()
        if not any(fd == sock.fileno() and ev & select.POLLIN for fd, ev in events):
            raise EOFError("the pool's process is gone")


def worker(inqueue, outqueue, short, row, initializer=None, initargs=(), maxtasks=None, group=None,
           shared_results=False, reader=None, executor=False):
    """A pool worker's body: see the module docstring."""
    if maxtasks is not None and not (isinstance(maxtasks, int) and maxtasks >= 1):
        raise AssertionError(f"Maxtasks {maxtasks!r} is not valid")
    if group is not None:
        shm_manager.join_group(group)  # Note [group]
    init_reductions()
    prepare_worker(shared_results)
    out = outqueue._writer._sock
    inqueue._writer.close()
    outqueue._reader.close()
    short._reader.close()
    short = short._writer._sock
    sock = inqueue._reader._sock
    waiter = select.poll()
    waiter.register(sock.fileno(), select.POLLIN)
    if parent_process() is not None:
        waiter.register(parent_process().sentinel, select.POLLIN)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as e:  # slots Note [start failures]
            if executor:
                logging.getLogger("concurrent.futures").critical("Exception in initializer:", exc_info=True)
            try:
                send(out, START_FAILED, (os.getpid(), _wrap(e)))
            except Exception:  # unpicklable: the traceback on stderr says it
                pass
            if executor:
                sys.exit(1)  # (logged, as the stdlib's; its queues flushed at exit: the log may go through one)
            raise
    catch = BaseException if executor else Exception
    send(out, STARTED, os.getpid())
    gc.freeze()  # what it has now lives as long as it does: collections look at what tasks made only

    completed, collector = 0, _Collector()
    while maxtasks is None or completed < maxtasks:
        try:
            head, body, fds = _next_task(sock, waiter, collector)
        except (EOFError, OSError):  # a task it could not receive stays in the slot for the replacement
            util.debug("worker got EOFError or OSError -- exiting")
            break
        if head is None:
            util.debug("worker got sentinel -- exiting")
            break
        for (job, i), task, task_fds in unbatch(head, body, fds):
            body = fds = None
            if type(job) is int and type(i) is int:  # (a forged head's are not: the task fails as it would)
                row.start(job, i)
            t0 = time.perf_counter()
            result = _run(task, task_fds, catch)
            now = time.perf_counter()  # one clock for the task's time and the collections'
            if not row.finish():  # the watchdog ended it (clock Note [task clock]): no result, no next task
                os._exit(1)
            _send_result(out, short, job, i, now - t0, result, reader, executor, catch)
            task = task_fds = result = None
            completed += 1
            collector.after_task(now)
        head = body = fds = None
    gc.collect()
    util.debug(f"worker exiting after {completed} tasks")


# Note [out of memory]
# ~~~~~~~~~~~~~~~~~~~~
# Invariant: while any worker of a pool lives, the kernel's OOM killer picks a worker, never the process holding
# the pool (in the pool's memory cgroup, or the machine). The killer picks the highest badness: resident pages
# (shared ones included, but not the shmem a worker has reserved and not yet touched: a born-shared allocation's
# fallocate charges the cgroup before any page is mapped) plus oom_score_adj thousandths of the memory. Every
# worker sets its own to 1000, the most (raising it needs no privilege), so its badness is at least the whole of
# the memory and outranks any process at 0, however large the caller and however small the worker (+500, the first
# version, lost to a caller holding more than half the limit, a 400 MiB shared input beside a fresh worker). The
# memory of a killed worker's shared segments cannot be reaped at once as private memory can, so the kernel may
# take a second victim before the first one's exit frees it: another worker, or a replacement, never the caller
# while one lives. A worker's children (a pool of its own) inherit 1000: among them and it, size decides.
def prepare_worker(shared_results: bool) -> None:
    """What a pool's worker does first: its arrays of 1 MiB or more born in shared memory and private
    (``shared_results``: _alloc Note [moving results]) or numpy's (False too: a fork child inherits its parent's
    setting), and the out-of-memory killer's first choice before its parent (Note [out of memory])."""
    set_shared_allocation(shared_results, private=True)
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            f.write(str(OOM_FIRST))
    except (OSError, ValueError):  # no procfs: the kernel picks by size alone
        pass


def _wrap(e: BaseException):
    """A task's exception with its traceback's text as the cause it is rebuilt with (multiprocessing's
    RemoteTraceback, for the Pool and the executor alike: concurrent.futures' own wrapper is private)."""
    return mp_pool.ExceptionWithTraceback(e, e.__traceback__)  # type: ignore[attr-defined]  # (typeshed lacks it)


def _run(body, fds, catch) -> tuple:
    """One task's result, ``(True, value)`` or ``(False, exception)``: its arguments' unpickling error is the
    task's (an Exception; a BaseException there ends the worker), the call's any ``catch``."""
    try:
        _, _, func, args, kwds = loads(body, fds, kept=True)  # _message Note [kept counts]
    except Exception as e:
        return False, _wrap(e)
    body = None
    try:
        return True, func(*args, **kwds)
    except catch as e:
        return False, _wrap(e)


def _send_result(out, short, job, i, seconds: float, result: tuple, reader, executor: bool, catch) -> None:
    """Send one task's result: on ``short`` framed by wire.RESULT if it is plain and small, else on ``out`` with
    the head (job, i, seconds); its in-flight counts told as sent to ``reader`` (_message Note [results
    told]). A result that cannot be pickled sends its error instead: the pickling error itself (the executor's) or
    the stdlib Pool's MaybeEncodingError."""
    packet = None
    try:
        head = pickle.dumps((job, i, seconds))
        tls.to = reader
        try:
            packet = Packet(result, head=head, moves=moves(result))
        finally:
            tls.to = None
        if packet.plain and len(packet.buffers[1]) - len(head) <= SHORT_MAX - RESULT.size \
                and type(job) is int and type(i) is int:
            short.sendmsg([RESULT.pack(job, i, seconds), memoryview(packet.buffers[1])[len(head):]])
            packet.sent_along()
            _stats.counts[_stats.MESSAGES_SENT] += 1
        else:
            packet.send(out)
    except catch as e:
        if packet is not None:  # made but not sent: what it holds goes back
            packet.discard()
        error = _wrap(e) if executor else encoding_error(e, result[1])
        util.debug(f"Possible encoding error while sending result: {error}")
        try:
            send(out, (job, i, seconds), (False, error))
        except Exception as again:  # the error itself cannot be pickled: its repr can
            send(out, (job, i, seconds), (False, encoding_error(again, result[1])))


def encoding_error(exc: BaseException, value) -> mp_pool.MaybeEncodingError:  # type: ignore[name-defined]
    """The stdlib's MaybeEncodingError, its value's repr cut short: its reason comes last in its message, and must
    not be buried after a screenful of arrays."""
    error = mp_pool.MaybeEncodingError(exc, None)  # type: ignore[attr-defined]  # (undocumented: not in typeshed)
    error.value = short_repr(value)
    error.args = (error.exc, error.value)
    return error
