"""``Pool``: the stdlib's process pool over our channels, surviving dead workers
(adapts multiprocessing/pool.py).

What changed from the stdlib, and why::

    apply/map/imap ─▶ task handler ─▶ ready tasks ─▶ slot k: worker k's own queue ─▶ worker k ─┐
                      (pickles them)    (a message: one task, or a batch of short ones,        │
                                         sent while a slot holds < DEPTH unfinished)           │
    AsyncResult ◀── result handler ◀──short results (recvmmsg) ◀───────────────────────────────┤ (job, i, s)
                          ▲        ◀──outqueue (SimpleQueue) ◀─────────────────────────────────┘ + result
                          │          (sends ready tasks to the slots its results and deaths free)
    worker handler ───────┘ deaths: slot, pid, exit code, the messages it took (Note [lost tasks])

- All queues are our seqpacket ``SimpleQueue``, whatever the context: task
  arguments and results carry their arrays by shared memory (DESIGN.md).
- Each worker has its own task queue (a slot) instead of one shared inqueue,
  holding the message it runs and the next few: so the parent knows which
  tasks each worker took, and a worker that dies (a signal, the out-of-memory
  killer, ``os._exit``) fails the one it ran with ``WorkerLostError`` (the
  stdlib's Pool waits forever there); a task it had not started stays in the
  slot, or is sent again, for its replacement. The task handler keeps tasks
  pickled and ready (``DEPTH * BATCH_MAX`` plain ones per worker); the result
  handler sends them as results arrive.
- Every message starts with a head ``(job, i)`` read before the rest: a task
  whose arguments fail to unpickle in the worker, or a result that fails to
  unpickle in the parent, is that task's error; the pool goes on.
- Short tasks travel several to a message and their results are read many to
  a system call (Note [batches]): a tiny task costs the parent less than the
  stdlib's one message per task and per result.
- No handler thread dies of an error: the result handler retries a receive
  that failed (the parent out of descriptors) after a back-off, logging once;
  the worker handler retries a worker that failed to start the same way.
- Workers exit when the pool's process is gone (they wait on its sentinel too:
  under fork, a sibling holds every slot's writing end).
- The worker handler no longer wakes on every queued result (the stdlib waits
  on the outqueue's reader too, which spins while results are pending); it
  wakes on worker exits and on the change notifier, which is all it acts on.
  The cache of pending results puts on the notifier when it empties only once
  the pool is closed (``_Cache``): the stdlib's does at the end of every call,
  and that wake cost the parent ~150 us of CPU a ``map``, on the GIL while the
  call returned and the next one started. A closed pool's handler still wakes
  when its last pending result is set (close sets ``closing`` before its own
  put on the notifier: a result set before that finds the handler's next check
  of the cache, one set after puts).
- An ``apply_async`` result waits on a lock held until its result is set
  (``_Done``), not a ``threading.Event``: the Event's Condition cost ~4 us
  to make and as much again to set and wait on, in the caller's thread and
  the result handler's, on the GIL (per 1,000 ``apply_async``, fork: the
  caller's CPU 16.5 -> 7.3 ms, wall 62 -> 52 ms).
- Workers run a full garbage collection when they go idle, at most every
  ``GC_INTERVAL`` seconds while busy (or ``GC_SHARE`` times the last one's
  length, up to ``GC_MAX_INTERVAL``: at most 1% of a busy worker's time
  however large the heap its tasks keep), and at exit, so views of shared
  memory caught in reference cycles do not pin segments. What a worker holds once
  started (its imports, the initializer's state) is frozen first
  (``gc.freeze``): a collection looks at what its tasks made only (a full one
  cost ~17 ms with numpy imported, every 0.1 s, a sixth of a busy worker); a
  cycle among the frozen objects is never collected but lives as long as the
  worker, as the initializer's globals do. No collection comes before the
  freeze: it cost each worker 10-16 ms before its first task, and a fork
  child's collection writes to every page of objects it shares with its
  parent (copy-on-write lost); the garbage it would find there is the
  parent's, already made.

The task index in ``WorkerLostError`` is the item's for ``apply`` and for
``imap`` / ``imap_unordered`` with chunksize 1, else the chunk's.

Note [group]: workers join the parent's shm_manager group (its token is a
worker argument), whatever the start method. A worker in a group of its own
(a forkserver child, or a fork made before the parent joined a group) would
leave its named segments to a daemon that unlinks them when the worker exits,
while the parent still holds the results.

Note [lost tasks]: the parent sends a worker's queue (slot k) a message (one
task, or a batch: Note [batches]) only while slot k holds fewer than ``DEPTH``
(4) unfinished ones (sent, and neither all their results read nor their loss
settled), under the slots' lock, and records each with its size in bytes; it
keeps a reading end of every slot's queue. A worker takes its messages in
order, so the messages still queued in slot k are always the last ones sent,
and their total size (SIOCINQ) says how many: the unfinished ones before them
were taken. When the worker handler reaps worker
k (so it is dead and sent all it will ever send), it reads that total, under
the lock and before it starts the replacement (the only other reader): the
taken messages are recorded, the queued ones are left to the replacement.
The result handler settles the record: it takes the records, then reads every
message queued on the short socket and the outqueue (all of the dead worker's
are there by then; a receive that fails puts the settling off until one
works), then fails the first recorded task that is still unfinished (its
result did not come) with ``WorkerLostError`` and makes the others ready again
(Note [batches]). The first message still queued behind a running one is
moved, unchanged, to a slot left with nothing to do when no task is ready:
the receive takes the oldest message still queued (its worker takes them in
order, and may have taken some of those counted meanwhile: the message is
told by its bytes, each holding its own (job, i) heads; a receive that finds
nothing moves nothing); the rest stay the last ones sent, and the stdlib's
shared inqueue would have run it there too. (DEPTH 4, not 2: a worker has
its next messages at hand while the result handler, which sends the ready
tasks, waits for the GIL; 2 cost a map of 8 chunks ~5% of its time.) So
every task is, whatever is killed when, finished, failed, or queued for a
live or starting worker; nothing depends on where a worker was killed
(before or after its recvmsg,
while unpickling, while sending its result), and no one waits for a slot
without a worker on its way to it (every death is recorded, and settling it
frees the slot). Stop sentinels go to the slots only once no task is
unfinished (close) or at terminate, where unfinished results stay pending as
in the stdlib. ``terminate`` gives back the shared memory of tasks never run:
the ready ones (pickled, waiting for room) and the one the task handler holds
are discarded, and each slot's queue is drained once the workers are gone
(``_drain`` unpickles each task).

Note [start failures]: a worker sends ``_STARTED`` once its initializer has
returned, or ``_START_FAILED`` with the initializer's exception before it exits.
A worker that exits with an error (a non-zero code, or a signal other than
SIGKILL / SIGTERM, which come from outside) before ``_STARTED`` is a start
failure: its initializer raised, or it could not unpickle its arguments. The
result handler sees a dead worker's messages before it settles its death, so it
knows; after ``processes`` start failures in a row (no worker started between
them) the pool is broken: every unfinished and every later task fails with
``WorkerStartError`` (the initializer's exception as its cause) and the worker
handler starts no more workers (the stdlib's Pool respawns them forever).

Note [batches]: the parent sends a slot one message at a time, each one task
or a batch of plain ones (naming no shared memory: _channel Note [plain
messages]), with a head ``[((job, i), length of its pickle), ...]`` and the
tasks' pickles one after another; a batch is as many ready tasks as make about
``BATCH_TIME`` of work by the workers' own measure (each result says how long
its task ran; ``per_task`` is their moving average), at most ``BATCH_MAX``, no
more than a fair share of the ready ones, and the whole within one message. A
task holding shared memory, or any task of a pool whose workers retire after
``maxtasksperchild`` tasks (a worker must not take more than it will run),
goes alone. Tasks that run long are never batched, so none waits behind a long
one while another worker idles, as the stdlib's shared queue ensures; a batch
of short ones may, for about BATCH_TIME. A worker runs a batch's tasks in order
and sends each result as it is made, before it starts the next: a plain one
that fits ``_SHORT_MAX`` bytes framed by ``_RESULT`` (job, index, seconds) on
the ``short`` socket, which carries no descriptor and which the result handler
reads up to 64 messages per system call (``shm_core.recv_many``), any other on
the outqueue with the head ``(job, i, seconds)``. So Note [lost tasks] holds per
task: when a worker dies, the result handler has read every result it sent
(from both sockets) before it settles the death; in the message it was running,
its first unfinished task is the one it ran (or was about to) and fails with
``WorkerLostError``, and those after it, never started, are ready again, first
in line (``_Slots.lost``). A killed worker still fails at most the task it took.

Note [resource tracker]: ``Process.start`` under spawn (and forkserver) calls
``multiprocessing.resource_tracker.getfd()``, which writes a probe to the
tracker's pipe (``os.write``; a killed tracker gives EPIPE and is relaunched).
The worker handler blocks there, as the stdlib's does, while the tracker does
not read (stopped, or starved on a loaded machine); meanwhile no death is
recorded and no worker replaced, but the deaths seen before are settled and
the live workers go on. A start that fails (a killed forkserver, no
descriptors left) is retried after a back-off instead of killing the thread.

Note [task timeouts]: each slot has a row of the pool's ``_Clock`` (a memfd
shared with its workers: four int64s, a sequence odd while written, the job
and index of the task running and its start by ``time.monotonic_ns``, which is
one clock for every process of the machine). A worker writes the row as it
starts each task and marks it idle before it sends the result (so a task whose
result is on its way is never timed out); the parent resets it when a worker
dies and before its replacement starts. A watchdog thread (one per pool)
reads the rows every ``_TICK`` seconds while the pool has a ``task_timeout``
or a call with a ``timeout`` is unfinished (else every ``RSS_INTERVAL``, to
sample the workers' memory: Note [deaths explained] in _deaths). A task past
its limit, measured from its start as its worker saw it (a worker still
importing under spawn, or a task queued behind another, uses none of it), has
its worker sent SIGTERM under the slots' lock after the row is read again
unchanged (the task is still the one running, and the worker not reaped: its
pid is its own), and SIGKILL ``GRACE`` seconds later if it has not died. From
there it is a worker loss like any other (Note [lost tasks]): the worker
handler records the death, the result handler settles it after reading every
result the worker sent, the task running fails, the unstarted tasks of its
message are ready again, the slot gets a new worker, and the shared memory
the task held is given back as for a SIGKILL. The only difference is the
error: the death record carries ``(job, i, limit)`` of the task timed out,
and that task fails with ``TaskTimeoutError`` (a ``TimeoutError``). Should
the worker have finished it and started the next in the microseconds between
the second read and the signal, that next one fails with ``WorkerLostError``
saying so. The unit is the pool's task: an ``apply`` call, an ``imap`` item at
chunksize 1, a chunk of ``map`` (its items fail together, as a chunk whose
function raises does; pebble's map limits chunks too). ``AsyncResult.get``'s
``timeout`` only stops waiting, as the stdlib's.
"""

