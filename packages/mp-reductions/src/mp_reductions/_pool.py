"""``Pool``: the stdlib's process pool over our channels, surviving dead workers
(adapts multiprocessing/pool.py).

What changed from the stdlib, and why::

    apply/map/imap ─▶ task handler ──inqueue (SimpleQueue)──▶ worker ─┐
                                                                      │ ("started", pid, job, i)
    AsyncResult ◀── result handler ◀──outqueue (SimpleQueue)──────────┘ (job, i, result)
                          ▲
    worker handler ───────┘ ("exited", pid, exitcode) when a worker's sentinel fires

- Both queues are our seqpacket ``SimpleQueue``, whatever the context: task
  arguments and results carry their arrays by shared memory (DESIGN.md).
- Each worker says which task it starts before running it, even before it
  unpickles the task's arguments (Note [lost tasks]); the result handler
  remembers, per worker pid, the task it runs. When the worker handler sees a
  worker exit it reports the exit on the outqueue, after everything the worker
  sent, so the result handler fails exactly the task the worker had not
  finished with ``WorkerLostError`` (the stdlib's Pool waits forever there).
  The worker is replaced as before; tasks never taken stay in the inqueue.
- The worker handler no longer wakes on every queued result (the stdlib waits
  on the outqueue's reader too, which spins while results are pending); it
  wakes on worker exits and on the change notifier, which is all it acts on.
- Workers run a full garbage collection when they go idle, at most every
  ``GC_INTERVAL`` seconds while busy, and at exit, so views of shared memory
  caught in reference cycles do not pin segments.

The task index in ``WorkerLostError`` is the item's for ``apply`` and for
``imap`` / ``imap_unordered`` with chunksize 1, else the chunk's.

Note [group]: workers join the parent's shm_manager group (its token is a
worker argument), whatever the start method. A worker in a group of its own
(a forkserver child, or a fork made before the parent joined a group) would
leave its named segments to a daemon that unlinks them when the worker exits,
while the parent still holds the results.

Note [lost tasks]: each inqueue message is two pickles back to back in one
seqpacket message: a head ``(job, i)`` (``None`` for the stop sentinel), then
the task ``(job, i, func, args, kwds)``. The worker loads the head alone, sends
"started", then loads the task. Unpickling the arguments can take long and
allocate much (the out-of-memory killer picks that moment), and it can raise;
in the stdlib's Pool both lose the task and its caller waits forever. Here a
worker killed there fails the task with ``WorkerLostError``, and an error
there is the task's error result, the worker going on. The window left: a
worker killed between its recvmsg and the "started" send, where it unpickles
only the tiny head and no user data, loses that task without a trace.
``terminate`` drains what is queued and unpickles each task it drains, so
that the shared memory the task names is given back (``_help_stuff_finish``).
"""

from __future__ import annotations

import functools
import gc
import io
import os
import pickle
import queue
import signal
import socket
import threading
import time
from multiprocessing import get_context, util
from multiprocessing import pool as mp_pool

import shm_manager

from ._channel import Packet, loads, recv_raw
from ._queues import SimpleQueue
from ._reductions import init_reductions

GC_INTERVAL = 0.1  # seconds between full collections in a busy worker (one costs ~2.5 ms)
_IDLE_WAIT = 0.05  # a worker that finds no task within this collects before blocking
_STARTED = "started"
_EXITED = "exited"


class WorkerLostError(Exception):
    """Raised when a pool worker died (a signal, the out-of-memory killer, ``os._exit``)
    while running the task whose result is asked for."""

    def __init__(self, pid: int, exitcode: int | None, index: int, kind: str = "task"):
        self.pid, self.exitcode, self.index, self.kind = pid, exitcode, index, kind
        super().__init__(pid, exitcode, index, kind)

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def __str__(self) -> str:
        name = self.signal_name
        how = f"died with signal {name}" if name else f"exited with code {self.exitcode}"
        hint = " (often the out-of-memory killer: see `dmesg`)" if name == "SIGKILL" else ""
        return (f"worker {self.pid} {how} while running task {self.index} of {self.kind}{hint}; the pool "
                "replaced it and goes on with the other tasks; resubmit this one, or give it less memory")

    def __reduce__(self):
        return type(self), (self.pid, self.exitcode, self.index, self.kind)


def _kind(result) -> str:
    if isinstance(result, mp_pool.MapResult):
        return "map"
    if isinstance(result, mp_pool.IMapUnorderedIterator):
        return "imap_unordered"
    if isinstance(result, mp_pool.IMapIterator):
        return "imap"
    return "apply"


def _put_task(writer, task) -> None:
    """Send ``task`` (or the stop sentinel None) on the inqueue, its head first (Note [lost tasks])."""
    writer._check(writable=True)
    Packet(task, head=pickle.dumps(None if task is None else task[:2])).send(writer._sock)


