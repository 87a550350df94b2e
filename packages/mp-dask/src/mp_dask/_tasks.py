"""The tasks one Pool or executor runs on the cluster (adapts the worker loop of multiprocessing/pool.py).

A batch of tasks is one ``scatter`` of their arguments, each wrapped in a
``Shipped`` (directly to the workers: the scheduler never sees array data),
then one Dask task per argument, which calls ``star(func, payload)`` on a
worker and returns ``(success, value)`` in a ``Shipped`` the way the stdlib's
worker does (an exception travels with its remote traceback). Each finished
task hands its outcome to the caller's ``done(i, success, value)`` in Dask's
callback thread; a task cancelled, or lost with its worker and its argument,
finishes with that error. The initializer runs on every worker, present and
future (restarts included), as a worker plugin: in the process that runs the
tasks, so the globals it sets are the ones they see.
"""

from __future__ import annotations

import functools
import itertools
import threading
import uuid
import warnings
from multiprocessing.pool import ExceptionWithTraceback

from distributed import WorkerPlugin

from ._transport import Shipped


def run(star, func, shipped: Shipped) -> Shipped:
    """One task, on a worker."""
    try:
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


class Initializer(WorkerPlugin):
    """Runs ``initializer(*initargs)`` in every worker process, as it starts or joins."""

    def __init__(self, initializer, initargs):
        self.initializer, self.initargs = initializer, tuple(initargs)

    def setup(self, worker):
        self.initializer(*self.initargs)


class Tasks:
    """What one Pool or executor has on the cluster."""

    def __init__(self, context, initializer=None, initargs=()):
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self.client = context.client
        self.same_node = context.same_node
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.pending: dict = {}  # task key -> (task future, argument future)
        self.plugin = None
        if initializer is not None:
            self.plugin = f"arraymp-initializer-{uuid.uuid4().hex}"
            self.client.register_plugin(Initializer(initializer, initargs), name=self.plugin)

    def submit(self, star, func, payloads, done) -> list:
        """One task per payload; ``done(i, success, value)`` once each ends. The Dask futures of the tasks."""
        payloads = list(payloads)
        if not payloads:
            return []
        args = self.client.scatter([Shipped(p, self.same_node) for p in payloads], direct=True, hash=False)
        tasks = []
        for i, arg in enumerate(args):
            task = self.client.submit(run, star, func, arg, pure=False)
            with self.lock:
                self.pending[task.key] = task, arg
            task.add_done_callback(functools.partial(self._finished, i, done))
            tasks.append(task)
        return tasks

    def _finished(self, i, done, task) -> None:
        try:
            success, value = task.result().value
        except BaseException as exc:  # cancelled, or lost with a worker and its argument
            success, value = False, exc
        with self.lock:
            self.pending.pop(task.key, None)  # the last reference: Dask releases the argument and the result
            if not self.pending:
                self.idle.notify_all()
        done(i, success, value)

    def cancel(self, tasks=None) -> None:
        """Cancel ``tasks`` (default: every pending one); each then ends with CancelledError."""
        with self.lock:
            tasks = [t for t, _ in self.pending.values()] if tasks is None else list(tasks)
        if tasks:
            self.client.cancel(tasks)

    def wait(self, timeout=None) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: not self.pending, timeout)

    def close(self) -> None:
        plugin, self.plugin = self.plugin, None
        if plugin is not None and self.client.status == "running":
            self.client.unregister_worker_plugin(plugin)
