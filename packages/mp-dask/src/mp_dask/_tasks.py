"""The tasks one Pool or executor runs on the cluster (adapts the worker loop of multiprocessing/pool.py).

A batch of tasks is one ``scatter`` of their arguments, each wrapped in a
``Shipped`` (directly to the workers: the scheduler never sees array data),
then one Dask task per argument, which calls ``star(func, payload)`` on a
worker and returns ``(success, value)`` in a ``Shipped`` the way the stdlib's
worker does (an exception travels with its remote traceback). ``star`` and
``func`` travel with each task as one pickle made once per batch. Each
finished task hands its outcome to the caller's ``done(i, success, value)`` in
Dask's callback thread; a task cancelled finishes with CancelledError. The
script's functions run over one namespace per pool and worker (Note [Script
namespaces] in _script.py); the initializer runs there on every worker,
present and future (restarts included), as a worker plugin, so the globals it
sets are the ones the pool's tasks see.

Note [Lost workers]
~~~~~~~~~~~~~~~~~~~
Invariant: a task whose worker dies (SIGKILL, the out-of-memory killer) is sent again, argument and all, up to
``distributed.scheduler.allowed-failures`` times (3), as Dask retries a dead worker's tasks; one lost once more finishes
with ``DaskWorkerLostError`` (an ``mp_reductions.WorkerLostError``, as the local Pool raises) naming the worker, its pid
when the scheduler told it, the task and its call.

Why: a scattered argument lives on the worker it was sent to, and nowhere else: a worker that dies takes with it the
arguments of every task of ours placed there, running or waiting, and Dask cancels those tasks ("already forgotten":
scattered data cannot be recomputed).

How: the pool keeps each task's payload until the task ends, and sends a task lost that way (cancelled without our
asking, or failed with Dask's ``KilledWorker``) again to the workers there are (the nanny restarts the dead one). The
copies of a lost argument leave this process's recycling pool at once (``mp_reductions.copies_lost``): the dead worker's
view of them never comes back, so the pool would keep each busy for ``BUSY_IDLES * IDLE`` seconds after it was sent
(mp_reductions' Note [recycling]). The error says how that worker ended when its nanny told (Note [Dask deaths
explained] in _deaths.py). A task past its time limit ends its worker on purpose and is not sent again (Note [Dask task
timeouts] in _timeouts.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import pickle
import threading
import time
import uuid
import warnings
from multiprocessing.pool import ExceptionWithTraceback

import dask
import mp_reductions
import shm_manager
from distributed import WorkerPlugin
from distributed.scheduler import KilledWorker
from mp_reductions import TaskTimeoutError, WorkerLostError, count, explain

from . import _deaths, _domain, _script
from ._timeouts import Limited, timed_out
from ._transport import DaskHandleError, Shipped, dumps_for_pool, receiver

_CANCELLED = (concurrent.futures.CancelledError, asyncio.CancelledError)  # what a cancelled Dask future raises


class DaskWorkerLostError(WorkerLostError):
    """Raised when the Dask worker that ran a task, or held its arguments, died (a signal, the out-of-memory
    killer, a crash) more times than Dask retries a task (Note [Lost workers]). ``exitcode``, ``oom`` and ``rss``
    are the last death's, as its nanny told (Note [Dask deaths explained]); ``exitcode`` None: not told."""

    def __init__(self, address: str | None, pid: int | None, index: int, kind: str = "task", losses: int = 1,
                 exitcode: int | None = None, oom: bool | None = None, rss: tuple | None = None):
        super().__init__(pid, exitcode, index, kind, oom=oom, rss=rss)
        self.address, self.losses = address, losses
        self.args = (address, pid, index, kind, losses, exitcode, oom, rss)

    def __str__(self) -> str:
        who = f"worker {self.address or '(address unknown)'}" + (f" (pid {self.pid})" if self.pid else "")
        if self.exitcode is None:
            how, why = "died", ("a signal, often the out-of-memory killer: see its nanny's log and `dmesg`; its "
                                "nanny did not tell how")
            remedy = "resubmit this one, or give it less memory"
        else:
            how, why, remedy = explain(self.exitcode, self.oom, self.rss)
        why = f": {why}" if why else ""
        return (f"{who} of the Dask cluster {how} while it ran or held task {self.index} of {self.kind}{why}; "
                f"that task was lost {self.losses} time(s), and Dask sends a lost task again {self.losses - 1} "
                "time(s) (distributed.scheduler.allowed-failures); the pool goes on with the other tasks; "
                f"{remedy}")

    def __reduce__(self):
        return type(self), self.args


