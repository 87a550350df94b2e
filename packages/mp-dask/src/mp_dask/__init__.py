"""mp-dask: the same ``Pool`` / ``ProcessPoolExecutor`` code on a Dask cluster.

``arraymp.get_context("dask", ...)`` returns a ``DaskContext``; its Pool and
ProcessPoolExecutor keep the stdlib's signatures and run their tasks on Dask
workers. Arrays go between processes of one shared-memory domain (one node's
/dev/shm and pid namespace) as arraymp shared-memory handles, elsewhere as
Dask's usual bytes; a handle that cannot be opened fails its task with
``DaskHandleError``. The script's functions and
initializer share one namespace per pool on each worker; tasks lost with a
worker are sent again, and fail with ``DaskWorkerLostError`` (an
``mp_reductions.WorkerLostError``) past Dask's ``allowed-failures``.
"""

from ._context import DaskContext
from ._executor import ProcessPoolExecutor
from ._pool import Pool
from ._tasks import DaskWorkerLostError
from ._transport import DaskHandleError, reset_transfer_counters, transfer_counters

__all__ = [
    "DaskContext",
    "DaskHandleError",
    "DaskWorkerLostError",
    "Pool",
    "ProcessPoolExecutor",
    "get_context",
    "reset_transfer_counters",
    "transfer_counters",
]


def get_context(address=None, n_workers=None, threads_per_worker=1, **kwargs) -> DaskContext:
    """``arraymp.get_context("dask", ...)``: see :class:`DaskContext`."""
    return DaskContext(address, n_workers, threads_per_worker, **kwargs)


def __getattr__(name):
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("mp-dask")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
