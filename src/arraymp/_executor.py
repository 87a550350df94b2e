"""``arraymp.ProcessPoolExecutor``: mp_reductions' executor whose default ``mp_context`` is arraymp's context
(``mp.get_context()``, or ``mp.get_context("spawn")`` with ``max_tasks_per_child``), as the stdlib's defaults to
``multiprocessing.get_context()``. Imported on first use: concurrent.futures costs every process that imports
arraymp (each spawn and forkserver worker included) ~10 ms otherwise."""

from __future__ import annotations

from mp_reductions import ProcessPoolExecutor as _Executor

from ._context import default_context


class ProcessPoolExecutor(_Executor):
    __doc__ = _Executor.__doc__
    _default_context = staticmethod(default_context.get_context)