def run(call: bytes, shipped: Shipped, token: str | None = None, limit: float | None = None) -> Shipped:
    """One task, on a worker: ``call`` is ``(star, func)`` pickled by ``dumps_for_pool``; ``limit``: its time
    limit in seconds, ``token`` its name for it (Note [Dask task timeouts])."""
    try:
        if shipped.error is not None:  # its arguments could not be opened here (Note [Same-node transport])
            if isinstance(shipped.error, DaskHandleError):
                shipped.error.receiver = receiver()  # (unpickled on the event loop, which is not the worker's)
            raise shipped.error
        star, func = pickle.loads(call)
        with Limited(token, limit):
            out = (True, star(func, shipped.value))
    except Exception as exc:
        out = (False, ExceptionWithTraceback(exc, exc.__traceback__))
        # the wrapper holds the traceback's text: the frames (this one, holding ``out``, and the task's, holding
        # its arguments) would otherwise form a cycle that keeps the arguments' segments until a collection
        exc.__traceback__ = None
    return Shipped(out, shipped.same_node)


def apply_star(func, payload):
    args, kwds = payload
    return func(*args, **kwds)


def call_star(func, item):
    return func(item)


def map_star(func, chunk):
    return list(map(func, chunk))


def starmap_star(func, chunk):
    return list(itertools.starmap(func, chunk))


def not_applied(name: str) -> None:
    """Dask workers are long-lived processes shared by every task of the cluster, holding data (arguments
    scattered to them, results) that goes with them: retiring one after N tasks of a pool loses what Dask
    cannot move first (two workers retiring together have nowhere to move it; tried), so the limit is not
    applied, and the caller is told."""
    warnings.warn(f"{name} is not applied on a Dask cluster: its workers are long-lived processes shared by "
                  "every task, holding data that would be lost if one were replaced after N tasks; restart them "
                  "with client.restart() between batches, or start workers with --lifetime", RuntimeWarning,
                  stacklevel=4)


def worker_pids(dask_scheduler) -> dict[str, list]:
    """On the scheduler: its workers' addresses, each with its pid and the shared-memory domain it published
    (``[pid, domain]``; None where not told)."""
    told = {msg.get("address"): msg.get("domain") for _, msg in dask_scheduler.get_events(_domain.TOPIC)
            if isinstance(msg, dict)}
    return {address: [ws.pid or None, told.get(address)] for address, ws in dask_scheduler.workers.items()}


def _outcome(task) -> tuple[bool, object]:
    """A finished Dask task's ``(success, value)``; cancelled (by us, or lost with a worker), its error without
    a traceback: Dask keeps that error in the state of a lost task, and the frames of a traceback would keep
    the task's future, and so that state, alive for good (and, were they our callers', the job sent again: its
    payload, the pool's result object and every result in it; seen)."""
    try:
        shipped = task.result()
        if shipped.error is not None:  # its result could not be opened here (Note [Same-node transport])
            return False, shipped.error
        return shipped.value
    except BaseException as exc:  # cancelled, failed to run, or lost with a worker
        if isinstance(exc, (*_CANCELLED, KilledWorker)):
            exc.__traceback__ = None
        return False, exc


class Initializer(WorkerPlugin):
    """Runs the pool's initializer in every worker process, as it starts or joins, in the pool's namespace
    (Note [Script namespaces]); the namespace goes with the plugin."""

    def __init__(self, namespace: str, call: bytes):
        self.namespace, self.call = namespace, call  # call: (initializer, initargs) pickled by dumps_for_pool

    def setup(self, worker):
        initializer, initargs = pickle.loads(self.call)
        initializer(*initargs)

    def teardown(self, worker):
        _script.drop(self.namespace)


class Job:
    """One task of a batch, from submit until its outcome is handed on (sent again when lost)."""

    __slots__ = ("index", "call", "payload", "done", "kind", "limit", "token", "task", "arg", "sent", "losses",
                 "cancelled")

    def __init__(self, index: int, call: bytes, payload, done, kind: str, limit: float | None):
        self.index, self.call, self.payload, self.done, self.kind = index, call, payload, done, kind
        self.limit, self.token = limit, None  # its time limit, and its token now (Note [Dask task timeouts])
        self.task = self.arg = None  # the Dask futures of the task and of its argument, now
        self.sent = None  # the Shipped its argument went in
        self.losses = 0
        self.cancelled = False


