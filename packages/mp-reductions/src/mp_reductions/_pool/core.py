"""One pool's processes, channels and threads, and their lifecycle: what ``Pool`` and ``ProcessPoolExecutor``
are fronts over (adapts ``Pool.__init__``, ``close``, ``terminate``, ``join`` and ``_terminate_pool`` of
CPython's Lib/multiprocessing/pool.py, 3.11-3.15 alike, PSF License Agreement).

The core holds no reference to its front: the front's finalizer (``util.Finalize`` on the front, as the
stdlib's Pool) ends the core when the front is collected or the interpreter exits, and result objects keep
their front alive while they are pending, as the stdlib's keep their pool.

Note [helper threads]
~~~~~~~~~~~~~~~~~~~~~
Invariant: if any of a pool's helper threads (task handler, worker handler, result handler, watchdog) ends
by an exception, every result pending then fails with PoolBrokenError (that exception its cause), new work
is refused with it, the workers are ended, and close / join / terminate all return. Each thread's body runs
in ``guarded``, which catches anything it raises (BaseException: a SystemExit in a callback too), logs it
with its traceback on the ``mp_reductions.pool`` logger, and calls ``fail``: under the core's lock the first
failure wins; the slots fail their ready and unfinished tasks, every result in the cache is aborted, and the
teardown runs (once: it is the finalizer's), joining every other thread and worker. The teardown never waits
on the failed thread, and wakes each of the others at the call it may wait in: the task handler at the
taskqueue (a sentinel of its own, in case the worker handler is the one that died) and at the slots' room
(closed), the result handler by a stop head on the outqueue, the worker handler by the notifier, the
watchdog by its event. What a handler can wait out (a receive short of descriptors, a worker that failed to
start) it retries after a back-off instead: those are not failures. A user's callback that raises an
Exception is logged and its result set all the same (the stdlib's result handler died there).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import threading
from typing import Any

import shm_manager

from .. import _recycle
from .._byvalue import target
from .._channel import Packet, recv_raw
from .._message import KeptCounts, give_back_counts
from .._queues import SimpleQueue
from .._reductions import init_reductions
from .errors import PoolBrokenError
from .handlers import CLOSE, RUN, TERMINATE, ResultHandler, handle_tasks, handle_workers
from .results import Cache
from .slots import Slots
from .watchdog import Watchdog
from .worker import worker

INIT = "INIT"
log = logging.getLogger("mp_reductions.pool")

# The fork server imports the main module itself as it starts (it preloads __main__), so a script that makes a
# pool at its top level may end the fork server there; where the connection to it is authenticated (3.13.x and
# 3.14 seen here), the start then fails with a broken connection (mp_spawn Note [unguarded main]).
FORKSERVER_DIED = (
    "the fork server exited before it could start a pool worker. It imports the main module first, and a script "
    "that makes a pool (or starts processes) at its top level fails there (the stdlib's \"bootstrapping phase\" "
    "RuntimeError in its traceback on stderr above). Put the code that makes the pool under "
    '`if __name__ == "__main__":`'
)


def _check_main_importable(method: str) -> None:
    """A spawn or forkserver worker imports the main module again from its file before it runs anything: a script
    read from stdin (``python - <<EOF``) has none, and every worker would die there (the fork server first)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and isinstance(path, str) and not os.path.exists(path):
        raise RuntimeError(
            f"this script was read from {path} (`python - <<EOF` or a pipe), and {method} workers import the main "
            "module again from its file before they run anything: there is none to import. Write the script to a "
            "file and run that, or pass it with `python -c`, or use the fork start method "
            "(mp.get_context('fork')); an `if __name__ == \"__main__\":` guard cannot help here")


def start_process(ctx, *args, **kwds):
    """The stdlib Pool's ``Process`` hook: a process of ``ctx``."""
    return ctx.Process(*args, **kwds)


