"""The pool's three handler threads: the task handler pickles tasks into the slots, the worker handler reaps and
replaces workers, the result handler reads results and settles deaths (adapts ``_handle_tasks``,
``_handle_workers`` and ``_handle_results`` of CPython's Lib/multiprocessing/pool.py, 3.11-3.15 alike, PSF
License Agreement)::

    fronts ─▶ taskqueue ─▶ task handler ─▶ slots (ready, then slot k's queue) ─▶ worker k ─┐
                                                ▲                                         │ results:
    results ◀── result handler ◀── short socket (recvmmsg), outqueue ◀────────────────────┘ (job, i, s) + value
                      ▲                  (it sends ready tasks to the slots its results and deaths free)
    worker handler ───┘ deaths: slot, pid, exit code, the messages it took (slots Note [lost tasks])

What changed from the stdlib's, and why: each is a method of the pool's core and reads its state there (the
stdlib's read ``threading.current_thread()._state``); none dies of an error it can wait out (a receive that
failed for want of descriptors, a worker that failed to start: retried after a back-off, logged once), and one
that dies of anything else breaks the pool (core Note [helper threads]); the worker handler does not wake at
every result (only on worker exits and the core's nudges); the result handler settles deaths and reads the short
results many to a system call.

Note [resource tracker]
~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a worker start that blocks or fails holds up only the replacement of workers: the deaths seen before are
settled and the live workers go on, and a start that fails (a killed forkserver, no descriptors left) is retried
after a back-off.

Why: ``Process.start`` under spawn (and forkserver) calls ``multiprocessing.resource_tracker.getfd()``, which writes
a probe to the tracker's pipe (a killed tracker gives EPIPE and is relaunched). The worker handler blocks there, as
the stdlib's does, while the tracker does not read (stopped, or starved on a loaded machine); meanwhile no death is
recorded and no worker replaced.
"""

from __future__ import annotations

import collections
import logging
import pickle
import select
import signal
import socket
import time
from multiprocessing import connection, util

import shm_core

from .. import _stats
from .._channel import Packet, check_openable, loads, recv_raw
from .errors import WorkerStartError, loss, unpickling_error
from .results import short_repr
from .wire import RESULT, SHORT_MAX, SHORT_READ, START_FAILED, STARTED, TRUNCATED, WAKE, split

log = logging.getLogger("mp_reductions.pool")

RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"  # the stdlib's states (multiprocessing.pool's values)
RAISE = object()  # a task's function when the iterable of a map raised: that task fails with the error
_BACKOFF = (0.01, 1.0)  # first and longest wait before a handler retries what failed


def backoff(delay: float | None) -> float:
    return _BACKOFF[0] if delay is None else min(2 * delay, _BACKOFF[1])


def handle_tasks(core) -> None:
    """Pickle each queued call's tasks into the slots, in order, until told to stop; then tell the result handler
    and the workers to stop."""
    slots, cache = core.slots, core.cache
    for tasks, set_length in iter(core.taskqueue.get, None):
        task = None
        try:
            for task in tasks:
                if core.state == TERMINATE:
                    break
                job, i, func = task[:3]
                try:
                    if func is RAISE:  # the map's iterable raised: its error is this task's
                        raise task[3][0]
                    slots.put(task)
                except Exception as e:
                    result = cache.get(job)
                    if result is not None:
                        result._set(i, (False, e))
            else:
                if set_length:
                    set_length(task[1] + 1 if task else 0)
                continue
            break
        finally:
            task = tasks = None
    try:
        Packet(None, head=pickle.dumps(None)).send(core.outqueue._writer._sock)  # the result handler's stop
        slots.stop()
    except OSError:  # torn down meanwhile
        util.debug("task handler got OSError when sending sentinels")


def handle_workers(core) -> None:
    """Reap dead workers and start replacements while the pool runs, or is closed and tasks are pending; then let
    the task handler stop."""
    delay = None
    while core.state == RUN or (core.cache and core.state != TERMINATE):
        _reap(core)
        try:
            core.repopulate()
            delay = None
        except Exception:  # (a killed forkserver, no descriptors left: Note [resource tracker])
            if delay is None:
                log.warning("a pool worker failed to start; retrying", exc_info=True)
            delay = backoff(delay)
        connection.wait([*(w.sentinel for w in list(core.workers) if hasattr(w, "sentinel")),
                         core.notifier._reader], timeout=delay)
        core.drain_notifier()
    core.taskqueue.put(None)
    util.debug("worker handler exiting")


def _reap(core) -> None:
    """Record exited workers' deaths (slots Note [lost tasks]) and reap them."""
    slots = core.slots
    with slots.lock:  # the watchdog signals workers under it: none is reaped meanwhile (watchdog Note)
        dead = [w for w in core.workers if w.exitcode is not None]
        for w in dead:
            slots.exited(w, core.watchdog.death(w))
    for w in dead:
        w.join()
        core.workers.remove(w)
        core.launched(w.pid)  # (core Note [launch counts])
    if dead:
        try:
            Packet(None, head=pickle.dumps(WAKE)).send_nowait(core.outqueue._writer._sock)
        except OSError:  # the pool is being torn down
            pass


