"""Contexts: the stdlib's, with our Queue / SimpleQueue / JoinableQueue / Pipe / Pool
and ProcessPoolExecutor (adapts multiprocessing/context.py; the Pool and the executor are mp_reductions', the
executor defaulting to our context: arraymp._executor).

Every factory is a lazy method, as in the stdlib; ``get_context(method)``
returns our context for that start method, and ``get_context("dask", ...)``
mp-dask's context (imported on that call: the ``arraymp[dask]`` extra). The
default context follows the stdlib's start method, so
``arraymp.set_start_method`` and ``multiprocessing.set_start_method`` are one
setting, as in torch.multiprocessing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing import context as mpc
from multiprocessing import process as mp_process
from typing import TYPE_CHECKING, Any, Literal, Self, overload

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from mp_dask import DaskContext
    from mp_reductions import Connection, JoinableQueue, Pool, Queue, SimpleQueue

    from arraymp import ProcessPoolExecutor  # (arraymp._executor's, which imports this module)


def _interrupt(self: mp_process.BaseProcess) -> None:
    """Send the process SIGINT (Python 3.14's ``Process.interrupt``): a KeyboardInterrupt in its target, unless the
    target handles SIGINT. Nothing happens once it has exited."""
    if self.exitcode is None and self.pid is not None:  # not reaped yet: the pid is still this process's
        os.kill(self.pid, signal.SIGINT)
    elif self.pid is None:
        raise ValueError("cannot interrupt a process that has not been started; call start() first")


# Python 3.14 added Process.interrupt(); arraymp's Process is the stdlib's own class (mp.Process is
# multiprocessing.Process, as in torch.multiprocessing), so on 3.11-3.13 the method is added to it where missing:
# one method the stdlib lacks, nothing it has is changed.
if not hasattr(mp_process.BaseProcess, "interrupt"):
    mp_process.BaseProcess.interrupt = _interrupt  # type: ignore[attr-defined]  # (typeshed: 3.14's)


class _ArrayContext:
    """Mixed into each stdlib context: the channels that move arrays by shared memory."""

    def Queue(self, maxsize: int = 0) -> Queue[Any]:
        from mp_reductions import Queue

        return Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0) -> JoinableQueue[Any]:
        from mp_reductions import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self) -> SimpleQueue[Any]:
        from mp_reductions import SimpleQueue

        return SimpleQueue(ctx=self.get_context())

    def Pipe(self, duplex: bool = True) -> tuple[Connection[Any, Any], Connection[Any, Any]]:
        from mp_reductions import Pipe

        return Pipe(duplex)

    def Pool(self, processes: int | None = None, initializer: Callable[..., object] | None = None,
             initargs: Iterable[Any] = (), maxtasksperchild: int | None = None, *, shared_results: bool = True,
             task_timeout: float | None = None) -> Pool:
        from mp_reductions import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context(),
                    shared_results=shared_results, task_timeout=task_timeout)

    def ProcessPoolExecutor(self, max_workers: int | None = None, initializer: Callable[..., object] | None = None,
                            initargs: Iterable[Any] = (), max_tasks_per_child: int | None = None, *,
                            shared_results: bool = True, task_timeout: float | None = None) -> ProcessPoolExecutor:
        import arraymp  # (its ProcessPoolExecutor, arraymp._executor's, imports this module)

        return arraymp.ProcessPoolExecutor(max_workers, self.get_context(), initializer, initargs,
                                   max_tasks_per_child=max_tasks_per_child, shared_results=shared_results,
                                   task_timeout=task_timeout)

    @overload
    def get_context(self, method: None = None) -> Self: ...
    @overload
    def get_context(self, method: Literal["fork"]) -> ForkContext: ...
    @overload
    def get_context(self, method: Literal["spawn"]) -> SpawnContext: ...
    @overload
    def get_context(self, method: Literal["forkserver"]) -> ForkServerContext: ...
    @overload
    def get_context(self, method: str, **kwargs: Any) -> Any: ...  # "dask": mp_dask.DaskContext
    def get_context(self, method: str | None = None, **kwargs: Any) -> Any:
        if method is None:
            return self
        if method == "dask":
            return _dask_context(**kwargs)
        _no_options(method, kwargs)
        return _CONTEXTS[method] if method in _CONTEXTS else super().get_context(method)  # type: ignore[misc]


def _no_options(method: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"get_context({method!r}) takes no options ({', '.join(kwargs)}); only 'dask' does")


def _dask_context(**kwargs: Any) -> DaskContext:
    """``get_context("dask", address=None, n_workers=None, threads_per_worker=1, same_node=True, **cluster_kwargs)``."""
    try:
        import mp_dask
    except ImportError as exc:
        raise ImportError(f"get_context('dask') needs the mp-dask package ({exc}); install it with "
                          "`pip install 'arraymp[dask]'` (from a clone: `python3 -m pip install --no-cache-dir "
                          "./packages/{shm-core,shm-manager,mp-reductions,shm-cuda,mp-spawn,mp-dask} '.[dask]'`)"
                          ) from exc
    return mp_dask.get_context(**kwargs)


class ForkContext(_ArrayContext, mpc.ForkContext):  # type: ignore[misc]  # get_context(): self, not a DefaultContext
    pass


class SpawnContext(_ArrayContext, mpc.SpawnContext):  # type: ignore[misc]  # get_context(): self, not a DefaultContext
    pass


class ForkServerContext(_ArrayContext, mpc.ForkServerContext):  # type: ignore[misc]  # get_context(): self, not a DefaultContext
    pass


_CONTEXTS = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


class DefaultContext(_ArrayContext, mpc.BaseContext):
    """The context behind ``arraymp.Queue`` etc.: our context for the stdlib's current start method, or for the
    platform's default one where that method is another library's (a loky worker's reads "loky"): a Pool made in
    any process starts its workers, as the stdlib's Pool does there."""

    Process = multiprocessing.Process

    @overload  # type: ignore[override]
    def get_context(self, method: None = None) -> _ArrayContext: ...
    @overload
    def get_context(self, method: Literal["fork"]) -> ForkContext: ...
    @overload
    def get_context(self, method: Literal["spawn"]) -> SpawnContext: ...
    @overload
    def get_context(self, method: Literal["forkserver"]) -> ForkServerContext: ...
    @overload
    def get_context(self, method: str, **kwargs: Any) -> Any: ...  # "dask": mp_dask.DaskContext
    def get_context(self, method: str | None = None, **kwargs: Any) -> Any:
        if method is None:
            method = multiprocessing.get_start_method()
            if method not in _CONTEXTS:  # another library's start method (loky's "loky", in its workers)
                method = multiprocessing.get_all_start_methods()[0]  # the platform's default, as the stdlib's Pool
        if method == "dask":
            return _dask_context(**kwargs)
        _no_options(method, kwargs)
        try:
            return _CONTEXTS[method]
        except KeyError:
            raise ValueError(f"cannot find context for {method!r}; valid ones are: {', '.join(_CONTEXTS)}") from None

    def set_start_method(self, method, force=False):
        multiprocessing.set_start_method(method, force)

    def get_start_method(self, allow_none=False):
        return multiprocessing.get_start_method(allow_none)

    def get_all_start_methods(self):
        return multiprocessing.get_all_start_methods()

    def Queue(self, maxsize: int = 0) -> Queue[Any]:
        return self.get_context().Queue(maxsize)

    def JoinableQueue(self, maxsize: int = 0) -> JoinableQueue[Any]:
        return self.get_context().JoinableQueue(maxsize)

    def SimpleQueue(self) -> SimpleQueue[Any]:
        return self.get_context().SimpleQueue()


default_context = DefaultContext()