def _split_task(data, fds):
    """An inqueue message as (head, the task's pickle, its descriptors): only the head is unpickled."""
    f = io.BytesIO(data)
    try:
        head = pickle.Unpickler(f).load()
    except BaseException:
        for fd in fds or ():
            os.close(fd)
        raise
    return head, memoryview(data)[f.tell():], fds


def _recv_task(reader):
    """The next inqueue message, as _split_task's."""
    reader._check(readable=True)
    return _split_task(*reader._recv())


def _drain(inqueue) -> None:
    """Take every task queued now, unpickling each so that the shared memory it names is given back."""
    while True:
        try:
            _, body, fds = _split_task(*recv_raw(inqueue._reader._sock, socket.MSG_DONTWAIT))
        except (EOFError, OSError):  # empty (BlockingIOError), or closed
            return
        try:
            loads(body, fds)
        except Exception:  # the worker would have made it the task's error; nobody waits for it now
            pass
        time.sleep(0)


def _next_task(inqueue, dirty: bool):
    """The next task as _recv_task's; collect garbage first when no task comes within _IDLE_WAIT."""
    if dirty and not inqueue._reader.poll(_IDLE_WAIT):
        gc.collect()
    return _recv_task(inqueue._reader)


def worker(inqueue, outqueue, initializer=None, initargs=(), maxtasks=None, wrap_exception=False, group=None):
    """The stdlib's pool worker, plus the group, the "started" message and the garbage collections."""
    if maxtasks is not None and not (isinstance(maxtasks, int) and maxtasks >= 1):
        raise AssertionError(f"Maxtasks {maxtasks!r} is not valid")
    if group is not None:
        shm_manager.join_group(group)  # see Note [group]
    init_reductions()
    put = outqueue.put
    pid = os.getpid()
    inqueue._writer.close()
    outqueue._reader.close()
    if initializer is not None:
        initializer(*initargs)

    completed, dirty, last_gc = 0, False, time.monotonic()
    while maxtasks is None or completed < maxtasks:
        try:
            head, body, fds = _next_task(inqueue, dirty)
        except (EOFError, OSError):
            util.debug("worker got EOFError or OSError -- exiting")
            break
        if head is None:
            util.debug("worker got sentinel -- exiting")
            break

        job, i = head
        put((_STARTED, pid, job, i))  # before unpickling the arguments: see Note [lost tasks]
        func = None
        try:
            _, _, func, args, kwds = loads(body, fds)
            body = None
            result = (True, func(*args, **kwds))
        except Exception as e:
            if wrap_exception and func is not mp_pool._helper_reraises_exception:
                e = mp_pool.ExceptionWithTraceback(e, e.__traceback__)
            result = (False, e)
        try:
            put((job, i, result))
        except Exception as e:
            wrapped = mp_pool.MaybeEncodingError(e, result[1])
            util.debug(f"Possible encoding error while sending result: {wrapped}")
            put((job, i, (False, wrapped)))

        head = body = fds = job = result = func = args = kwds = None
        completed += 1
        now = time.monotonic()
        if now - last_gc >= GC_INTERVAL:
            gc.collect()
            dirty, last_gc = False, time.monotonic()
        else:
            dirty = True
    gc.collect()
    util.debug(f"worker exiting after {completed} tasks")