class Tasks:
    """What one Pool or executor has on the cluster."""

    def __init__(self, context, initializer=None, initargs=(), task_timeout: float | None = None):
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self.task_timeout = task_timeout  # (checked by the caller: check_timeout)
        self.client = context.client  # (its nanny plugin registered: _deaths.tell)
        self.same_node = context.same_node
        self.namespace = f"arraymp-pool-{uuid.uuid4().hex}"  # Note [Script namespaces]
        self.allowed_failures = int(dask.config.get("distributed.scheduler.allowed-failures", 3))
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.pending: set[Job] = set()
        self.closed = False
        self.pids_at = 0.0
        self.pids: dict[str, int] = {}  # worker address -> pid, as the scheduler last told (Note [Lost workers])
        # the workers seen of this process's shared-memory domain (address -> pid), and whether one may have died
        # since the last settle_dead (Note [Counts over Dask] in _transport.py)
        self.domain = _domain.domain()
        self.ours: dict[str, int] = {}
        self.lost = self.ever_lost = False
        self.exits: dict[str | None, dict | None] = {}  # dead worker's address -> its exit, as its nanny told
        self._learn_pids()
        self.plugin = None
        if initializer is not None:
            self.plugin = f"arraymp-initializer-{uuid.uuid4().hex}"
            call = dumps_for_pool((initializer, tuple(initargs)), self.namespace)
            self.client.register_plugin(Initializer(self.namespace, call), name=self.plugin)

    def submit(self, star, func, payloads, done, kind: str = "task", limit: float | None = None) -> list[Job]:
        """One task per payload; ``done(i, success, value)`` once each ends (``kind``: the call, for errors;
        ``limit``: the call's time limit, else the pool's ``task_timeout``)."""
        payloads = list(payloads)
        if not payloads:
            return []
        call = dumps_for_pool((star, func), self.namespace)
        limit = self.task_timeout if limit is None else limit
        jobs = [Job(i, call, p, done, kind, limit) for i, p in enumerate(payloads)]
        with self.lock:
            self.pending.update(jobs)
        try:
            self._send(jobs)
        except BaseException:
            with self.lock:
                self.pending.difference_update(jobs)
                self.idle.notify_all()
            raise
        return jobs

    def _send(self, jobs: list[Job]) -> None:
        sent = [Shipped(job.payload, self.same_node, self.namespace, copies=[]) for job in jobs]
        try:
            args = self.client.scatter(sent, direct=True, hash=False)
        except BaseException:  # (a worker killed as it unpickled them: Dask's comm error) nothing waits for them
            for shipped in sent:
                mp_reductions.copies_lost(shipped.copies)
                mp_reductions.give_back_counts(shipped.held)
            sent.clear()  # (the traceback holds this frame: the copies go with their last view here)
            raise
        for job, shipped, arg in zip(jobs, sent, args, strict=True):
            job.token = uuid.uuid4().hex if job.limit is not None else None
            task = self.client.submit(run, job.call, arg, job.token, job.limit, pure=False)
            with self.lock:
                job.task, job.arg, job.sent, cancelled = task, arg, shipped, job.cancelled
            if cancelled:  # cancel() ran while the task was sent again
                self.client.cancel([task])
            task.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: Job, task) -> None:
        success, value = _outcome(task)
        if not success and self._lost(job, value):
            value = self._again(job, value)
            if value is None:
                return  # sent again: this job goes on
        mp_reductions.give_back_counts(job.sent.held)  # its worker has counts of its own, or is dead
        with self.lock:
            self.pending.discard(job)  # the last reference: Dask releases the argument and the result
            job.task = job.arg = job.payload = job.sent = None
            idle = not self.pending
            if idle:
                self.idle.notify_all()
        job.done(job.index, success, value)
        if idle:
            self.settle_dead()

    def _lost(self, job: Job, exc: BaseException) -> bool:
        """Whether ``exc`` says the task went with a worker (Note [Lost workers]), not that we cancelled it."""
        with self.lock:
            ours = job.cancelled or self.closed
        return not ours and isinstance(exc, (*_CANCELLED, KilledWorker)) and self.client.status == "running"

    def _again(self, job: Job, exc: BaseException) -> BaseException | None:
        """Send a lost task again; None when sent, else the error it finishes with."""
        with self.lock:
            self.lost = self.ever_lost = True  # a worker died (Note [Counts over Dask] in _transport.py)
        mp_reductions.copies_lost(job.sent.copies)
        mp_reductions.give_back_counts(job.sent.held)  # the worker that had the argument is gone
        ended = timed_out(self.client, job.token) if job.limit is not None else None
        if ended is not None:  # its worker ended itself for it (Note [Dask task timeouts])
            count("task_timeouts")
            return TaskTimeoutError(job.limit, job.index, job.kind, None, ended.get("pid"))
        job.losses += 1
        if isinstance(exc, KilledWorker) or job.losses > self.allowed_failures:
            address, pid = self._lost_worker(job, exc)
            losses = job.losses if not isinstance(exc, KilledWorker) else exc.allowed_failures + 1
            told = self._told(address) or {}
            rss = told.get("rss")
            return DaskWorkerLostError(address, pid or told.get("pid"), job.index, job.kind, losses,
                                       told.get("exitcode"), told.get("oom"), None if rss is None else tuple(rss))
        if time.monotonic() - self.pids_at > 1.0:  # the dead worker's replacement, once per burst of losses
            self._learn_pids()
        try:
            self._send([job])
        except Exception as send_exc:  # the cluster is going away
            return send_exc
        return None

    def _told(self, address: str | None) -> dict | None:
        """How the worker at ``address`` ended (Note [Dask deaths explained]), looked up (and waited for) once per
        worker: the tasks a death fails all ask, in the callback thread."""
        with self.lock:
            if address in self.exits:
                return self.exits[address]
        told = _deaths.told(self.client, address)
        with self.lock:
            self.exits[address] = told
        return told

    def _learn_pids(self) -> set[str] | None:
        """The workers' pids, from the scheduler; the addresses of its workers now (None: a scheduler without
        mp-dask installed says nothing)."""
        self.pids_at = time.monotonic()
        try:
            seen = self.client.run_on_scheduler(worker_pids)
        except Exception:
            return None
        with self.lock:
            for address, (pid, domain) in seen.items():
                if type(pid) is int:
                    self.pids[address] = pid
                    if self.domain is not None and domain == self.domain:
                        self.ours[address] = pid
        return set(seen)

    def settle_dead(self) -> None:
        """Say ``done_with`` for the workers of this process's domain that are gone since they were seen: this pool
        reads nothing more from them, and the counts they told and it never took go back (Note [Counts over Dask]
        in _transport.py). Run when no task is pending after a loss, and at close."""
        with self.lock:
            if not self.lost:
                return
            self.lost = False
        now = self._learn_pids()
        if now is None:
            return
        with self.lock:
            gone = [address for address in self.ours if address not in now]
            dead = [self.ours.pop(address) for address in gone]
        if dead:
            shm_manager.done_with(dead)

    def _lost_worker(self, job: Job, exc: BaseException) -> tuple[str | None, int | None]:
        """The address and pid of the worker whose removal lost ``job`` (the scheduler's event log)."""
        if isinstance(exc, KilledWorker):
            ws = exc.last_worker
            return getattr(ws, "address", None), getattr(ws, "pid", None)
        keys = {k for k in (getattr(job.task, "key", None), getattr(job.arg, "key", None)) if k is not None}
        address = None
        try:
            for _, msg in reversed(self.client.get_events("all")):
                if isinstance(msg, dict) and msg.get("action") == "remove-worker" and \
                        keys & (set(msg.get("lost-scattered-tasks", ())) | set(msg.get("processing-tasks", ()))):
                    address = msg.get("worker")
                    break
        except Exception:
            pass
        with self.lock:
            return address, self.pids.get(address)

    def cancel(self, jobs=None) -> None:
        """Cancel ``jobs`` (default: every pending one); each then ends with CancelledError."""
        with self.lock:
            jobs = list(self.pending) if jobs is None else [job for job in jobs if job in self.pending]
            for job in jobs:
                job.cancelled = True
            tasks = [job.task for job in jobs if job.task is not None]
        if tasks:
            self.client.cancel(tasks)

    def wait(self, timeout=None) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: not self.pending, timeout)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            plugin, self.plugin = self.plugin, None
        bound = _script.sent(self.namespace)
        if self.client.status != "running":
            return
        with self.lock:
            self.lost = self.ever_lost  # (a worker killed but not yet removed at the last settle)
        self.settle_dead()
        if plugin is not None:
            self.client.unregister_worker_plugin(plugin)  # its teardown drops the namespace
        elif bound:
            try:
                self.client.run(_script.drop, self.namespace)
            except Exception:  # a worker gone meanwhile: its namespace went with it
                pass