from __future__ import annotations

import array
import collections
import fcntl
import gc
import logging
import math
import mmap
import numbers
import os
import pickle
import queue
import reprlib
import select
import signal
import socket
import struct
import sys
import termios
import threading
import time
from multiprocessing import get_context, parent_process, reduction, util
from multiprocessing import pool as mp_pool
from typing import TYPE_CHECKING, Any, TypeVar

import shm_core
import shm_manager

from . import _deaths, _recycle, _stats
from ._alloc import moves, set_shared_allocation
from ._channel import INLINE, Packet, check_openable, loads, recv_fds, recv_raw
from ._hints import add_pickling_hint
from ._progress import chunk_sizes, counted, progress_bar, track_progress
from ._queues import SimpleQueue
from ._reductions import MAX_FDS, init_reductions, tls

DEPTH = 4  # messages sent to a worker's queue and unfinished: the one it runs and the next ones (Note [lost tasks])
BATCH_MAX = 64  # tasks in one message at most (Note [batches])
BATCH_TIME = 0.002  # seconds of work a batch of short tasks is made to hold (Note [batches])
_BATCH_BYTES = INLINE - 4096  # a batch's bodies at most: its head and kind byte fit in the rest of a message
_RESULT = struct.Struct("<qqd")  # a short result's frame: job, index, seconds its task took (Note [batches])
_SHORT_MAX = 4096  # bytes of a short result's message at most
_SHORT_READ = 64  # short results read per system call at most (shm_core.recv_many's limit)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)  # an int: the enum's & costs microseconds
GC_INTERVAL = 0.1  # seconds between full collections in a busy worker (after gc.freeze: only what tasks made) ...
GC_SHARE = 100  # ... or GC_SHARE times the last one's length, so they take at most 1% of its time ...
GC_MAX_INTERVAL = 2.0  # ... but never more than this apart
_IDLE_WAIT = 0.05  # a worker that finds no task within this collects before blocking
_BACKOFF = (0.01, 1.0)  # first and longest wait before a handler retries what failed
_WAKE = "wake"  # the head of the worker handler's nudge to the result handler: deaths were recorded
_STARTED, _START_FAILED = "started", "start failed"  # heads of a worker's start report (Note [start failures])
GRACE = 0.5  # seconds a timed-out task's worker has between SIGTERM and SIGKILL (Note [task timeouts])
_TICK = 0.05  # seconds between the watchdog's checks of the running tasks while any has a limit

log = logging.getLogger("mp_reductions.pool")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

_S = TypeVar("_S")
_R = TypeVar("_R")
# progress=: True, or a dict of tqdm's options (_progress.py)
_Progress = bool | dict[str, Any] | None


class WorkerLostError(Exception):
    """Raised when a pool worker died (a signal, the out-of-memory killer, ``os._exit``)
    while running the task whose result is asked for.

    ``signal_name`` names the signal (``"SIGKILL"``) or is None for an exit code; ``task`` names the function
    (and, for a chunk, its items); ``oom`` is True when the pool's memory cgroup counted an OOM kill meanwhile,
    False when it counted none, None when no counter could be read; ``rss`` is (resident bytes, peak bytes,
    seconds before the death) of the worker's last sample, or None (Note [deaths explained])."""

    def __init__(self, pid: int, exitcode: int | None, index: int, kind: str = "task", task: str | None = None,
                 oom: bool | None = None, rss: tuple | None = None, note: str | None = None):
        self.pid, self.exitcode, self.index, self.kind = pid, exitcode, index, kind
        self.task, self.oom, self.rss, self.note = task, oom, rss, note
        super().__init__(pid, exitcode, index, kind)

    @property
    def signal_name(self) -> str | None:
        return _deaths.signal_name(self.exitcode)

    def death(self) -> str:
        """How the worker ended and what it ran, without the remedy: "worker 12 died with signal SIGSEGV while
        running task 0 of apply (f): a crash in native code: ..."."""
        how, why, _ = _deaths.explain(self.exitcode, self.oom, self.rss)
        task = f" ({self.task})" if self.task else ""
        why = f": {why}" if why else ""
        note = f"; {self.note}" if self.note else ""
        return f"worker {self.pid} {how} while running task {self.index} of {self.kind}{task}{why}{note}"

    def __str__(self) -> str:
        _, _, remedy = _deaths.explain(self.exitcode, self.oom, self.rss)
        return f"{self.death()}; the pool replaced it and goes on with the other tasks; {remedy}"

    def __reduce__(self):
        return type(self), (self.pid, self.exitcode, self.index, self.kind, self.task, self.oom, self.rss, self.note)


class TaskTimeoutError(TimeoutError):
    """Raised when a pool task ran longer than its limit (the pool's ``task_timeout``, or the call's ``timeout``):
    the pool ended the worker running it (SIGTERM, then SIGKILL after ``GRACE`` seconds), replaced it, and went on
    (Note [task timeouts]). A chunk of ``map`` is one task: its items fail together."""

    def __init__(self, limit: float, index: int, kind: str = "task", task: str | None = None, pid: int | None = None):
        super().__init__()
        self.limit, self.index, self.kind, self.task, self.pid = limit, index, kind, task, pid
        self.args = (limit, index, kind, task, pid)

    def __str__(self) -> str:
        task = f" ({self.task})" if self.task else ""
        chunk = "; a chunk is one task: chunksize=1 gives each call its own limit" if "items" in (self.task or "") \
            else ""
        return (f"task {self.index} of {self.kind}{task} ran past its time limit of {self.limit:g} s: the pool "
                f"ended its worker {self.pid} (SIGTERM, then SIGKILL after {GRACE:g} s) and goes on with the other "
                f"tasks{chunk}; make the task faster or split it, or raise the limit (the pool's task_timeout, or "
                "apply_async's timeout)")

    def __reduce__(self):
        return type(self), self.args


