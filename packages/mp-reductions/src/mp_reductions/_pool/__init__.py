"""The pool: one core of processes, channels and helper threads, and two fronts over it, ``Pool``
(multiprocessing.pool's API) and ``ProcessPoolExecutor`` (concurrent.futures'). Its modules, each one concern,
in layers (each imports only those above it; docs/internals.md has the package's whole map)::

    clock, results                      the task clock; the result objects and the cache of pending ones
    watchdog                            time limits, and what explains a death
    errors                              the pool's errors                             (watchdog's GRACE)
    wire                                the wire format                               (the channels)
    handlers, worker                    the handler threads; the worker process's body (errors, results, wire)
    slots                               the workers' queues: dispatch, batches, lost tasks    (clock, wire, queues)
    core                                one pool's lifecycle; Note [helper threads]   (all of the above)
    pool, executor                      the two fronts                                 (core, results, errors)

``executor`` is imported on first use (concurrent.futures costs every worker's start otherwise).
"""

from .errors import (
    PoolBrokenError,
    ResultUnpicklingError,
    TaskTimeoutError,
    WorkerLostError,
    WorkerStartError,
    check_timeout,
)
from .pool import Pool
from .results import ApplyResult, AsyncResult, IMapIterator, IMapUnorderedIterator, MapResult, call_repr
from .watchdog import GRACE
from .worker import prepare_worker

__all__ = [
    "GRACE",
    "ApplyResult",
    "AsyncResult",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MapResult",
    "Pool",
    "PoolBrokenError",
    "ResultUnpicklingError",
    "TaskTimeoutError",
    "WorkerLostError",
    "WorkerStartError",
    "call_repr",
    "check_timeout",
    "prepare_worker",
]