class ResultHandler:
    """Reads results and settles deaths (slots Note [lost tasks]) until stopped and nothing is pending."""

    def __init__(self, core):
        self.core, self.slots, self.cache = core, core.slots, core.cache
        self.reader = core.outqueue._reader
        self.short = self.slots.short._reader._sock
        self.frames = memoryview(bytearray(SHORT_READ * SHORT_MAX))
        self.stopping = False
        self.started = self.slots.started
        self.start_errors: dict[int, BaseException] = {}
        self.start_failures = 0  # slots Note [start failures]
        # taken, not opened yet (_channel Note [opening named segments])
        self.pending: collections.deque = collections.deque()
        self.waiter = select.poll()
        for fd in (self.reader.fileno(), self.short.fileno()):
            self.waiter.register(fd, select.POLLIN)

    def run(self) -> None:
        core, slots, reader_fd, short_fd = self.core, self.slots, self.reader.fileno(), self.short.fileno()
        delay, deaths, ready = None, [], set()
        while core.state != TERMINATE and not (self.stopping and not self.cache):
            if delay is None:  # results, the stop sentinel, and the worker handler's nudges wake it
                ready = {fd for fd, _ in self.waiter.poll()}
            else:
                time.sleep(delay)
            deaths += slots.take_deaths()
            everything = deaths or delay is not None  # a death is settled after every result its worker sent
            try:
                if everything or short_fd in ready:
                    self.read_short()
                if everything or self.pending or reader_fd in ready:
                    self.read_messages(reader_fd)
            except EOFError:
                util.debug("result handler got EOFError -- exiting")
                return
            except OSError:  # for want of descriptors (the message is kept in pending): retried
                if delay is None:
                    log.warning("the pool's result handler could not receive a result; retrying", exc_info=True)
                delay = backoff(delay)
                continue  # the deaths wait until every message before them is read
            delay = None
            for death in deaths:
                self.settle_death(*death)
            deaths = []
            slots.balance()
            slots.settle_failed()
        util.debug(f"result handler exiting: len(cache)={len(self.cache)}")

    def read_messages(self, reader_fd: int) -> None:
        """Deliver every message queued on the outqueue now."""
        while True:
            try:
                msg = self.pending.popleft() if self.pending else split(*recv_raw(self.reader._sock,
                                                                                 socket.MSG_DONTWAIT))
            except BlockingIOError:
                return
            try:
                check_openable(msg[1], msg[2], reader_fd)
            except OSError:
                self.pending.appendleft(msg)
                raise
            self.control(*msg)

    def control(self, head, body, fds) -> None:
        if head is None:
            self.stopping = True
        elif head == WAKE:
            pass
        elif head == STARTED:
            self.started.add(loads(body, fds))
            self.start_failures = 0
        elif head == START_FAILED:
            pid, error = loads(body, fds)
            self.start_errors[pid] = error
        elif type(head) is tuple and len(head) == 3 and type(head[0]) is int and type(head[1]) is int:
            job, i, seconds = head
            self.deliver(job, i, self.slots.results([((job, i), seconds)])[0], body, fds)
        else:  # (only our workers hold the outqueue: a bug's, or a forged message's)
            log.error("the pool's result handler dropped a message with a malformed head %s", short_repr(head))
            self.deliver(-1, -1, False, body, fds)  # what it names goes back

    def deliver(self, job, i, known: bool, body, fds) -> None:
        try:
            obj = loads(body, fds)  # even if unknown: gives back the shared memory it names
            if not (isinstance(obj, tuple) and len(obj) == 2):
                raise TypeError(f"a pool worker sent {type(obj).__name__!r} as a result")
        except Exception as e:  # the task's error: the pool goes on
            obj = (False, e)
        except BaseException as e:  # (SystemExit raised by a result's unpickling): never this thread's end
            obj = (False, unpickling_error(e))
        result = self.cache.get(job) if known else None
        if result is not None:
            try:
                result._set(i, obj)
            except Exception:  # a callback raised (the stdlib's thread would die: the result is set anyway)
                log.exception("a callback of the pool's result %d raised", job)

    def read_short(self) -> None:
        """Deliver every short result queued now (slots Note [batches])."""
        frames, slots = self.frames, self.slots
        while self.short is not None:
            got = shm_core.recv_many(self.short, frames, SHORT_MAX, socket.MSG_DONTWAIT)
            _stats.counts[_stats.MESSAGES_RECEIVED] += len(got)
            done = []
            for k, (n, flags) in enumerate(got):
                if n == 0:  # its writers are gone (never while the pool lives: it holds one): stop polling it
                    self.waiter.unregister(self.short)
                    self.short = None
                    return
                if flags & TRUNCATED or n < RESULT.size:
                    log.error("the pool's result handler dropped a malformed short result (%d bytes, flags %#x)", n,
                              flags)
                    continue
                job, i, seconds = RESULT.unpack_from(frames, k * SHORT_MAX)
                done.append(((job, i), seconds, k * SHORT_MAX + RESULT.size, k * SHORT_MAX + n))
            unfinished = slots.results([d[:2] for d in done]) if done else []
            for ((job, i), _, start, end), known in zip(done, unfinished, strict=True):
                self.deliver(job, i, known, frames[start:end], None)
            if len(got) < SHORT_READ:
                return

    def settle_death(self, k, pid, exitcode, took, how) -> None:
        """Worker ``pid`` of slot ``k`` died and every message it sent is read: its start failure counted, its
        running task failed, its unstarted ones ready again."""
        slots = self.slots
        if pid in self.started:
            self.started.discard(pid)
        elif exitcode and exitcode not in (-signal.SIGKILL, -signal.SIGTERM):
            self.start_failures += 1
            if self.start_failures >= self.core.start_failures_allowed and slots.broken is None:
                error = WorkerStartError(self.start_failures, pid, exitcode, self.core.method)
                error.__cause__ = self.start_errors.get(pid)
                self.core.start_failed(error)
        self.start_errors.pop(pid, None)
        slots.done_with([pid])  # every message it sent is read (_message Note [results told])
        running = slots.lost(k, took)
        result = self.cache.get(running[0]) if running else None
        if result is not None:
            result._set(running[1], (False, loss(pid, exitcode, running, result, how)))