def check_timeout(value, name: str) -> float | None:
    """``value`` as a time limit in seconds (None, or inf: no limit); TypeError / ValueError with the remedy."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__}; give the longest "
                        "a task may run, e.g. 30.0, or None for no limit")
    value = float(value)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}; give the longest a task may "
                         "run, e.g. 30.0, or None for no limit")
    return None if math.isinf(value) else value


class WorkerStartError(Exception):
    """Raised when a pool's workers keep dying before they can run a task (its initializer raises, or they cannot
    unpickle their ``initargs``): the pool starts no more workers, and every unfinished task fails."""

    def __init__(self, failures: int, pid: int, exitcode: int | None, method: str | None = None):
        self.failures, self.pid, self.exitcode, self.method = failures, pid, exitcode, method
        super().__init__(failures, pid, exitcode, method)

    def __str__(self) -> str:
        died = (f"{self.failures} pool workers in a row died before they could run a task (the last, {self.pid}, "
                f"exited with code {self.exitcode})")
        if self.method in ("spawn", "forkserver") and self.__cause__ is None and self.exitcode == 1:
            # no initializer error came back: most often the workers died importing the main module
            return (f"{died}, most likely while importing the main module: {self.method} workers import it again "
                    "before they run, and one that makes a pool (or starts processes) at its top level fails "
                    "there (the stdlib's \"bootstrapping phase\" RuntimeError in the workers' tracebacks on stderr). "
                    'Put the code that makes the pool under `if __name__ == "__main__":`. Otherwise a worker could '
                    "not unpickle the initializer or its initargs; the pool starts no more workers")
        return (f"{died}: the initializer raised, or a worker could not unpickle its initargs (the cause, or the "
                "workers' tracebacks on stderr, say which); the pool starts no more workers: fix the initializer "
                "or its arguments and make a new pool")

    def __reduce__(self):
        return type(self), (self.failures, self.pid, self.exitcode, self.method)


# The fork server imports the main module itself as it starts (it preloads __main__), so a script that makes a
# pool at its top level may end the fork server there; where the connection to it is authenticated (3.13.x and
# 3.14 seen here), the start then fails with a broken connection (mp_spawn Note [unguarded main]).
_FORKSERVER_DIED = (
    "the fork server exited before it could start a pool worker. It imports the main module first, and a script "
    "that makes a pool (or starts processes) at its top level fails there (the stdlib's \"bootstrapping phase\" "
    "RuntimeError in its traceback on stderr above). Put the code that makes the pool under "
    '`if __name__ == "__main__":`'
)


# Note [fork server preload]: a forkserver worker is forked from the fork server, so what the server imported
# the worker need not import again. The stdlib's server preloads only the main module (and 3.11-3.13 do not
# even that: the key they pass is not the one the server reads), so every worker imported numpy and this
# package anew: 100-250 ms each before its first task, on top of the stdlib's start. The first forkserver pool
# therefore adds our packages to the preload list, kept as the user set it otherwise, before the server starts
# (once it runs, the list is not read again: a server the stdlib or the user started earlier serves as it is).
# The server imports them at start (an ImportError there is ignored, as for any preload name); a module
# already in that list is not added twice. The server then holds numpy and our modules, as a fork parent does.
_PRELOAD = ("mp_reductions", "arraymp")  # this package, and the facade when it is what made the pool


def _preload_in_fork_server(ctx) -> None:
    """Add our loaded packages to the fork server's preload list before it starts (Note [fork server preload])."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    names = getattr(server, "_preload_modules", None)
    if not isinstance(names, list):
        return
    extra = [n for n in _PRELOAD if n in sys.modules and n not in names]
    if extra:
        ctx.set_forkserver_preload([*names, *extra])

def _kind(result) -> str:
    if isinstance(result, mp_pool.MapResult):
        return "map"
    if isinstance(result, mp_pool.IMapUnorderedIterator):
        return "imap_unordered"
    if isinstance(result, mp_pool.IMapIterator):
        return "imap"
    return "apply"


# a map chunk's function: its first argument is (func, chunk) (undocumented names: not in typeshed's stubs)
_mapstar, _starmapstar = mp_pool.mapstar, mp_pool.starmapstar  # type: ignore[attr-defined]
_STARS = (_mapstar, _starmapstar)


def _describe(result, i: int) -> str | None:
    """The task ``i`` of ``result`` for a message: its function's name, a call's arguments (an ``apply`` with a
    limit), a chunk's items (``map`` with chunksize > 1)."""
    func = getattr(result, "_func", None)
    if func is None:
        return None
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or _SHORT.repr(func)
    args = getattr(result, "_call", None)
    if args is not None:
        return f"{name}{args}"
    chunk, n = getattr(result, "_chunksize", 1), len(getattr(result, "_value", None) or ())
    if chunk > 1 and n:
        return f"{name}, items {i * chunk}-{min((i + 1) * chunk, n) - 1}"
    return name


def _call(args, kwds) -> str:
    """``(1, 'a', key=2)``, each cut short."""
    parts = [_SHORT.repr(a) for a in args] + [f"{k}={_SHORT.repr(v)}" for k, v in kwds.items()]
    return f"({', '.join(parts)})"