class Core:
    """A pool's workers, slots, channels and helper threads (see the module docstring)."""

    finalizer: Any = None  # the front's util.Finalize, whose callback is ``teardown``
    state = INIT

    def __init__(self, processes: int, initializer, initargs, maxtasks, ctx, *, shared_results: bool = True,
                 daemon: bool = True, task_timeout: float | None = None, executor: bool = False,
                 active: int | None = None, Process=start_process):
        init_reductions()
        self.ctx, self.Process, self.processes = ctx, Process, processes
        self.method = ctx.get_start_method()
        if self.method in ("spawn", "forkserver"):
            _check_main_importable(self.method)
        if self.method == "forkserver":
            _preload_in_fork_server(ctx)
        if self.method != "fork":  # pickled to start each worker: what pickle cannot send by name goes by value
            initializer, initargs = target(initializer), tuple(map(target, initargs))  # (_byvalue Note [by value])
        self.initializer, self.initargs, self.maxtasks = initializer, initargs, maxtasks
        self.shared_results, self.daemon, self.executor = bool(shared_results), bool(daemon), executor
        self.start_failures_allowed = 1 if executor else processes  # slots Note [start failures]
        self.lock = threading.Lock()
        self.launch_counts: dict[int | None, list] = {}  # Note [launch counts]: a worker pid -> counts kept for it
        self.keeps_launch_counts = False  # a launch was pickled with its counts kept
        self.starting = threading.RLock()  # held while workers start: by the worker handler, or a front's grow
        self.broken: BaseException | None = None  # Note [helper threads], or the workers could not start
        self.cache = Cache(on_empty=self.wake)
        self.taskqueue: queue.SimpleQueue = queue.SimpleQueue()
        self.notifier: SimpleQueue = SimpleQueue()  # wakes the worker handler
        self.outqueue: SimpleQueue = SimpleQueue()
        self.slots = Slots(processes, self.cache, batches=maxtasks is None)
        self.slots.active = processes if active is None else active
        self.watchdog = Watchdog(self.slots, task_timeout)
        self.workers: list = []  # the live worker processes (the stdlib Pool's ``_pool``)
        self.threads: dict[str, threading.Thread] = {}
        try:
            self.repopulate()
        except Exception:
            for p in self.workers:
                if p.exitcode is None:
                    p.terminate()
            for p in self.workers:
                p.join()
            self.close_channels()
            raise
        self.state = RUN
        try:
            self._start("worker handler", handle_workers, self)
            self._start("task handler", handle_tasks, self)
            self._start("result handler", ResultHandler(self).run)
            self._start("watchdog", self.watchdog.run)
        except BaseException as exc:  # no thread may start (interpreter shutdown): nothing may be left running
            self.fail("start", exc)
            raise

    def _start(self, name: str, target, *args) -> None:
        t = threading.Thread(target=self.guarded, args=(name, target, *args), daemon=True, name=f"Pool {name}")
        t.start()
        self.threads[name] = t

    def guarded(self, name: str, target, *args) -> None:
        """Run a helper thread's body; its failure breaks the pool (Note [helper threads])."""
        try:
            target(*args)
        except BaseException as exc:
            self.fail(name, exc)

    def fail(self, name: str, exc: BaseException) -> None:
        """Thread ``name`` failed with ``exc``: break the pool (Note [helper threads])."""
        error = PoolBrokenError(name, f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self.lock:
            first = self.broken is None
            if first:
                self.broken = error
        if not first:
            return
        log.critical("the pool's %s thread failed; the pool is broken and its tasks fail", name, exc_info=exc)
        _quietly(self.slots.break_, error)
        for result in list(self.cache.values()):
            _quietly(result._abort, error)
        if self.finalizer is not None:
            self.finalizer()
        else:
            self.teardown()

    def check_running(self) -> None:
        """Raise why no new work is taken: the pool broke, or it is closed (the stdlib's ValueError)."""
        broken = self.broken
        if broken is not None:  # (a new one, in no local: its traceback would hold this frame in a cycle)
            raise type(broken)(*broken.args) from broken.__cause__
        if self.state != RUN:
            raise ValueError("Pool not running")

    def submit(self, tasks, set_length=None) -> None:
        """Queue a call's tasks (an iterable of (job, i, func, args, kwds)) for the task handler."""
        self.taskqueue.put((tasks, set_length))

    def wake(self) -> None:
        """Nudge the worker handler (a state change, the cache emptied once closing)."""
        try:
            self.notifier._writer._sock.send(b"P" + pickle.dumps(None), socket.MSG_DONTWAIT)
        except OSError:  # full (it will wake), or closed (torn down)
            pass

    def drain_notifier(self) -> None:
        sock = self.notifier._reader._sock
        while True:
            try:
                recv_raw(sock, socket.MSG_DONTWAIT)
            except (BlockingIOError, EOFError):
                return

    def repopulate(self) -> None:
        """Start a worker for each active slot that has none (none once the pool is broken or torn down)."""
        with self.starting:
            self._repopulate()

    def _repopulate(self) -> None:
        slots = self.slots
        if slots.broken is not None or self.broken is not None:
            return
        group = shm_manager.group()
        for k in range(slots.active):
            if slots.workers[k] is not None or self.state == TERMINATE:
                continue
            oom_base, row = self.watchdog.oom.read(), slots.clock.row(k)
            initializer, initargs = self.initializer, self.initargs
            held: list = []
            if self.method != "fork" and (initializer is not None or initargs):  # pickled: Note [launch counts]
                initializer, initargs = KeptCounts(initializer, held), KeptCounts(initargs, held)
                self.keeps_launch_counts = True
            w = self.Process(self.ctx, target=worker, args=(
                slots.queues[k], self.outqueue, slots.short, row, initializer, initargs, self.maxtasks,
                group, self.shared_results, os.getpid(), self.executor))
            w.name = w.name.replace("Process", "PoolWorker")
            w.daemon = self.daemon
            try:
                w.start()
            except BaseException as exc:
                give_back_counts(held)  # (a launch that failed after its pickle: no worker took them)
                if self.method != "forkserver" or not isinstance(exc, (ConnectionError, EOFError)):
                    raise
                raise RuntimeError(FORKSERVER_DIED) from exc
            pid = getattr(w, "pid", None)
            if held:  # (under self.starting, which ``launched`` waits for)
                self.launch_counts[pid] = held
            if pid is not None:
                slots.senders.add(pid)
            self.watchdog.started(w, oom_base)
            slots.workers[k] = w
            self.workers.append(w)

    def grow(self, n: int) -> None:
        """Use ``n`` slots (at most all), their workers started before it returns, in the caller's thread (the
        executor's on-demand workers, which its ``submit`` starts, as the stdlib's). A start that fails is left
        to the worker handler, which retries it and logs why."""
        n = min(n, self.processes)
        if n > self.slots.active:
            with self.slots.lock:
                self.slots.active = n
            try:
                self.repopulate()
            except Exception:
                log.debug("a worker failed to start in grow; the worker handler retries", exc_info=True)
            self.wake()

    def start_failed(self, error: BaseException) -> None:
        """The workers keep failing to start (slots Note [start failures]): every task fails with ``error``."""
        self.slots.break_(error)

    def close(self) -> None:
        if self.state == RUN:
            self.state = CLOSE
            self.cache.closing = True  # before its own wake: see Cache
            self.wake()

    def join(self) -> None:
        if self.state == RUN:
            raise ValueError("Pool is still running")
        if self.state not in (CLOSE, TERMINATE):
            raise ValueError("In unknown state")
        for name in ("worker handler", "task handler", "result handler"):
            _join(self.threads.get(name))
        for p in list(self.workers):
            p.join()
        self.watchdog.stop()  # every worker is gone
        _join(self.threads.get("watchdog"))
        self.slots.done_with(list(self.slots.senders))  # and the result handler read all they sent
        _recycle.release_all()  # the message segments this process keeps for reuse go with the pool
        self.release_arguments()

    def teardown(self) -> None:
        """End the pool now (terminate, the front collected, the interpreter exiting, a helper thread failed):
        the finalizer's callback, run once. Pending results stay pending, as the stdlib's terminate leaves them
        (unless the pool broke: Note [helper threads]). Every step is taken even if one before it failed."""
        with self.starting:  # a worker a front's grow is starting is in self.workers first; none starts after
            self.state = TERMINATE
        _quietly(self.wake)
        _quietly(self.slots.close)  # the task handler stops waiting for room, discarding the task it holds
        self.taskqueue.put(None)
        _quietly(Packet(None, head=pickle.dumps(None)).send_nowait, self.outqueue._writer._sock)
        _join(self.threads.get("worker handler"))
        for p in list(self.workers):
            if p.exitcode is None:
                _quietly(p.terminate)
        for name in ("task handler", "result handler"):
            _join(self.threads.get(name))
        for p in list(self.workers):
            if p.is_alive():
                _quietly(p.join)
        _quietly(self.slots.drain)  # nothing takes from the slots any more
        self.watchdog.stop()
        _join(self.threads.get("watchdog"))
        _quietly(self.slots.done_with, list(self.slots.senders))  # (_message Note [results told])
        _quietly(_recycle.release_all)
        self.close_channels()  # their descriptors go now, not when a traceback holding the pool is collected
        self.release_arguments()

    def release_arguments(self) -> None:
        """Drop the initializer and its arguments once no worker can start or run: the core's parts refer to each
        other (a cycle only a collection frees), and what the caller handed it (a Queue and its semaphores, big
        arrays) must go when the pool ends, as the stdlib's go; with them the counts kept for their launches."""
        self.initializer, self.initargs = None, ()
        for pid in list(self.launch_counts):
            self.launched(pid)

    def launched(self, pid) -> None:
        """Worker ``pid`` is dead: give back the counts kept for its launch (Note [launch counts]; once: a second
        call finds none)."""
        if self.keeps_launch_counts:
            with self.starting:  # recorded once its start returned
                held = self.launch_counts.pop(pid, None)
            if held:
                give_back_counts(held)

    def close_channels(self) -> None:
        for q in (self.outqueue, self.notifier):
            _quietly(q.close)
        _quietly(self.slots.close_queues)


def _join(thread: threading.Thread | None) -> None:
    if thread is not None and thread is not threading.current_thread() and thread.ident is not None:
        thread.join()


def _quietly(call, *args) -> None:
    """``call(*args)``; an error is logged, never raised (a teardown step, an abort)."""
    try:
        call(*args)
    except Exception:
        log.exception("the pool's teardown: %s failed", getattr(call, "__qualname__", call))


# Note [launch counts]
# ~~~~~~~~~~~~~~~~~~~~
# Invariant: a spawn or forkserver worker killed at any point of its life, its start included, leaves no count of a
# named segment its initializer and initargs name (a plain array's launch copy under file_system, or a shared
# array's in-flight count): the pool holds one count of each per live worker, and gives it back once that worker is
# reaped dead, or when the pool ends.
#
# Why: a launch is a pipe to a process that may die before or while it reads it. A worker that took the in-flight
# count over, or added one of its own, as it unpickled could be killed before the daemon heard of it (a fresh
# process connects first): the count stayed until the group ended, and a pool ended quickly, its second worker
# still starting, left its launch copy (8 MB per plain initarg in the tests).
#
# How: the core pickles each worker's initializer and initargs as a pickle of their own (_message.KeptCounts) under
# keep_counts, kept in ``launch_counts`` by the worker's pid; the worker unpickles them taking no count (mapped
# only: ``borrowed``), so nothing it does or fails to do counts. The worker handler gives a worker's counts back
# once it reaps it (``launched``), the pool's join and teardown those left (``release_arguments``, every worker
# gone). The worker keeps the arrays as long as it lives, as the stdlib's keeps its initargs. A fork worker inherits
# them in memory: nothing is pickled, nothing kept.


# Note [fork server preload]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: before the fork server starts, the first forkserver pool adds our packages to its preload list (kept as
# the user set it otherwise; a module already in it is not added twice), so a forkserver worker, forked from the
# server, does not import numpy and this package anew; a server the stdlib or the user started earlier serves as it
# is (once it runs, the list is not read again).
#
# Why: the stdlib's server preloads only the main module (and 3.11-3.13 do not even that: the key they pass is not
# the one the server reads), so every worker imported numpy and this package anew: 100-250 ms each before its first
# task. The server imports them at start (an ImportError there is ignored, as for any preload name). In a process
# whose start method is another library's (a loky worker's "loky"), every forkserver child's preparation sets that
# start method, which only the module that registers it makes known: that module is preloaded too (else every worker
# died at its start with "cannot find context for 'loky'").
_PRELOAD = ("mp_reductions", "arraymp")  # this package, and the facade when it is what made the pool


def _preload_in_fork_server(ctx) -> None:
    """Add our loaded packages to the fork server's preload list before it starts (Note [fork server preload])."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    names = getattr(server, "_preload_modules", None)
    if not isinstance(names, list):
        return
    extra = [n for n in _PRELOAD if n in sys.modules and n not in names]
    current = multiprocessing.get_start_method(allow_none=True)
    if current not in (None, "fork", "spawn", "forkserver"):  # (3.14 lists loky's among get_all_start_methods)
        module = type(multiprocessing.get_context()).__module__  # the context's: it registered the method
        if module not in names:
            extra.append(module)
    if extra:
        ctx.set_forkserver_preload([*names, *extra])
