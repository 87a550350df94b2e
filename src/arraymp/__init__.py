"""arraymp: ``multiprocessing`` for array programs.

``import arraymp as mp``: every public name of ``multiprocessing``, and the
Queue, SimpleQueue, JoinableQueue, Pipe and Pool of ``mp`` and of
``mp.get_context(...)`` move numpy arrays through shared memory instead of
pickled copies; the Pool also survives dead workers (``WorkerLostError`` says
how they died) and ends tasks past their limit (``task_timeout``:
``TaskTimeoutError``), and ``mp.ProcessPoolExecutor`` is ``concurrent.futures``' API over that Pool, with
Python 3.14's API on every version. Importing arraymp registers the array
reductions with the stdlib's ForkingPickler once, so stdlib queues and
spawn-time Process arguments share arrays too. Also: sharing strategies,
shared-array constructors, and the ``spawn`` supervisor, and
``shared_allocation()``: large numpy arrays born in shared memory, sent with no
copy at all. ``stats()`` says what moved (``python -m arraymp stats PID``, of a
running program), and a ``SharingStoppedWarning`` when an array meant for
shared memory went pickled.
"""

import sys

if not sys.platform.startswith("linux"):  # pragma: no cover
    raise ImportError(f"arraymp supports Linux only (memfd, SCM_RIGHTS, futex); this is {sys.platform}")

import multiprocessing as _mp
from typing import TYPE_CHECKING

from mp_reductions import (
    SharingStoppedWarning,
    TaskTimeoutError,
    WorkerLostError,
    WorkerStartError,
    empty_shared,
    get_all_sharing_strategies,
    get_inline_threshold,
    get_sharing_strategy,
    is_shared,
    set_inline_threshold,
    set_shared_allocation,
    set_sharing_strategy,
    share_memory,
    shared_allocation,
    stats,
    zeros_shared,
)
from mp_reductions import (
    init_reductions as _init_reductions,
)

from ._context import default_context as _default_context

# Imported on first use, as the submodules below are: importing them cost every process that imports arraymp (the
# program, each spawn and forkserver worker, the fork server) ~10 ms that a program which never uses them need not pay.
_LAZY = {
    **dict.fromkeys(("ProcessContext", "ProcessException", "ProcessExitedException", "ProcessRaisedException",
                     "SpawnContext", "spawn", "start_processes"), "mp_spawn"),
    "ProcessPoolExecutor": "arraymp._executor",
}

# Every public name of multiprocessing, then ours over it (the stdlib's own
# __init__ copies its default context's bound methods the same way).
globals().update({name: getattr(_mp, name) for name in _mp.__all__})
globals().update({name: getattr(_default_context, name) for name in _mp.__all__ if hasattr(_default_context, name)})

_init_reductions()

if TYPE_CHECKING:  # what the two updates above make, spelled out for type checkers (as typeshed's multiprocessing)
    # the classes, as typeshed's: `q: mp.Queue[int] = mp.Queue()`
    from mp_reductions import (  # noqa: F401
        JoinableQueue,
        Queue,
        SimpleQueue,
    )
    from mp_spawn import (  # noqa: F401
        ProcessContext,
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
        SpawnContext,
        spawn,
        start_processes,
    )

    from ._executor import ProcessPoolExecutor  # noqa: F401

    Pipe = _default_context.Pipe
    Pool = _default_context.Pool
    get_context = _default_context.get_context

    # the rest of the stdlib's names (ours above stay: the checker keeps the first binding)
    from multiprocessing import *  # type: ignore[assignment]  # noqa: E402, F403

__all__ = [
    *_mp.__all__,
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessPoolExecutor",
    "ProcessRaisedException",
    "SharingStoppedWarning",
    "SpawnContext",
    "TaskTimeoutError",
    "WorkerLostError",
    "WorkerStartError",
    "empty_shared",
    "get_all_sharing_strategies",
    "get_inline_threshold",
    "get_sharing_strategy",
    "is_shared",
    "set_inline_threshold",
    "set_shared_allocation",
    "set_sharing_strategy",
    "share_memory",
    "shared_allocation",
    "spawn",
    "start_processes",
    "stats",
    "zeros_shared",
]


# multiprocessing's submodules under our name (ours where we have our own), imported on first use as the stdlib's are
_SUBMODULES = {"connection", "managers", "pool", "queues", "shared_memory", "util"}


def __getattr__(name):
    if name in _SUBMODULES or name in _LAZY:
        import importlib

        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("arraymp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