class _Clock:
    """The task each slot's worker runs, and when it started as the worker saw it (Note [task timeouts]): per slot
    four int64s [sequence, job, index, start (``time.monotonic_ns``)], in a memfd (no name: nothing to leak)
    mapped by the parent and its workers. The sequence is odd while the worker writes; job -1: idle."""

    def __init__(self, slots: int):
        self.size = max(1, slots) * 32
        self.fd = os.memfd_create("mp-pool-clock", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.words = memoryview(self.map).cast("q")
        for k in range(max(1, slots)):
            self.reset(k)

    def reset(self, k: int) -> None:
        """Slot ``k`` idle: its worker is dead, or not started (a dead one may have left it odd, or running)."""
        w, b = self.words, 4 * k
        w[b] = (w[b] | 1) + 1
        w[b + 1] = -1

    def row(self, k: int) -> _ClockRow:
        return _ClockRow(self, k)

    def read(self, k: int) -> tuple | None:
        """(sequence, job, index, start) of slot ``k``, or None while its worker writes."""
        w, b = self.words, 4 * k
        seq, job, i, t0, again = w[b], w[b + 1], w[b + 2], w[b + 3], w[b]
        return None if seq != again or seq & 1 else (seq, job, i, t0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ClockRow:
    """A worker's row of the _Clock: passed to it as is under fork, by a duplicate of the memfd otherwise."""

    def __init__(self, clock, k: int):
        self.clock, self.k = clock, k

    def __reduce__(self):
        return _rebuild_row, (reduction.DupFd(self.clock.fd), self.clock.size, self.k)

    def writer(self):
        """(words, base) for ``_started`` / ``_idle`` (the parent reset the row before it started this worker)."""
        return self.clock.words, 4 * self.k


class _MappedClock:
    size = 0

    def __init__(self, fd: int, size: int):
        self.fd, self.size = -1, size
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = memoryview(self.map).cast("q")


def _rebuild_row(dupfd, size: int, k: int) -> _ClockRow:
    return _ClockRow(_MappedClock(dupfd.detach(), size), k)


def _started(w, b: int, job, i) -> None:
    if type(job) is int and type(i) is int:  # (a forged head's are not: the task fails as it would)
        w[b] += 1
        w[b + 1], w[b + 2], w[b + 3] = job, i, time.monotonic_ns()
        w[b] += 1


def _idle(w, b: int) -> None:
    w[b] += 1
    w[b + 1] = -1
    w[b] += 1


def _send(sock, head, obj) -> None:
    """Send ``obj`` with its head (``(job, i)``, or None for a stop sentinel) first: see the module docstring."""
    Packet(obj, head=pickle.dumps(head)).send(sock)


def _split(data, fds):
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


def _drain(q) -> None:
    """Take every message queued in ``q`` now, unpickling each so that the shared memory it names is given back."""
    while True:
        try:
            _, body, fds = _split(*recv_raw(q._reader._sock, socket.MSG_DONTWAIT))
        except (EOFError, OSError):  # empty (BlockingIOError), or closed
            return
        if fds is None:  # plain (batches are): it names no shared memory
            continue
        try:
            loads(body, fds, kept=True)
        except Exception:  # the worker would have made it the task's error; nobody waits for it now
            pass


class _Collector:
    """A worker's full garbage collections (see the module docstring): while it is busy, one GC_INTERVAL after the
    last, or GC_SHARE times the last one's length if that is longer (at most GC_MAX_INTERVAL): a worker whose tasks
    keep a large heap alive (a cache, a table made on first use) spent 10-20 ms per collection of it every 0.1 s.
    When idle, as soon as one is due (at least _IDLE_WAIT after its last task), then it blocks."""

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


def _next_task(reader, waiter, collector: _Collector):
    """The next task as _split's; collect garbage first when none comes before a collection is due; EOFError once
    the pool's process is gone (``waiter`` polls the reader and the parent's sentinel). The receive never blocks:
    the parent may take back the message that woke the poll (Note [lost tasks])."""
    sock = reader._sock
    while True:
        try:
            return _split(*recv_raw(sock, socket.MSG_DONTWAIT))  # as a rule the next one is queued already
        except BlockingIOError:
            pass
        events = waiter.poll(collector.idle_wait_ms()) if collector.dirty else None
        if not events:
            if collector.dirty:
                collector.collect()
            events = waiter.poll()
        if not any(fd == sock.fileno() and ev & select.POLLIN for fd, ev in events):
            raise EOFError("the pool's process is gone")


def worker(inqueue, outqueue, initializer=None, initargs=(), maxtasks=None, wrap_exception=False, group=None,
           short=None, shared_results=False, clock=None, reader=None):
    """The stdlib's pool worker on its own slot's queue, plus the group, the heads, batches, short results
    (sent on ``short``, Note [batches]), results born in shared memory (``shared_results``: Note [shared
    allocation]), the running task on ``clock`` (Note [task timeouts]), the garbage collections, and the
    in-flight counts of its results told to the daemon as sent to ``reader``, the pool's process (_reductions
    Note [results told])."""
    if maxtasks is not None and not (isinstance(maxtasks, int) and maxtasks >= 1):
        raise AssertionError(f"Maxtasks {maxtasks!r} is not valid")
    if group is not None:
        shm_manager.join_group(group)  # see Note [group]
    init_reductions()
    prepare_worker(shared_results)
    out = outqueue._writer._sock
    inqueue._writer.close()
    outqueue._reader.close()
    if short is not None:
        short._reader.close()
        short = short._writer._sock
    waiter = select.poll()
    waiter.register(inqueue._reader.fileno(), select.POLLIN)
    if parent_process() is not None:
        waiter.register(parent_process().sentinel, select.POLLIN)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as e:  # Note [start failures]
            try:
                _send(out, _START_FAILED, (os.getpid(), mp_pool.ExceptionWithTraceback(e, e.__traceback__)))
            except Exception:  # unpicklable: the traceback on stderr says it
                pass
            raise
    words, base = clock.writer() if clock is not None else (None, 0)
    _send(out, _STARTED, os.getpid())
    gc.freeze()  # what it has now lives as long as it does: collections look at what tasks made only

    completed, collector = 0, _Collector()
    while maxtasks is None or completed < maxtasks:
        try:
            head, body, fds = _next_task(inqueue._reader, waiter, collector)
        except (EOFError, OSError):  # a task it could not receive stays in the slot for the replacement
            util.debug("worker got EOFError or OSError -- exiting")
            break
        if head is None:
            util.debug("worker got sentinel -- exiting")
            break
        for (job, i), task, task_fds in _unbatch(head, body, fds):
            body = fds = None
            if words is not None:
                _started(words, base, job, i)
            t0 = time.perf_counter()
            result = _run(task, task_fds, wrap_exception)
            now = time.perf_counter()  # one clock for the task's time and the collections'
            if words is not None:
                _idle(words, base)  # before its result goes: a result sent is never timed out
            _send_result(out, short, job, i, now - t0, result, reader)
            task = task_fds = result = None
            completed += 1
            collector.after_task(now)
        head = body = fds = None
    gc.collect()
    util.debug(f"worker exiting after {completed} tasks")


OOM_STEP = 500  # added to a worker's oom_score_adj (Note [out of memory])


# Note [out of memory]: when memory runs out (the machine's or a memory cgroup's), the kernel kills the process
# with the highest badness: its resident and shared pages, plus oom_score_adj thousandths of the memory. The memory of
# a killed worker's shared segments cannot be reaped at once as private memory can, so the kernel may pick a second
# victim before the first one's exit frees it: left to size, the process holding the pool. Every worker raises its
# own oom_score_adj by OOM_STEP (at most 1000; raising it needs no privilege), so any worker outranks its parent by
# half the memory, however small the worker: the victims are workers, the task fails with WorkerLostError and the
# caller goes on. A worker's children inherit the raised score.
def prepare_worker(shared_results: bool) -> None:
    """What a pool's worker (ours, or the executor's) does first: its arrays of 1 MiB or more born in shared
    memory and private (``shared_results``: _alloc Note [moving results]) or numpy's (False too: a fork child
    inherits its parent's setting), and the out-of-memory killer's first choice before its parent (Note [out of
    memory])."""
    set_shared_allocation(shared_results, private=True)
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            score = int(f.read())
            f.seek(0)
            f.write(str(min(1000, score + OOM_STEP)))
    except (OSError, ValueError):  # no procfs: the kernel picks by size alone
        pass


def _send_result(out, short, job, i, seconds: float, result: tuple, reader: int | None = None) -> None:
    """Send one task's result: on ``short`` framed by _RESULT if it is plain and small, else on ``out`` with the
    head (job, i, seconds) (Note [batches]); its in-flight counts told as sent to ``reader`` (_reductions Note
    [results told])."""
    packet = None
    try:
        head = pickle.dumps((job, i, seconds))
        tls.to = reader
        try:
            packet = Packet(result, head=head, moves=moves(result))
        finally:
            tls.to = None
        if short is not None and packet.plain and len(packet.buffers[1]) - len(head) <= _SHORT_MAX - _RESULT.size \
                and type(job) is int and type(i) is int:
            short.sendmsg([_RESULT.pack(job, i, seconds), memoryview(packet.buffers[1])[len(head):]])
            packet.sent_along()
            _stats.counts[_stats.MESSAGES_SENT] += 1
        else:
            packet.send(out)
    except Exception as e:
        if packet is not None:  # made but not sent: what it holds goes back
            packet.discard()
        wrapped = _encoding_error(e, result[1])
        util.debug(f"Possible encoding error while sending result: {wrapped}")
        _send(out, (job, i, seconds), (False, wrapped))


def _run(body, fds, wrap_exception: bool) -> tuple:
    """One task's result, ``(True, value)`` or ``(False, exception)``, as the stdlib's worker makes it."""
    func = None
    try:
        _, _, func, args, kwds = loads(body, fds, kept=True)  # Note [kept counts]
        body = None
        return True, func(*args, **kwds)
    except Exception as e:
        if wrap_exception and func is not mp_pool._helper_reraises_exception:  # type: ignore[attr-defined]
            e = mp_pool.ExceptionWithTraceback(e, e.__traceback__)  # type: ignore[attr-defined]
        return False, e


def _unbatch(head, body, fds):
    """The tasks of one message as ((job, i), body, fds): a batch's one by one (Note [batches])."""
    if type(head) is not list:
        yield head, body, fds
        return
    start = 0
    for task, n in head:
        yield task, body[start:start + n], None
        start += n


def _message(items: list[tuple]) -> list:
    """The buffers of one message holding ``items`` ((job, i), Packet made with the head (job, i), the head's
    length): one as it is, or plain ones as a batch, whose head is ``[((job, i), length of its pickle), ...]``
    (Note [batches])."""
    if len(items) == 1:
        return items[0][1].buffers
    bodies = [memoryview(packet.buffers[1])[n:] for _, packet, n in items]
    return [b"P", pickle.dumps([(task, len(body)) for (task, _, _), body in zip(items, bodies, strict=True)]),
            *bodies]


def _encoding_error(exc: Exception, value) -> mp_pool.MaybeEncodingError:  # type: ignore[name-defined]
    """The stdlib's MaybeEncodingError, its value's repr cut short: its reason comes last in its message, and must
    not be buried after a screenful of arrays."""
    error = mp_pool.MaybeEncodingError(exc, None)  # type: ignore[attr-defined]
    error.value = _SHORT.repr(value)
    error.args = (error.exc, error.value)
    return error


_SHORT = reprlib.Repr()
_SHORT.maxother = _SHORT.maxstring = 200


def _queued_bytes(q) -> int:
    """Bytes of the messages queued in ``q`` (SIOCINQ sums every queued message on a seqpacket socket)."""
    n = array.array("i", [0])
    fcntl.ioctl(q._reader.fileno(), termios.FIONREAD, n)
    return n[0]


def _queued(sent, left: int) -> int:
    """How many of a slot's unfinished messages (``sent``, in the order sent) are still queued, ``left`` bytes in
    all: the last ones (Note [lost tasks])."""
    n = size = 0
    while n < len(sent) and size + sent[-1 - n][1] <= left:
        size += sent[-1 - n][1]
        n += 1
    return n


def _bytes(items: list[tuple]) -> bytes:
    """The bytes of the message that holds ``items`` (as _message makes it)."""
    return b"".join(map(bytes, _message(items)))


class _Slots:
    """The workers' own task queues, the tasks each holds, and the deaths to settle (Note [lost tasks]).

    Passed where the stdlib passes the inqueue; ``put`` is the task handler's ``put``.
    """

    method = None  # the pool's start method (its WorkerStartError names the likely cause by it)

    def __init__(self, processes: int, cache, batches: bool = True, shared_results: bool = True,
                 daemon: bool = True):
        self.cache = cache
        self.shared_results = shared_results  # the workers' arrays are born in shared memory (Note [shared allocation])
        self.daemon = daemon  # the workers are daemonic processes (the stdlib Pool's are; the executor's are not)
        self.lock = threading.Lock()  # taken directly where no one waits: a Condition's with costs more
        self.cond = threading.Condition(self.lock)
        self.queues: list[SimpleQueue[Any]] = [SimpleQueue() for _ in range(processes)]
        self.short: SimpleQueue[Any] = SimpleQueue()  # the workers' short results (Note [batches])
        self.workers: list = [None] * processes  # the Process serving each slot, None while it has none
        # per slot, its unfinished messages in the order sent: [the (job, i)s not finished yet, bytes, its ready
        # entries (a batch's, to send again those a dead worker never started: Note [batches])]
        self.sent: list[collections.deque] = [collections.deque() for _ in range(processes)]
        self.owner: dict[tuple, int] = {}  # unfinished (job, i) -> its slot
        self.deaths: list[tuple] = []  # (slot, pid, exitcode, the messages it took), to settle
        # pickled tasks, sent as slots have room: ((job, i), its Packet made with the head (job, i), the head's
        # length); their weight is 1 for a plain one (_channel Note [plain messages]), BATCH_MAX for one holding
        # shared memory (Note [batches])
        self.ready: collections.deque = collections.deque()
        self.weight, self.ready_max, self.waiting = 0, DEPTH * BATCH_MAX * processes, False
        self.batches = batches  # False: one task per message (workers that retire after maxtasksperchild)
        self.per_task: float | None = None  # seconds a task takes in a worker, as workers report (Note [batches])
        self.n = 1  # tasks a batch is made of: about BATCH_TIME of work
        self.failed: list[tuple] = []  # (job, i, error): a task that could not be sent
        self.closed = self.stopped = False
        self.broken: WorkerStartError | None = None  # set once workers keep failing to start (Note [start failures])
        # Note [task timeouts] and Note [deaths explained]
        self.clock = _Clock(processes)
        self.task_timeout: float | None = None  # the pool's limit on a task's seconds
        self.timed: set[int] = set()  # jobs with a limit of their own (apply_async's timeout), unfinished
        self.timed_out: dict[int, tuple] = {}  # pid -> (job, i, limit): ended by the watchdog, death not recorded
        self.ending: dict[int, tuple] = {}  # pid -> (Process, when it was sent SIGTERM): SIGKILL after GRACE
        self.watching = threading.Event()  # set: the watchdog looks now (a call with a limit came) or stops
        self.unwatched = False  # the watchdog stops
        self.sampler = _deaths.Sampler()
        self.oom = _deaths.OomCounter()
        self.oom_base: dict[int, tuple] = {}  # pid -> (its cgroup's OomCounter, the count when it started)
        self.senders: set[int] = set()  # workers started, not yet done with (_reductions Note [results told])
        self.named = None  # the last job whose function the task handler recorded
        self.inputs: dict | None = None  # that job's table of inputs sent (_reductions Note [inputs once per call])

    def put(self, task) -> None:
        """Pickle ``task`` and add it to the ready ones (sent at once if a slot has room, else by the result
        handler as soon as one does), waiting while they weigh ``ready_max``; None: stop every worker."""
        if task is None:
            with self.lock:
                if not (self.stopped or self.closed):
                    self.stopped = True
                    for q in self.queues:
                        _send(q._writer._sock, None, None)
            return
        job, i = task[:2]
        if job != self.named:  # the function, for messages about the job's tasks (_describe)
            self.named = job
            result = self.cache.get(job)
            if result is not None:
                result._func = task[3][0][0] if task[2] in _STARS else task[2]
            self.inputs = self.cache.inputs.setdefault(job, {}) if isinstance(
                result, (mp_pool.MapResult, mp_pool.IMapIterator)) else None  # _reductions Note [inputs once per call]
        head = pickle.dumps((job, i))
        try:
            packet = Packet(task, head=head, inputs=self.inputs)  # may raise: the stdlib makes it the task's error
        except Exception as e:
            add_pickling_hint(e, task)  # a lambda: say what to do
            raise
        weight = 1 if packet.plain else BATCH_MAX
        with self.lock:
            while not self.closed and self.broken is None and self.weight >= self.ready_max:
                self.waiting = True
                self.cond.wait()
            if self.closed:
                packet.discard()
            elif self.broken is not None:  # checked under the lock: break_ fails the ready tasks once, before
                packet.discard()
                self.failed.append((job, i, self.broken))
            else:
                self.ready.append(((job, i), packet, len(head)))
                self.weight += weight
                if min(map(len, self.sent)) < DEPTH:  # else no slot takes it now
                    self._send_ready()
        self.settle_failed()

    def _send_ready(self) -> None:
        """Send ready tasks to the slots holding fewest unfinished messages while they hold fewer than DEPTH (the
        lock held), each message one task or a batch (Note [batches]); with none ready, move to a slot holding
        none a message queued behind a running one."""
        while True:
            lengths = list(map(len, self.sent))
            k = lengths.index(min(lengths))
            if not self.ready:
                if not self.sent[k]:
                    self._take_back(k)
                return
            if len(self.sent[k]) >= DEPTH:
                return
            items = self._take_batch(min(self.n, -(-len(self.ready) // len(self.queues))))
            if self.waiting and self.weight <= self.ready_max // 2:
                self.waiting = False
                self.cond.notify()  # the task handler pickles the next ones in a burst, not one by one
            buffers = _message(items)
            try:  # never blocks: the queue holds DEPTH messages
                if len(items) == 1:
                    items[0][1].send(self.queues[k]._writer._sock, kept=True)  # Note [kept counts]
                else:
                    shm_core.send_fds(self.queues[k]._writer._sock, buffers)
                    for _, packet, _ in items:
                        packet.sent_along()
                    _stats.counts[_stats.MESSAGES_SENT] += 1
            except Exception as e:
                for task, packet, _ in items:
                    packet.discard()
                    self.failed.append((*task, e))
                continue
            size = sum(memoryview(b).nbytes for b in buffers)
            tasks = collections.deque(task for task, _, _ in items)
            self.sent[k].append([tasks, size, items])
            for task in tasks:
                self.owner[task] = k

    def _take_batch(self, n: int) -> list[tuple]:
        """The ready tasks for the next message (the lock held): one holding shared memory, or up to ``n``
        plain ones."""
        first = self.ready.popleft()
        if not first[1].plain:
            self.weight -= BATCH_MAX
            return [first]
        items, size = [first], len(first[1].buffers[1])
        while len(items) < n and self.ready and self.ready[0][1].plain:
            size += len(self.ready[0][1].buffers[1])
            if size > _BATCH_BYTES:
                break
            items.append(self.ready.popleft())
        self.weight -= len(items)
        return items

    def settle_failed(self) -> None:
        """Fail the tasks that could not be sent with their error (the stdlib's task handler does so too). Each
        thread that sends calls this after sending: it sees its own failures without the lock."""
        if not self.failed:
            return
        with self.lock:
            failed, self.failed = self.failed, []
        for job, i, e in failed:
            result = self.cache.get(job)
            if result is not None:
                result._set(i, (False, e))

    def _take_back(self, k: int) -> None:
        """Move to slot ``k`` the first message not taken yet of a slot whose worker runs another (the lock
        held)."""
        for w, sent in enumerate(self.sent):
            queued = _queued(sent, _queued_bytes(self.queues[w])) if len(sent) > 1 else 0
            if not 0 < queued < len(sent):  # none queued, or none taken yet: its worker is about to take one
                continue
            try:
                data, fds, _ = recv_fds(self.queues[w]._reader._sock, INLINE + 16, MAX_FDS + 1, socket.MSG_DONTWAIT)
            except OSError:  # its worker took them (BlockingIOError), or no descriptor free: they stay
                continue
            # the first one still queued: its worker may have taken some more meanwhile, in order
            n = next((n for n in range(len(sent) - queued, len(sent)) if _bytes(sent[n][2]) == data), None)
            if n is None:
                for fd in fds:
                    os.close(fd)
                raise AssertionError(f"a message taken back from slot {w} is none of those it was sent")
            message = sent[n]
            del sent[n]
            try:
                shm_core.send_fds(self.queues[k]._writer._sock, [data], fds)  # unchanged, counts and all
            except OSError as e:
                for task in message[0]:
                    del self.owner[task]
                    self.failed.append((*task, e))
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            self.sent[k].append(message)
            for task in message[0]:
                self.owner[task] = k
            return

    def _finish(self, task, k: int | None) -> bool | None:
        """Mark ``task`` finished if it is unfinished (and in slot ``k`` if given): whether that finished its
        message, None if it was not unfinished (the lock held; the caller sends ready tasks after)."""
        k2 = self.owner.get(task)
        if k2 is None or (k is not None and k2 != k):
            return None
        del self.owner[task]
        sent = self.sent[k2]
        for n, (tasks, _, _) in enumerate(sent):  # a worker runs its tasks in order: the first, as a rule
            if tasks[0] == task:
                tasks.popleft()
            elif task in tasks:
                tasks.remove(task)
            else:
                continue
            if tasks:
                return False
            _settle(sent[n])
            del sent[n]
            return True
        raise AssertionError(f"task {task} owned by slot {k2} is in none of its messages")

    def results(self, done: list[tuple]) -> list[bool]:
        """Mark the tasks whose results came finished, ``done`` holding ((job, i), seconds its worker says it
        took) each (Note [batches]): for each, whether it was unfinished (else it was settled already)."""
        with self.lock:
            known, room, per_task = [], False, self.per_task
            for task, seconds in done:
                finished = self._finish(task, None)
                known.append(finished is not None)
                room = room or bool(finished)
                if finished is not None and type(seconds) is float:
                    per_task = seconds if per_task is None else 0.75 * per_task + 0.25 * seconds
            if self.batches and per_task is not None:
                self.per_task = per_task
                self.n = max(1, min(BATCH_MAX, int(BATCH_TIME / max(per_task, 1e-9))))
            if room:  # a message finished: its slot has room
                self._send_ready()
            return known

    def exited(self, w) -> None:
        """Record the death of ``w`` (reaped) with the messages it took (Note [lost tasks])."""
        with self.lock:
            k = self.workers.index(w)
            self.workers[k] = None
            self.clock.reset(k)  # its task is over: the watchdog looks at the slot's next worker only
            taken = list(self.sent[k])
            del taken[len(taken) - _queued(taken, _queued_bytes(self.queues[k])):]
            # how it died (Note [deaths explained]): a timeout of ours, the OOM killer, its last resident size
            self.ending.pop(w.pid, None)
            timed = self.timed_out.pop(w.pid, None)
            counter, base = self.oom_base.pop(w.pid, (self.oom, None))
            oom = counter.claim(base) if w.exitcode == -signal.SIGKILL and timed is None else None
            self.deaths.append((k, w.pid, w.exitcode, taken, (timed, oom, self.sampler.forget(w.pid))))

    def starting(self, k: int):
        """The OOM count before slot ``k``'s new worker starts, and its clock row (Note [deaths explained])."""
        return self.oom.read(), self.clock.row(k)

    def started(self, w, oom_base) -> None:
        pid = getattr(w, "pid", None)  # (a Process class of the caller's may have none: the stdlib's suite's)
        if pid is None:
            return
        self.senders.add(pid)
        counter = self.oom.of(pid)  # its cgroup's: the pool's as a rule (Note [deaths explained])
        self.oom_base[pid] = (counter, oom_base if counter is self.oom else counter.read())

    def watch(self) -> None:
        """The watchdog thread: ends the workers of tasks past their limit, samples the workers' resident size
        (Note [task timeouts], Note [deaths explained])."""
        while not self.unwatched:
            limited = self.task_timeout is not None or self.timed or self.ending
            self.watching.wait(_TICK if limited else _deaths.RSS_INTERVAL)
            self.watching.clear()
            if self.unwatched:
                return
            now = time.monotonic()
            if limited:
                try:
                    self._time_out(time.monotonic_ns())
                    self._kill_late(now)
                except Exception:  # never dies: a stuck task would hang its caller again
                    log.exception("the pool's watchdog failed to end a task past its limit")
            if self.sampler.due(now):
                self.sampler.sample([w.pid for w in list(self.workers) if w is not None], now)

    def _time_out(self, now_ns: int) -> None:
        """SIGTERM to each worker whose task runs past its limit, as its clock row says."""
        for k, w in enumerate(list(self.workers)):
            if w is None or w.pid in self.timed_out:
                continue
            got = self.clock.read(k)
            if got is None or got[1] < 0:
                continue
            _, job, i, t0 = got
            limit = getattr(self.cache.get(job), "_limit", None) or self.task_timeout
            if limit is None or now_ns - t0 < limit * 1e9:
                continue
            with self.lock:  # its death is not recorded meanwhile: the pid is still its own
                popen = getattr(w, "_popen", None)
                if self.workers[k] is not w or popen is None or popen.returncode is not None \
                        or self.clock.read(k) != got:  # it finished (and may run another): look again
                    continue
                self.timed_out[w.pid] = (job, i, limit)
                self.ending[w.pid] = (w, time.monotonic())
                try:
                    os.kill(w.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _kill_late(self, now: float) -> None:
        """SIGKILL to each worker sent SIGTERM GRACE seconds ago and not dead yet."""
        for pid, (w, when) in list(self.ending.items()):
            if now - when < GRACE:
                continue
            with self.lock:
                popen = getattr(w, "_popen", None)
                if self.ending.pop(pid, None) is not None and popen is not None and popen.returncode is None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def unwatch(self) -> None:
        self.unwatched = True
        self.watching.set()

    def lost(self, k: int, taken: list) -> tuple | None:
        """Settle the death of slot ``k``'s worker, which took the messages ``taken``, once every result it sent
        is read: the task it was running (its first unfinished one) is lost, and returned; those after it in
        its batch, never started, are ready again, first in line (Note [batches])."""
        with self.lock:
            items = {item[0]: item for message in taken for item in message[2]}
            unfinished = [task for message in taken for task in message[0]]
            running, again = None, []
            for task in unfinished:
                if self._finish(task, k) is None:
                    continue
                if running is None:
                    running = task
                elif not self.closed:
                    again.append(items[task])
            self.ready.extendleft(reversed(again))
            self.weight += len(again)
            self._send_ready()
            return running

    def break_(self, error: WorkerStartError) -> None:
        """Workers keep failing to start: fail every unfinished task and every later one with ``error``."""
        with self.lock:
            self.broken = error
            while self.ready:
                (job, i), packet, _ = self.ready.popleft()
                packet.discard()
                self.failed.append((job, i, error))
            self.weight = 0
            for (job, i) in list(self.owner):
                del self.owner[job, i]
                self.failed.append((job, i, error))
            # no worker starts again to take the messages queued (one still alive that takes one maps it while
            # the caller's array holds it, else fails a task failed already)
            self._settle_sent()
            self.cond.notify_all()
        self.settle_failed()

    def done_with(self, pids) -> None:
        """Every result the workers ``pids`` (dead, or all of them once the pool is joined) sent is read: the counts
        they told the daemon of and the pool never took go back (_reductions Note [results told])."""
        pids = [pid for pid in pids if pid in self.senders]
        if pids:
            self.senders.difference_update(pids)
            shm_manager.done_with(pids)

    def take_deaths(self) -> list[tuple]:
        """The deaths recorded (none without the lock: the worker handler nudges the result handler after it
        records one, so one missed here is read at its next wake)."""
        if not self.deaths:
            return []
        with self.lock:
            deaths, self.deaths = self.deaths, []
            return deaths

    def close(self) -> None:
        """No more tasks: discard the ready ones, and wake the task handler, which discards the one it holds."""
        with self.lock:
            self.closed = True
            while self.ready:
                self.ready.popleft()[1].discard()
            self.weight = 0
            self.cond.notify_all()

    def drain(self) -> None:
        """Give back the shared memory of the tasks left in the slots (the workers are gone)."""
        for q in self.queues:
            _drain(q)
        with self.lock:
            self._settle_sent()

    def _settle_sent(self) -> None:
        """Forget every message sent (the lock held): no worker will take one again (Note [kept counts])."""
        for sent in self.sent:
            for message in sent:
                _settle(message)
        self.sent = [collections.deque() for _ in self.sent]


def _settle(message: list) -> None:
    """A message sent to a slot is done with: its packet gives back the counts it kept (Note [kept counts])."""
    items = message[2]
    if len(items) == 1:  # (a batch is of plain tasks: nothing kept)
        items[0][1].settle()


def _loss(pid: int, exitcode, running: tuple, result, how: tuple) -> Exception:
    """The error of the task ``running`` (job, i) of ``result``, whose worker ``pid`` died ``how`` (as
    ``_Slots.exited`` records it): TaskTimeoutError if the watchdog ended it for that task, else WorkerLostError."""
    timed, oom, rss = how
    kind, task = _kind(result), _describe(result, running[1])
    if timed is not None and tuple(timed[:2]) == tuple(running):
        _stats.count("task_timeouts")
        return TaskTimeoutError(timed[2], running[1], kind, task, pid)
    _stats.count("worker_deaths")
    note = None
    if timed is not None:  # it finished the timed-out task and started this one as the SIGTERM went
        note = f"the pool ended it as task {timed[1]} ran past its {timed[2]:g} s limit and this one started"
    return WorkerLostError(pid, exitcode, running[1], kind, task, oom, rss, note)


def _backoff(delay: float | None) -> float:
    return _BACKOFF[0] if delay is None else min(2 * delay, _BACKOFF[1])


class _Cache(mp_pool._PoolCache):  # type: ignore[name-defined]  # undocumented
    """The stdlib's cache of pending results, which wakes the worker handler when it empties only once ``closing``
    (see the module docstring)."""

    closing = False

    def __init__(self, *args, **kwds):
        super().__init__(*args, **kwds)
        self.inputs: dict = {}  # job -> the unshared arrays its messages sent (_reductions Note [inputs once per call])

    def __delitem__(self, item):
        dict.__delitem__(self, item)
        self.inputs.pop(item, None)
        if not self and self.closing:
            self.notifier.put(None)


_setting = threading.Lock()  # _Done.set's: sets of different results never wait long for one another


class _Done:
    """``threading.Event`` for one result (is_set / set / wait), ~10 times cheaper to make and use: the Event's
    Condition costs ~4 us to make, as much as the rest of an ``apply_async``. A lock held from creation until
    ``set``: a waiter acquires it once set (or times out), then releases it for the next waiter."""

    __slots__ = ("_lock", "_flag")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with _setting:  # once: a second set must not release a waiter's hold
            if self._flag:
                return
            self._flag = True
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._flag and self._lock.acquire(True, -1 if timeout is None else max(timeout, 0)):
            self._lock.release()
        return self._flag


class _ApplyResult(mp_pool.ApplyResult):
    """The stdlib's ApplyResult (its __init__ is 3.10-3.13's) with a _Done for its Event."""

    _limit: float | None = None  # seconds: the call's own limit (Note [task timeouts])
    _call: str | None = None  # its arguments, cut short, for TaskTimeoutError's message (only with a limit)

    def __init__(self, pool, callback, error_callback):
        self._pool = pool
        self._event = _Done()
        self._job = next(mp_pool.job_counter)
        self._cache = pool._cache
        self._callback = callback
        self._error_callback = error_callback
        self._cache[self._job] = self

    def _set(self, i, obj):
        pool = self._pool  # (the stdlib's _set forgets it)
        if self._limit is not None and pool is not None:
            pool._inqueue.timed.discard(self._job)
        super()._set(i, obj)


class Pool(mp_pool.Pool):
    """``multiprocessing.pool.Pool`` whose arrays travel by shared memory and which survives dead workers.

    ``context`` chooses the start method (any ``multiprocessing`` context);
    the queues are always ours. A worker that dies while running a task fails
    that task's result with :class:`WorkerLostError` and is replaced.
    ``shared_results`` (default True): arrays of 1 MiB or more that the
    workers make are born in shared memory, so results come back with no copy
    (``shared_allocation``; off under the file_system strategy). ``daemon``
    (default True, as the stdlib's): whether the workers are daemonic
    processes; with False they may start processes of their own, as
    ``concurrent.futures``' workers can (arraymp's executor).
    ``task_timeout`` (seconds, default None: no limit): a task still running
    after that long has its worker ended (SIGTERM, then SIGKILL after
    ``GRACE`` seconds) and fails with :class:`TaskTimeoutError`; the worker is
    replaced. ``apply_async(..., timeout=)`` sets one call's limit. A chunk of
    ``map`` is one task (Note [task timeouts]). ``AsyncResult.get(timeout)``
    keeps the stdlib's meaning: it only stops waiting.
    """

    def __init__(self, processes: int | None = None, initializer: Callable[..., object] | None = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: int | None = None, context: Any = None, *,
                 shared_results: bool = True, daemon: bool = True, task_timeout: float | None = None) -> None:
        # The stdlib's __init__ (3.10-3.13 alike), with this class's handlers as the threads' targets.
        self._pool: list = []
        self._state = mp_pool.INIT
        task_timeout = check_timeout(task_timeout, "task_timeout")
        init_reductions()
        self._ctx = context or get_context()
        self._taskqueue: queue.SimpleQueue = queue.SimpleQueue()
        self._change_notifier: SimpleQueue = SimpleQueue()
        self._cache = _Cache(notifier=self._change_notifier)
        self._maxtasksperchild = maxtasksperchild
        self._initializer = initializer
        self._initargs = initargs
        self._shared_results = bool(shared_results)
        self._daemon = bool(daemon)

        if processes is None:
            processes = getattr(os, "process_cpu_count", os.cpu_count)() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None:
            if not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0:
                raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")

        self._processes = processes
        self._setup_queues()
        self._inqueue.task_timeout = task_timeout
        try:
            self._repopulate_pool()  # type: ignore[attr-defined]  # (private: tests/test_private_stdlib.py)
        except Exception:
            for p in self._pool:
                if p.exitcode is None:
                    p.terminate()
            for p in self._pool:
                p.join()
            raise

        cls = type(self)
        self._worker_handler = self._thread(cls._handle_workers, (
            self._cache, self._taskqueue, self._ctx, self.Process, self._processes, self._pool, self._inqueue,
            self._outqueue, self._initializer, self._initargs, self._maxtasksperchild, self._wrap_exception,  # type: ignore[attr-defined]
            self._get_sentinels(), self._change_notifier))
        self._task_handler = self._thread(cls._handle_tasks, (  # type: ignore[attr-defined]
            self._taskqueue, self._quick_put, self._outqueue, self._pool, self._cache))
        self._result_handler = self._thread(cls._handle_results, (self._outqueue, self._inqueue, self._cache))
        self._watchdog = threading.Thread(target=self._inqueue.watch, daemon=True, name="Pool watchdog")
        self._watchdog.start()
        self._terminate = util.Finalize(
            self, self._terminate_pool,
            args=(self._taskqueue, self._inqueue, self._outqueue, self._pool, self._change_notifier,
                  self._worker_handler, self._task_handler, self._result_handler, self._cache),
            exitpriority=15)
        self._state = mp_pool.RUN

    def apply_async(self, func: Callable[..., _R], args: Iterable[Any] = (),
                    kwds: Mapping[str, Any] = {},  # noqa: B006 (the stdlib's)
                    callback: Callable[[_R], object] | None = None,
                    error_callback: Callable[[BaseException], object] | None = None, *,
                    timeout: float | None = None) -> mp_pool.ApplyResult[_R]:
        """The stdlib's, with an _ApplyResult; ``timeout``: this call's limit in seconds instead of the pool's
        ``task_timeout`` (Note [task timeouts]). The result's ``get(timeout)`` only stops waiting, as the stdlib's."""
        limit = check_timeout(timeout, "timeout")
        self._check_running()  # type: ignore[attr-defined]
        result = _ApplyResult(self, callback, error_callback)
        if limit is not None or self._inqueue.task_timeout is not None:
            result._call = _call(args, kwds)  # for its TaskTimeoutError
        if limit is not None:
            result._limit = limit
            self._inqueue.timed.add(result._job)
            self._inqueue.watching.set()  # the watchdog looks every _TICK from now
        self._taskqueue.put(([(result._job, 0, func, args, kwds)], None))
        return result

    def apply(self, func: Callable[..., _R], args: Iterable[Any] = (), kwds: Mapping[str, Any] = {}, *,  # noqa: B006
              timeout: float | None = None) -> _R:
        """The stdlib's; ``timeout`` as ``apply_async``'s."""
        return self.apply_async(func, args, kwds, timeout=timeout).get()

    def close(self) -> None:
        self._cache.closing = True  # before close's own wake of the worker handler
        super().close()

    def join(self) -> None:
        super().join()
        self._inqueue.unwatch()  # every worker is gone
        self._inqueue.done_with(list(self._inqueue.senders))  # and the result handler read all they sent
        _recycle.release_all()  # the message segments this process keeps for reuse go with the pool

    # The stdlib's maps (3.11-3.14 alike), plus ``progress``: a tqdm bar advanced as results arrive (_progress.py).
    # Without it, each is the stdlib's own.

    def map(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = None, *,
            progress: _Progress = None) -> list[_R]:
        """The stdlib's; ``progress=True`` (or a dict of tqdm's options, e.g. ``{"desc": "fit"}``) draws a progress
        bar on stderr where it is a terminal."""
        return self._map_async(func, iterable, _mapstar,
                               chunksize, progress=progress).get()

    def starmap(self, func: Callable[..., _R], iterable: Iterable[Iterable[Any]], chunksize: int | None = None, *,
                progress: _Progress = None) -> list[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, _starmapstar,
                               chunksize, progress=progress).get()

    def map_async(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = None,
                  callback: Callable[[list[_R]], object] | None = None,
                  error_callback: Callable[[BaseException], object] | None = None, *,
                  progress: _Progress = None) -> mp_pool.MapResult[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, _mapstar,
                               chunksize, callback, error_callback,
                               progress=progress)

    def starmap_async(self, func: Callable[..., _R], iterable: Iterable[Iterable[Any]], chunksize: int | None = None,
                      callback: Callable[[list[_R]], object] | None = None,
                      error_callback: Callable[[BaseException], object] | None = None, *,
                      progress: _Progress = None) -> mp_pool.MapResult[_R]:
        """The stdlib's, with ``progress`` as ``map``'s."""
        return self._map_async(func, iterable, _starmapstar,
                               chunksize, callback, error_callback,
                               progress=progress)

    def _map_async(self, func, iterable, mapper, chunksize=None, callback=None, error_callback=None, *,
                   progress=None):
        self._check_running()
        if not hasattr(iterable, "__len__"):
            iterable = list(iterable)
        if chunksize is None:
            # The stdlib's rule, by the pool's size, not by its list of workers (``len(self._pool)``, as the stdlib
            # does), which is empty while every worker is dead and none replaced yet, or for good once the pool
            # is broken (Note [start failures]): the stdlib's division by it raised ZeroDivisionError there.
            chunksize, extra = divmod(len(iterable), self._processes * 4)
            if extra:
                chunksize += 1
        if len(iterable) == 0:
            chunksize = 0
        if progress is None or progress is False:
            return super()._map_async(func, iterable, mapper, chunksize, callback, error_callback)
        bar = progress_bar(progress, len(iterable))  # before the result: ImportError without tqdm
        task_batches = mp_pool.Pool._get_tasks(func, iterable, chunksize)
        result = mp_pool.MapResult(self, chunksize, len(iterable), callback, error_callback=error_callback)
        track_progress(result, bar, chunk_sizes(len(iterable), chunksize))
        self._taskqueue.put((self._guarded_task_generation(result._job, mapper, task_batches), None))
        return result

    # Iterator, not the stdlib's IMapIterator: with progress and a chunksize above 1 the chunks' items come from a
    # generator (_imap)
    def imap(self, func: Callable[[_S], _R], iterable: Iterable[_S], chunksize: int | None = 1, *,  # type: ignore[override]
             progress: _Progress = None) -> Iterator[_R]:
        """The stdlib's, with ``progress`` as ``map``'s (its total unknown until the iterable is read to its end,
        where it has no ``len``)."""
        if progress is None or progress is False:
            return super().imap(func, iterable, chunksize)
        return self._imap(mp_pool.IMapIterator, func, iterable, chunksize, progress)

    def imap_unordered(self, func: Callable[[_S], _R], iterable: Iterable[_S],  # type: ignore[override]  # as imap
                       chunksize: int | None = 1, *, progress: _Progress = None) -> Iterator[_R]:
        """The stdlib's, with ``progress`` as ``imap``'s."""
        if progress is None or progress is False:
            return super().imap_unordered(func, iterable, chunksize)
        return self._imap(mp_pool.IMapUnorderedIterator, func, iterable, chunksize, progress)

    def _imap(self, result_type, func, iterable, chunksize, progress):
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        bar = progress_bar(progress, len(iterable) if hasattr(iterable, "__len__") else None)
        result = result_type(self)
        if chunksize == 1:
            track_progress(result, bar)
            tasks = self._guarded_task_generation(result._job, func, iterable)
        else:
            sizes = []
            track_progress(result, bar, sizes)
            tasks = self._guarded_task_generation(
                result._job, _mapstar, counted(mp_pool.Pool._get_tasks(func, iterable, chunksize), sizes))
        self._taskqueue.put((tasks, result._set_length))
        return result if chunksize == 1 else (item for chunk in result for item in chunk)

    def terminate(self) -> None:
        """The stdlib's; the progress bars of the maps left unfinished close."""
        try:
            super().terminate()
        finally:
            for result in list(self._cache.values()):
                bar = getattr(result, "_progress", None)
                if bar is not None:
                    bar.close()

    @staticmethod
    def _thread(target, args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t._state = mp_pool.RUN  # type: ignore[attr-defined]  # the stdlib's handlers read it
        t.start()
        return t

    def _setup_queues(self):
        # the stdlib's name: every handler gets it as its inqueue
        self._inqueue = _Slots(self._processes, self._cache, batches=self._maxtasksperchild is None,
                               shared_results=self._shared_results, daemon=self._daemon)
        self._inqueue.method = self._ctx.get_start_method()  # named by WorkerStartError
        if self._inqueue.method == "forkserver":
            _preload_in_fork_server(self._ctx)
        self._outqueue = SimpleQueue()
        self._quick_put = self._inqueue.put

    def _get_sentinels(self):
        return [self._change_notifier._reader]

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):
        """At terminate: the task handler stops waiting for a slot and discards the task it holds (the
        stdlib drains its inqueue here instead; the slots are drained once the workers are gone)."""
        inqueue.close()

    @classmethod
    def _terminate_pool(cls, taskqueue, inqueue, outqueue, pool, change_notifier, worker_handler, task_handler,
                        result_handler, cache):
        super()._terminate_pool(taskqueue, inqueue, outqueue, pool, change_notifier, worker_handler,
                                task_handler, result_handler, cache)
        inqueue.drain()  # every worker and handler has been joined: nothing takes from the slots any more
        inqueue.unwatch()
        inqueue.done_with(list(inqueue.senders))  # no result is read any more (_reductions Note [results told])
        inqueue.clock.close()  # (its mapping goes with the object: the watchdog may be reading it)
        _recycle.release_all()
        # Nothing uses the channels any more: their descriptors go now, not when a traceback that holds the
        # pool (a `with` block left by an exception) is collected.
        for q in (*inqueue.queues, inqueue.short, outqueue, change_notifier):
            q.close()

    @staticmethod
    def _repopulate_pool_static(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                                maxtasksperchild, wrap_exception):
        """Start a worker for each slot that has none (none once the pool is broken, Note [start failures])."""
        if inqueue.broken is not None:
            return
        group = shm_manager.group()
        for k, w in enumerate(inqueue.workers):
            if w is not None:
                continue
            oom_base, row = inqueue.starting(k)
            w = Process(ctx, target=worker, args=(inqueue.queues[k], outqueue, initializer, initargs,
                                                  maxtasksperchild, wrap_exception, group, inqueue.short,
                                                  inqueue.shared_results, row, os.getpid()))
            w.name = w.name.replace("Process", "PoolWorker")
            w.daemon = inqueue.daemon
            try:
                w.start()
            except (ConnectionError, EOFError) as exc:
                if ctx.get_start_method() != "forkserver":
                    raise
                raise RuntimeError(_FORKSERVER_DIED) from exc
            inqueue.started(w, oom_base)
            inqueue.workers[k] = w
            pool.append(w)
            util.debug("added worker")

    @classmethod
    def _maintain_pool(cls, ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                       maxtasksperchild, wrap_exception):
        """Record exited workers' deaths (Note [lost tasks]), reap them, start replacements."""
        dead = [w for w in pool if w.exitcode is not None]
        for w in dead:
            inqueue.exited(w)
            w.join()
            pool.remove(w)
        if dead:
            try:
                Packet(None, head=pickle.dumps(_WAKE)).send_nowait(outqueue._writer._sock)
            except OSError:  # the pool is being torn down
                pass
        cls._repopulate_pool_static(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                                    maxtasksperchild, wrap_exception)

    @classmethod
    def _handle_workers(cls, cache, taskqueue, ctx, Process, processes, pool, inqueue, outqueue, initializer,
                        initargs, maxtasksperchild, wrap_exception, sentinels, change_notifier):
        """The stdlib's, retrying after a back-off when a worker fails to start (Note [resource tracker])."""
        thread = threading.current_thread()
        delay = None
        while thread._state == mp_pool.RUN or (cache and thread._state != mp_pool.TERMINATE):
            try:
                cls._maintain_pool(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                                   maxtasksperchild, wrap_exception)
                delay = None
            except Exception:
                if delay is None:
                    log.warning("a pool worker failed to start; retrying", exc_info=True)
                delay = _backoff(delay)
            cls._wait_for_updates([*cls._get_worker_sentinels(pool), *sentinels], change_notifier, delay)
        taskqueue.put(None)
        util.debug("worker handler exiting")

    @staticmethod
    def _handle_results(outqueue, slots, cache):
        """Read results and settle deaths (Note [lost tasks]) until stopped and nothing is pending; never dies of
        a receive that fails (the parent out of descriptors: retried after a back-off, logged once)."""
        thread = threading.current_thread()
        reader = outqueue._reader
        stopping, delay, deaths = False, None, []
        started, start_errors, start_failures = set(), {}, 0  # Note [start failures]

        def settle(head, body, fds) -> None:
            nonlocal stopping, start_failures
            if head is None:
                stopping = True
                return
            if head == _WAKE:
                return
            if head == _STARTED:
                started.add(loads(body, fds))
                start_failures = 0
                return
            if head == _START_FAILED:
                pid, error = loads(body, fds)
                start_errors[pid] = error
                return
            job, i, seconds = head
            deliver(job, i, slots.results([((job, i), seconds)])[0], body, fds)

        def deliver(job, i, known: bool, body, fds) -> None:
            try:
                obj = loads(body, fds)  # even if unknown: gives back the shared memory it names
                if not (isinstance(obj, tuple) and len(obj) == 2):
                    raise TypeError(f"a pool worker sent {type(obj).__name__!r} as a result")
            except Exception as e:  # the task's error: see the module docstring
                obj = (False, e)
            result = cache.get(job) if known else None
            if result is not None:
                result._set(i, obj)

        short, frames = slots.short._reader._sock, memoryview(bytearray(_SHORT_READ * _SHORT_MAX))
        reader_fd, short_fd = reader.fileno(), short.fileno()
        waiter = select.poll()
        for fd in (reader_fd, short_fd):
            waiter.register(fd, select.POLLIN)

        def read_short() -> None:
            """Deliver every short result queued now (Note [batches])."""
            nonlocal short
            while short is not None:
                got = shm_core.recv_many(short, frames, _SHORT_MAX, socket.MSG_DONTWAIT)
                _stats.counts[_stats.MESSAGES_RECEIVED] += len(got)
                done = []
                for k, (n, flags) in enumerate(got):
                    if n == 0:  # its writers are gone (never while the pool lives: it holds one): stop polling it
                        waiter.unregister(short)
                        short = None
                        return
                    if flags & _TRUNCATED or n < _RESULT.size:
                        log.error("the pool's result handler dropped a malformed short result (%d bytes, flags %#x)",
                                  n, flags)
                        continue
                    job, i, seconds = _RESULT.unpack_from(frames, k * _SHORT_MAX)
                    done.append(((job, i), seconds, k * _SHORT_MAX + _RESULT.size, k * _SHORT_MAX + n))
                unfinished = slots.results([d[:2] for d in done]) if done else []
                for ((job, i), _, start, end), known in zip(done, unfinished, strict=True):
                    try:
                        deliver(job, i, known, frames[start:end], None)
                    except Exception:  # a callback raised: the stdlib's would die
                        log.exception("the pool's result handler could not deliver a result")
                if len(got) < _SHORT_READ:
                    return

        pending = collections.deque()  # a result taken but not opened yet (_channel Note [opening named segments])
        while thread._state != mp_pool.TERMINATE and not (stopping and not cache):
            if delay is None:  # results, the stop sentinel, and the worker handler's nudges wake it
                ready = {fd for fd, _ in waiter.poll()}
            else:
                time.sleep(delay)
            deaths += slots.take_deaths()
            # a death is settled after every result its worker sent: both sockets are read then
            everything = deaths or delay is not None
            try:
                if everything or short_fd in ready:
                    read_short()
                while everything or pending or reader_fd in ready:
                    try:
                        msg = pending.popleft() if pending else _split(*recv_raw(reader._sock, socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        break
                    try:
                        check_openable(*msg[1:], reader_fd)
                    except OSError:
                        pending.append(msg)
                        raise
                    delay = None
                    try:
                        settle(*msg)
                    except Exception:  # a callback raised, or a worker sent a bad head: the stdlib's would die
                        log.exception("the pool's result handler could not deliver a result")
            except EOFError:
                util.debug("result handler got EOFError -- exiting")
                return
            except Exception:
                if delay is None:
                    log.warning("the pool's result handler could not receive a result; retrying", exc_info=True)
                delay = _backoff(delay)
                continue  # the deaths wait until every message before them is read
            for k, pid, exitcode, took, how in deaths:
                if pid in started:
                    started.discard(pid)
                elif exitcode and exitcode not in (-signal.SIGKILL, -signal.SIGTERM):
                    start_failures += 1
                    if start_failures >= len(slots.queues) and slots.broken is None:
                        error = WorkerStartError(start_failures, pid, exitcode, slots.method)
                        error.__cause__ = start_errors.get(pid)
                        slots.break_(error)
                start_errors.pop(pid, None)
                slots.done_with([pid])  # every message it sent is read (_reductions Note [results told])
                running = slots.lost(k, took)
                result = cache.get(running[0]) if running else None
                if result is not None:
                    result._set(running[1], (False, _loss(pid, exitcode, running, result, how)))
            deaths = []
            slots.settle_failed()
        util.debug(f"result handler exiting: len(cache)={len(cache)}, thread._state={thread._state}")
