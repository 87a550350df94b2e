"""The pool's errors: how a task was lost (a worker's death, a time limit), why workers could not start, why
the pool broke; each pickles, names the task, and ends its message with the remedy (STYLE.md 8)."""

from __future__ import annotations

import math
import numbers
import pickle

from .. import _deaths, _stats
from .watchdog import GRACE


class WorkerLostError(Exception):
    """Raised when a pool worker died (a signal, the out-of-memory killer, ``os._exit``)
    while running the task whose result is asked for.

    ``signal_name`` names the signal (``"SIGKILL"``) or is None for an exit code; ``task`` names the function
    (and, for a chunk, its items); ``oom`` is True when the pool's memory cgroup counted an OOM kill meanwhile,
    False when it counted none, None when no counter could be read; ``rss`` is (resident bytes, peak bytes,
    seconds before the death) of the worker's last sample, or None (_deaths Note [deaths explained])."""

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
    (watchdog Note [task timeouts]). A chunk of ``map`` is one task: its items fail together."""

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


class PoolBrokenError(RuntimeError):
    """Raised when one of a pool's helper threads failed (core Note [helper threads]): every task pending then
    fails with this error (the thread's exception as its ``__cause__``), the workers are ended, and new work is
    refused with it. A bug of the pool's, or of what it was given to run in its threads (a progress bar's
    callback), never of a task: the message says which thread and what it raised."""

    def __init__(self, thread: str, error: str):
        self.thread, self.error = thread, error
        super().__init__(thread, error)

    def __str__(self) -> str:
        return (f"the pool's {self.thread} thread failed ({self.error}), so the pool is broken: its unfinished "
                "tasks failed and its workers were ended; make a new pool (and report this with the cause's "
                "traceback, which the 'mp_reductions.pool' logger printed too)")

    def __reduce__(self):
        return type(self), (self.thread, self.error)


class ResultUnpicklingError(pickle.UnpicklingError):
    """Raised when a task's result raised a BaseException that is not an Exception (``SystemExit``,
    ``KeyboardInterrupt``) as the pool's process unpickled it: that exception is its ``__cause__``; the pool's
    result handler goes on (the stdlib's died there and the pool hung)."""

    def __str__(self) -> str:
        return (f"a task's result raised {self.__cause__!r} as it was unpickled in the pool's process; its "
                "__reduce__ must rebuild it, not exit")


def unpickling_error(exc: BaseException) -> ResultUnpicklingError:
    error = ResultUnpicklingError()
    error.__cause__ = exc
    return error


for _cls in (WorkerLostError, TaskTimeoutError, WorkerStartError, PoolBrokenError, ResultUnpicklingError):
    _cls.__module__ = "mp_reductions"  # where users import them from (tracebacks name it; pickles find it)


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


def loss(pid: int, exitcode, running: tuple, result, how: tuple) -> Exception:
    """The error of the task ``running`` (job, i) of ``result``, whose worker ``pid`` died ``how`` (as
    ``Slots.exited`` records it): TaskTimeoutError if the watchdog ended it for that task, else WorkerLostError."""
    timed, oom, rss = how
    kind, task = result.kind, result.describe(running[1])
    if timed is not None and tuple(timed[:2]) == tuple(running):
        _stats.count("task_timeouts")
        return TaskTimeoutError(timed[2], running[1], kind, task, pid)
    _stats.count("worker_deaths")
    note = None
    if timed is not None:  # (watchdog Note [task timeouts]: never, since the worker cannot start another)
        note = f"the pool ended it as task {timed[1]} ran past its {timed[2]:g} s limit"
    return WorkerLostError(pid, exitcode, running[1], kind, task, oom, rss, note)
