"""mp-reductions: numpy arrays through multiprocessing by shared memory.

Pickler reductions for ``numpy.ndarray`` (registered with the stdlib's
``ForkingPickler`` by ``init_reductions()``), the two sharing strategies, the
shared-array constructors, Queue / SimpleQueue / JoinableQueue / Pipe whose
messages carry their arrays' descriptors in the same sendmsg, and a Pool over
them that survives dead workers (and says how they died) and ends tasks
past their time limit (``task_timeout``: ``TaskTimeoutError``), with
``ProcessPoolExecutor``, concurrent.futures' API over the same pool core.
``shared_allocation()`` and ``set_shared_allocation()`` make numpy place
large arrays in shared memory from birth (NEP 49), so they travel with no
copy at all. ``executor_map`` is
Python 3.14's ``ProcessPoolExecutor.map`` (chunks, ``buffersize``) over any
executor's ``submit``, on every Python version. ``progress_bar`` and
``track_progress`` draw the bar of ``progress=True`` for pools built on the
stdlib's result objects (mp-dask's). ``stats()`` says what moved: messages,
arrays sent as handles, copied or pickled, segments made and reused;
``SharingStoppedWarning`` says when an array meant for shared memory went
pickled.
"""

from typing import TYPE_CHECKING

from ._alloc import set_shared_allocation, shared_allocation
from ._arrays import empty_shared, message_copies, share_memory, zeros_shared
from ._chunks import executor_map
from ._connection import Connection, Pipe
from ._deaths import RSS_INTERVAL, OomCounter, explain, resident
from ._message import counts_kept, give_back_counts, keep_counts, tell_counts
from ._pool import (
    GRACE,
    ApplyResult,
    AsyncResult,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    Pool,
    PoolBrokenError,
    ResultUnpicklingError,
    TaskTimeoutError,
    WorkerLostError,
    WorkerStartError,
    call_repr,
    check_timeout,
    prepare_worker,
)
from ._progress import isatty, progress_bar, track_progress
from ._queues import JoinableQueue, Queue, SimpleQueue
from ._recycle import copies_lost
from ._reductions import init_reductions, rebuild_ndarray, reduce_ndarray
from ._shared import is_shared
from ._stats import SharingStoppedWarning, Stats, count, stats
from ._stats import read as read_stats
from ._strategy import (
    get_all_sharing_strategies,
    get_inline_threshold,
    get_sharing_strategy,
    set_inline_threshold,
    set_sharing_strategy,
)

if TYPE_CHECKING:
    from ._pool.executor import ProcessPoolExecutor

__all__ = [
    "GRACE",
    "RSS_INTERVAL",
    "ApplyResult",
    "AsyncResult",
    "Connection",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MapResult",
    "OomCounter",
    "PoolBrokenError",
    "ProcessPoolExecutor",
    "ResultUnpicklingError",
    "JoinableQueue",
    "Pipe",
    "Pool",
    "Queue",
    "SharingStoppedWarning",
    "SimpleQueue",
    "TaskTimeoutError",
    "Stats",
    "WorkerLostError",
    "WorkerStartError",
    "call_repr",
    "check_timeout",
    "copies_lost",
    "count",
    "counts_kept",
    "empty_shared",
    "executor_map",
    "explain",
    "get_all_sharing_strategies",
    "get_inline_threshold",
    "get_sharing_strategy",
    "give_back_counts",
    "init_reductions",
    "is_shared",
    "isatty",
    "keep_counts",
    "message_copies",
    "prepare_worker",
    "progress_bar",
    "read_stats",
    "rebuild_ndarray",
    "reduce_ndarray",
    "resident",
    "set_inline_threshold",
    "set_shared_allocation",
    "set_sharing_strategy",
    "share_memory",
    "shared_allocation",
    "tell_counts",
    "track_progress",
    "stats",
    "zeros_shared",
]


def __getattr__(name):
    # imported on first use: concurrent.futures would cost every worker's start
    if name == "ProcessPoolExecutor":
        from ._pool.executor import ProcessPoolExecutor

        return ProcessPoolExecutor
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("mp-reductions")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
