"""mp-spawn: a process supervisor that propagates errors and never orphans or hangs.

The API of ``torch.multiprocessing.spawn`` (switch by changing an import)::

    import mp_spawn as mp

    def train(i, world_size):
        ...

    mp.spawn(train, args=(4,), nprocs=4)                              # spawn
    ctx = mp.start_processes(train, args=(4,), nprocs=4, join=False,
                             start_method="forkserver")
    while not ctx.join(timeout=1.0):
        ...

A failure in any child raises :class:`ProcessRaisedException` (the child's
traceback ends the message) or :class:`ProcessExitedException` (exit code or
signal) in the parent, after the other children were terminated.  Unlike
torch, children (and their children) die when the parent dies, even by
SIGKILL; every failure is reported; KeyboardInterrupt, unpicklable and huge
exceptions arrive intact; spawn and forkserver children start in parallel.

Linux only.
"""

import sys as _sys

if not _sys.platform.startswith("linux"):  # pragma: no cover
    raise ImportError(
        "mp-spawn supports Linux only (it relies on prctl(PR_SET_PDEATHSIG), pidfds "
        f"and /proc); this is {_sys.platform!r}. Use torch.multiprocessing.spawn or "
        "the stdlib multiprocessing module on this platform."
    )

from ._context import ProcessContext, SpawnContext
from ._errors import ProcessException, ProcessExitedException, ProcessRaisedException
from ._spawn import ENV_VAR_FAILED_EXIT_TIMEOUT, ENV_VAR_PARALLEL_START, spawn, start_processes

__all__ = [
    "ENV_VAR_FAILED_EXIT_TIMEOUT",
    "ENV_VAR_PARALLEL_START",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]


def __getattr__(name):
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("mp-spawn")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
