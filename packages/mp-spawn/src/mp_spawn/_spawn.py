"""Start ``nprocs`` processes running ``fn(i, *args)``: ``spawn`` and ``start_processes``.

Adapted from ``torch/multiprocessing/spawn.py`` (same API, same messages) on
top of the stdlib ``multiprocessing`` contexts.  This module starts the
children; what each child runs is ``_child``, the supervisor that joins them
``_context``.  What changed:

* children die with the supervisor (``_deathsig``: PR_SET_PDEATHSIG=SIGKILL
  plus a watchdog), nested levels included; each child leads a session of its
  own, whose process group dies with it (what it started with Popen too), so
  ``join`` relays Ctrl-C (KeyboardInterrupt) to the children as SIGINT;
* spawn and forkserver children are started in parallel, one thread each;
* the child reports every ``BaseException`` (KeyboardInterrupt included)
  through an error file (Note [error files, not pipes] in ``_errors``), and a
  fatal signal's Python stack through ``faulthandler``;
* ``join`` reports every failure it finds, not only the first;
* ``join`` waits on each child's exit (a pidfd), not on its sentinel pipe,
  which a double-forked daemon inherits (Note [waiting for exits] in
  ``_context``);
* a script that starts processes without ``if __name__ == "__main__":`` gets
  an error that says so (Note [unguarded main] in ``_child``).

::

    parent                                   child i (any start method)
    ------                                   --------------------------
    mkdtemp() -> D (0700)
    start_processes --Process.start()-->     _child._wrap: bind_to_parent (deathsig)
                                               open D/i.fault  (= "started")
    _context.ProcessContext.join               fn(i, *args)
      wait(pidfds)                             on BaseException: write D/i.error,
      on failure: grace, SIGTERM, SIGKILL        stop own children, exit 1
      read + remove D/i.error, D/i.fault
      raise ProcessRaisedException / ProcessExitedException
    rmdir D once every process is joined     (the group reaper removes D if the parent
                                              was killed first: _deathsig._reap_group)

Note [starter threads]
~~~~~~~~~~~~~~~~~~~~~~
Invariant: a spawn child's starter thread lives until its child exits, blocked in ``waitid(WNOWAIT)`` (which reaps
nothing), so PR_SET_PDEATHSIG never fires while the child lives; forkserver starter threads end at once, and fork
children are started from the calling thread, one by one.

Why: ``Process.start()`` for spawn and forkserver pickles the process object and writes it into a pipe the child
reads only after its interpreter booted (and re-imported ``__main__``); with more than a pipe's worth of arguments
each start waits for one child boot. Starting every process from its own thread overlaps those waits. But
PR_SET_PDEATHSIG fires when the *thread* that forked the child exits (torch found its spawn children killed by SIGINT
when its thread pool finished, and gave up on parallel spawn). forkserver children are forked by the fork server, so
that cannot happen to them. fork is cheap, and forking from a helper thread would make every later fork warn about
threads on Python >= 3.12.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from . import _deathsig, _errors
from ._child import _NAME_TAG, _importing_main_of_a_child, _refuse_unguarded_start, _wrap
from ._context import ProcessContext
from ._errors import ProcessException

__all__ = [
    "ENV_VAR_FAILED_EXIT_TIMEOUT",
    "ENV_VAR_PARALLEL_START",
    "spawn",
    "start_processes",
]

#: Set to ``"0"`` to start spawn/forkserver processes one after another.
ENV_VAR_PARALLEL_START = "MP_SPAWN_PARALLEL_START"

#: A failed child waits at most this many seconds (default 10) for its own
#: non-daemon threads and atexit handlers before it exits anyway, so that the
#: parent never waits forever.  Read by the parent when it starts processes.
ENV_VAR_FAILED_EXIT_TIMEOUT = "MP_SPAWN_FAILED_EXIT_TIMEOUT"
_DEFAULT_FAILED_EXIT_TIMEOUT_S = 10.0

# How long a parent interrupted in a blocking join (Ctrl-C) lets its children
# handle SIGTERM before it kills them.
_INTERRUPT_GRACE_S = 5.0

_DIR_PREFIX = "mp_spawn-"

_FORKSERVER_DIED = (
    "the fork server exited before it could start the processes. It imports the main module first, and a script "
    "that starts processes (or makes a pool) at its top level fails there: its traceback is on stderr above. "
    'The script needs `if __name__ == "__main__":`; put the code that starts processes under it.'
)


def _failed_exit_timeout() -> float:
    value = os.environ.get(ENV_VAR_FAILED_EXIT_TIMEOUT, "")
    try:
        return max(0.0, float(value)) if value else _DEFAULT_FAILED_EXIT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ENV_VAR_FAILED_EXIT_TIMEOUT} must be a number of seconds, got {value!r}") from None


def _remove_stale_dirs() -> None:
    """Remove the error directories of our supervisors that died (SIGKILL) before cleaning up.

    Their names say who made them: ``mp_spawn-<pid>-<start time>-<random>``.
    """
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        parts = entry.name[len(_DIR_PREFIX) :].split("-")
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if not _deathsig.is_alive(int(parts[0]), int(parts[1])):
            shutil.rmtree(entry.path, ignore_errors=True)


def _parallel_start(start_method: str) -> bool:
    if start_method not in ("spawn", "forkserver"):
        return False
    return os.environ.get(ENV_VAR_PARALLEL_START, "1") != "0"


def _starter(process, keep_alive: bool, done: threading.Event, errors: list, index: int) -> None:
    """Body of a starter thread (Note [starter threads])."""
    try:
        process.start()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        errors[index] = exc
        return
    finally:
        done.set()
    if keep_alive:
        # Not the sentinel: a double-forked daemon would hold it (Note [waiting for exits]).
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def _start_all(processes, start_method: str) -> None:
    if start_method not in ("spawn", "forkserver"):
        for process in processes:
            process.start()
        return
    parallel = _parallel_start(start_method)
    keep_alive = start_method == "spawn"
    errors: list[BaseException | None] = [None] * len(processes)
    events = []
    try:
        for index, process in enumerate(processes):
            done = threading.Event()
            thread = threading.Thread(
                target=_starter,
                args=(process, keep_alive, done, errors, index),
                name=f"mp_spawn-starter-{index}",
                daemon=True,
            )
            thread.start()
            events.append(done)
            if not parallel:
                done.wait()
                if errors[index] is not None:
                    break
    finally:
        # Even when interrupted: the caller kills what was started, so every
        # start under way must have finished first.
        for done in events:
            done.wait()
    for error in errors:
        if error is not None:
            raise error


def _kill_started(processes) -> None:
    for process in processes:
        if process.pid is None:  # never started
            continue
        try:
            process.kill()
            process.join()
        except (OSError, ValueError, AssertionError):
            pass


@overload
def start_processes(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: Literal[True] = True,
                    daemon: bool = False, start_method: str = "spawn") -> None: ...
@overload
def start_processes(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, *, join: Literal[False],
                    daemon: bool = False, start_method: str = "spawn") -> ProcessContext: ...
@overload
def start_processes(fn: Callable[..., object], args: Sequence[Any], nprocs: int, join: Literal[False],
                    daemon: bool = False, start_method: str = "spawn") -> ProcessContext: ...
@overload
def start_processes(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
                    daemon: bool = False, start_method: str = "spawn") -> ProcessContext | None: ...
def start_processes(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
                    daemon: bool = False, start_method: str = "spawn") -> ProcessContext | None:
    r"""Start ``nprocs`` processes running ``fn(i, *args)`` with ``start_method``.

    Like :func:`spawn`, for any of ``"spawn"``, ``"forkserver"`` and
    ``"fork"``.  spawn and forkserver processes are started in parallel (set
    the environment variable ``MP_SPAWN_PARALLEL_START=0`` to start them one
    after another).  Every child dies when this process dies.

    Returns ``None`` when ``join`` is true (after every process exited
    cleanly), else a :class:`ProcessContext`.
    """
    if nprocs < 0:
        raise ValueError(f"nprocs must be at least 0, got {nprocs}")
    mp = multiprocessing.get_context(start_method)
    if start_method != "fork" and _importing_main_of_a_child():
        _refuse_unguarded_start()
    parent_pid = os.getpid()
    parent_start = _deathsig.start_time(parent_pid)
    _remove_stale_dirs()
    error_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{parent_pid}-{parent_start}-")
    # A forkserver child's parent is the fork server; only the watchdog knows us.
    expected_ppid = None if start_method == "forkserver" else parent_pid
    exit_timeout = _failed_exit_timeout()
    processes = [
        mp.Process(  # type: ignore[attr-defined]  # typeshed's BaseContext lacks it; every context has it
            target=_wrap,
            args=(fn, i, args, error_dir, parent_pid, parent_start, expected_ppid, exit_timeout),
            daemon=daemon,
        )
        for i in range(nprocs)
    ]
    error_files = [os.path.join(error_dir, f"{i}.error") for i in range(nprocs)]
    if start_method != "fork":
        for process, path in zip(processes, error_files, strict=True):
            process.name += _NAME_TAG + path  # Note [unguarded main]
    oom_base = _errors.oom_kills()  # before any child runs (_errors Note [OOM kills])
    try:
        _start_all(processes, start_method)
    except BaseException as exc:
        _kill_started(processes)
        # A child that refused to start said why; the start then failed writing to it (a broken pipe).
        records = [(i, _errors.read_record(path)) for i, path in enumerate(error_files)]
        shutil.rmtree(error_dir, ignore_errors=True)
        for i, record in records:
            if record is not None:
                raise _errors.raised_exception(i, processes[i].pid, record) from exc
        if start_method == "forkserver" and isinstance(exc, (ConnectionError, EOFError)):
            raise RuntimeError(_FORKSERVER_DIED) from exc
        raise
    finally:
        for process in processes:
            process.name = process.name.partition(_NAME_TAG)[0]
    context = ProcessContext(processes, error_files)
    context._oom_base = context._oom_claimed = oom_base
    context._error_dir = error_dir
    # Removes the directory when every process is joined, or when the context
    # is dropped or the interpreter exits, whichever comes first.
    context._finalizer = weakref.finalize(context, shutil.rmtree, error_dir, ignore_errors=True)
    if not join:
        return context
    try:
        while not context.join():
            pass
    except ProcessException:
        raise
    except BaseException:
        # Interrupted (Ctrl-C, a timeout signal): leave no child behind.
        context._terminate(first_wait=None, term_wait=_INTERRUPT_GRACE_S)
        context._finish()
        raise
    return None


@overload
def spawn(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: Literal[True] = True,
          daemon: bool = False, start_method: str = "spawn") -> None: ...
@overload
def spawn(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, *, join: Literal[False],
          daemon: bool = False, start_method: str = "spawn") -> ProcessContext: ...
@overload
def spawn(fn: Callable[..., object], args: Sequence[Any], nprocs: int, join: Literal[False],
          daemon: bool = False, start_method: str = "spawn") -> ProcessContext: ...
@overload
def spawn(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn") -> ProcessContext | None: ...
def spawn(fn: Callable[..., object], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn") -> ProcessContext | None:
    r"""Spawn ``nprocs`` processes that run ``fn(i, *args)``.

    If one of the processes exits with a non-zero exit status, the remaining
    processes are terminated and an exception is raised with the cause of
    termination.  If the child raised an exception, its traceback ends the
    message of the :class:`ProcessRaisedException` raised here.

    Args:
        fn: the entry point of the children, called as ``fn(i, *args)`` with
            ``i`` the process index.  It must be defined at the top level of
            an importable module so it can be pickled.
        args: the arguments passed to ``fn`` after the index.
        nprocs: the number of processes.
        join: wait for all processes (``True``) or return a
            :class:`ProcessContext` at once (``False``).
        daemon: the children's ``daemon`` flag.
        start_method: deprecated; always ``"spawn"``.  Use
            :func:`start_processes` for another start method.

    Returns:
        ``None`` if ``join`` is true, else a :class:`ProcessContext`.
    """
    if start_method != "spawn":
        msg = (
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method, call start_processes(...) with the same arguments, from the "
            "module you took spawn from (arraymp.start_processes, mp_spawn.start_processes)"
        )
        warnings.warn(msg, FutureWarning, stacklevel=2)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")