class Pool(mp_pool.Pool):
    """``multiprocessing.pool.Pool`` whose arrays travel by shared memory and which survives dead workers.

    ``context`` chooses the start method (any ``multiprocessing`` context);
    the queues are always ours. A worker that dies while running a task fails
    that task's result with :class:`WorkerLostError` and is replaced.
    """

    def __init__(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None, context=None):
        # The stdlib's __init__ (3.10-3.13 alike), with this class's handlers as the threads' targets.
        self._pool = []
        self._state = mp_pool.INIT
        init_reductions()
        self._ctx = context or get_context()
        self._setup_queues()
        self._taskqueue = queue.SimpleQueue()
        self._change_notifier = SimpleQueue()
        self._cache = mp_pool._PoolCache(notifier=self._change_notifier)
        self._maxtasksperchild = maxtasksperchild
        self._initializer = initializer
        self._initargs = initargs

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
        try:
            self._repopulate_pool()
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
            self._outqueue, self._initializer, self._initargs, self._maxtasksperchild, self._wrap_exception,
            self._get_sentinels(), self._change_notifier))
        self._task_handler = self._thread(cls._handle_tasks, (
            self._taskqueue, self._quick_put, self._outqueue, self._pool, self._cache))
        self._result_handler = self._thread(cls._handle_results, (self._outqueue, self._quick_get, self._cache))
        self._terminate = util.Finalize(
            self, self._terminate_pool,
            args=(self._taskqueue, self._inqueue, self._outqueue, self._pool, self._change_notifier,
                  self._worker_handler, self._task_handler, self._result_handler, self._cache),
            exitpriority=15)
        self._state = mp_pool.RUN

    @staticmethod
    def _thread(target, args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t._state = mp_pool.RUN
        t.start()
        return t

    def _setup_queues(self):
        self._inqueue = SimpleQueue()
        self._outqueue = SimpleQueue()
        self._quick_put = functools.partial(_put_task, self._inqueue._writer)
        self._quick_get = self._outqueue._reader.recv

    def _get_sentinels(self):
        return [self._change_notifier._reader]

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):
        """Drain the inqueue at terminate (the task handler may be blocked putting), unpickling each task so
        that the shared memory it names is given back (file_system: its in-flight counts).

        The stdlib drains only while the task handler lives, which ends as soon as the worker handler's
        does: what it leaves queued would hold its segments until the group ends. This drains all that is
        queued, sentinels too (the workers are terminated next), and _terminate_pool drains once more when
        the task handler has ended, for a task whose put was under way. The read lock stays held, as in
        the stdlib: no worker takes a task from now on.
        """
        util.debug("removing tasks from inqueue")
        inqueue._rlock.acquire()
        _drain(inqueue)

    @classmethod
    def _terminate_pool(cls, taskqueue, inqueue, outqueue, pool, change_notifier, worker_handler, task_handler,
                        result_handler, cache):
        super()._terminate_pool(taskqueue, inqueue, outqueue, pool, change_notifier, worker_handler,
                                task_handler, result_handler, cache)
        _drain(inqueue)  # the task handler has been joined: what it put after the first drain

    @staticmethod
    def _repopulate_pool_static(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                                maxtasksperchild, wrap_exception):
        group = shm_manager.group()
        for _ in range(processes - len(pool)):
            w = Process(ctx, target=worker, args=(inqueue, outqueue, initializer, initargs, maxtasksperchild,
                                                  wrap_exception, group))
            w.name = w.name.replace("Process", "PoolWorker")
            w.daemon = True
            w.start()
            pool.append(w)
            util.debug("added worker")

    @classmethod
    def _maintain_pool(cls, ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                       maxtasksperchild, wrap_exception):
        """Report exited workers to the result handler, reap them and start replacements."""
        cleaned = False
        for k in reversed(range(len(pool))):
            w = pool[k]
            if w.exitcode is not None:
                try:
                    outqueue.put((_EXITED, w.pid, w.exitcode))
                except OSError:  # the pool is being torn down
                    pass
                w.join()
                del pool[k]
                cleaned = True
        if cleaned:
            cls._repopulate_pool_static(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs,
                                        maxtasksperchild, wrap_exception)

    @staticmethod
    def _handle_results(outqueue, get, cache):
        thread = threading.current_thread()
        running: dict[int, tuple[int, int]] = {}  # worker pid -> (job, i) it runs
        owner: dict[tuple[int, int], int] = {}  # (job, i) -> worker pid

        def handle(task) -> None:
            if len(task) == 4:  # (_STARTED, pid, job, i)
                _, pid, job, i = task
                running[pid] = (job, i)
                owner[job, i] = pid
                return
            if task[0] == _EXITED:
                _, pid, exitcode = task
                lost = running.pop(pid, None)
                if lost is None:
                    return
                del owner[lost]
                job, i = lost
                result = cache.get(job)
                if result is not None:
                    result._set(i, (False, WorkerLostError(pid, exitcode, i, _kind(result))))
                return
            job, i, obj = task
            pid = owner.pop((job, i), None)
            if pid is not None:
                running.pop(pid, None)
            try:
                cache[job]._set(i, obj)
            except KeyError:
                pass

        while True:
            try:
                task = get()
            except (OSError, EOFError):
                util.debug("result handler got EOFError/OSError -- exiting")
                return
            if thread._state != mp_pool.RUN:
                util.debug("result handler found thread._state=TERMINATE")
                break
            if task is None:
                util.debug("result handler got sentinel")
                break
            handle(task)
            task = None

        while cache and thread._state != mp_pool.TERMINATE:
            try:
                task = get()
            except (OSError, EOFError):
                util.debug("result handler got EOFError/OSError -- exiting")
                return
            if task is None:
                util.debug("result handler ignoring extra sentinel")
                continue
            handle(task)
            task = None

        util.debug("ensuring that outqueue is not full")
        try:
            for _ in range(10):
                if not outqueue._reader.poll():
                    break
                get()
        except (OSError, EOFError):
            pass
        util.debug(f"result handler exiting: len(cache)={len(cache)}, thread._state={thread._state}")
