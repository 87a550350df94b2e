"""Start ``nprocs`` processes running ``fn(i, *args)`` and supervise them.

Adapted from ``torch/multiprocessing/spawn.py`` (same API, same messages) on
top of the stdlib ``multiprocessing`` contexts.  What changed:

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
  which a double-forked daemon inherits (Note [waiting for exits]);
* a script that starts processes without ``if __name__ == "__main__":`` gets
  an error that says so (Note [unguarded main]).

::

    parent                                   child i (any start method)
    ------                                   --------------------------
    mkdtemp() -> D (0700)
    start_processes --Process.start()-->     _wrap: bind_to_parent (deathsig)
                                               open D/i.fault  (= "started")
    ProcessContext.join                        fn(i, *args)
      wait(pidfds)                             on BaseException: write D/i.error,
      on failure: grace, SIGTERM, SIGKILL        stop own children, exit 1
      read + remove D/i.error, D/i.fault
      raise ProcessRaisedException / ProcessExitedException
    rmdir D once every process is joined     (the group reaper removes D if the parent
                                              was killed first: _deathsig._reap_group)

Note [starter threads]
~~~~~~~~~~~~~~~~~~~~~~
``Process.start()`` for spawn and forkserver pickles the process object and
writes it into a pipe the child reads only after its interpreter booted (and
re-imported ``__main__``); with more than a pipe's worth of arguments each
start waits for one child boot.  Starting every process from its own thread
overlaps those waits.  But PR_SET_PDEATHSIG fires when the *thread* that
forked the child exits (torch found its spawn children killed by SIGINT when
its thread pool finished, and gave up on parallel spawn).  So a spawn starter
thread stays alive, blocked in ``waitid(WNOWAIT)`` (which reaps nothing), until
its child exits.  forkserver children are forked by the fork server, so their
starter threads end at once.  fork children are started from the calling thread, one by one
(fork is cheap, and forking from a helper thread would make every later fork
warn about threads on Python >= 3.12).

Note [waiting for exits]
~~~~~~~~~~~~~~~~~~~~~~~~
``Process.sentinel`` of a fork or spawn child is the read end of a pipe whose
write end the child holds; it turns readable when every copy of that end is
closed.  ``os.fork`` copies every descriptor, so a daemon the child starts the
classic way (fork, ``setsid``, fork: it leaves the child's group, and the group
reaper lets it live) holds the pipe open: waiting on sentinels, ``join`` would
return only when the daemon exits, where ``Process.join`` (``waitpid``)
returns at once.  So ``join`` waits on a pidfd of each child, readable when
the child itself exits.  An unreaped child keeps its pid, so the pidfd cannot
name a stranger.  A forkserver child is the fork server's: its sentinel is a
pipe the fork server writes the exit code into, which is right as it is.
Where there are no pidfds (Linux < 5.3, seccomp), a thread per child blocks in
``waitid(WNOWAIT)`` (which reaps nothing) and then writes a byte into a pipe:
data, unlike the end of a pipe, cannot be held back by an inherited copy.

Note [unguarded main]
~~~~~~~~~~~~~~~~~~~~~
A spawn or forkserver child imports the main module again (as ``__mp_main__``)
before it reads its function.  A script that calls ``spawn`` at its top level,
without ``if __name__ == "__main__":``, calls it again there; the stdlib
refuses to start processes then and the child exits with code 1, which the
parent could only report as "terminated with exit code 1 before it could run
its function".  So ``start_processes``, called while the process imports the
main module for a start (``current_process()._inheriting``, the flag the
stdlib checks), raises a RuntimeError that names the guard, and writes it to
the error file of this child, for the parent to raise as usual.  The child
knows that file from its process name: the parent sends the name to the child
before the main module (the one thing it sends first), so it appends the path
(``_NAME_TAG``) for the start and takes it off again on both sides.  The
fork server imports the main module itself as it starts (it preloads
``__main__``), and such a script may end it there, before any child exists:
our RuntimeError (or the stdlib's) goes to its stderr, and where the
connection to the fork server is authenticated (3.13.x and 3.14 seen here;
3.11.7's children fail instead) the start fails with a broken connection.  A forkserver start that fails so, with
no child's error file, raises a RuntimeError that names the guard.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from . import _deathsig, _errors
from ._errors import ProcessException, ProcessExitedException, ProcessRaisedException

__all__ = [
    "ENV_VAR_FAILED_EXIT_TIMEOUT",
    "ENV_VAR_PARALLEL_START",
    "ProcessContext",
    "SpawnContext",
    "spawn",
    "start_processes",
]

log = logging.getLogger("mp_spawn")

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

# Contexts created in this process and not yet finished; a failing child stops
# the ones it owns before it exits.
_live_contexts: weakref.WeakSet[ProcessContext] = weakref.WeakSet()

_fault_file = None  # the child's faulthandler file, kept open until exit

# Appended to a spawn or forkserver child's name for its start, with its error file (Note [unguarded main]).
_NAME_TAG = " mp_spawn-error-file="


# --- the child's side -------------------------------------------------------


def _wrap(fn, i, args, error_dir, parent_pid, parent_start, expected_ppid, exit_timeout):
    """The target of every child process."""
    current = multiprocessing.current_process()
    current.name = current.name.partition(_NAME_TAG)[0]
    _deathsig.bind_to_parent(parent_pid, parent_start, expected_ppid, error_dir)
    _enable_faulthandler(os.path.join(error_dir, f"{i}.fault"))
    try:
        fn(i, *args)
    except SystemExit:
        raise  # sys.exit(code): the exit code says it all
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is a failure too
        _errors.write_record(os.path.join(error_dir, f"{i}.error"), exc)
        del exc
        _stop_own_children()
        _arm_exit_backstop(exit_timeout)
        sys.exit(1)


_FORKSERVER_DIED = (
    "the fork server exited before it could start the processes. It imports the main module first, and a script "
    "that starts processes (or makes a pool) at its top level fails there: its traceback is on stderr above. "
    'The script needs `if __name__ == "__main__":`; put the code that starts processes under it.'
)


def _refuse_unguarded_start() -> None:
    """Raise the error of a script without ``if __name__ == "__main__":``, in the child (Note [unguarded main])."""
    exc = RuntimeError(
        "a spawn or forkserver child called spawn() or start_processes() while it imported the main module again "
        "(as __mp_main__, which such a child does before it runs its function): the script starts processes at "
        "its top level (see the traceback). "
        'The script needs `if __name__ == "__main__":`; put the code that starts processes under it.'
    )
    path = multiprocessing.current_process().name.partition(_NAME_TAG)[2]
    if path:  # a child of ours: its parent raises this error too
        _errors.write_record(path, exc, stack=traceback.extract_stack(sys._getframe(1)))
    raise exc


def _enable_faulthandler(path: str) -> None:
    """Open the fault file (its existence tells the parent ``fn`` was reached)."""
    global _fault_file
    try:
        _fault_file = open(path, "w")  # noqa: SIM115 - must stay open until exit
    except OSError:
        return
    faulthandler.enable(file=_fault_file, all_threads=True)


def _stop_own_children() -> None:
    me = os.getpid()
    for context in list(_live_contexts):
        if context._owner_pid == me:
            context._terminate(first_wait=None, term_wait=1.0)
            context._finish()


def _arm_exit_backstop(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


# --- the parent's side ------------------------------------------------------


class ProcessContext:
    """The processes started by :func:`start_processes`, and their supervisor.

    ``processes`` are the ``multiprocessing.Process`` objects, in index order;
    ``error_files`` the paths their errors would be written to.
    """

    def __init__(self, processes, error_files):
        self.processes = list(processes)
        self.error_files = list(error_files)
        # Readable when the process exited (Note [waiting for exits]); those in _exit_fds are ours to close.
        self._exit_fds: set[int] = set()
        weakref.finalize(self, _close_fds, self._exit_fds)
        self.sentinels = {self._exit_fd(process): index for index, process in enumerate(self.processes)}
        self._owner_pid = os.getpid()
        self._error_dir: str | None = None
        self._finalizer = None
        self._failure: ProcessException | None = None
        self._outcomes: dict[int, tuple[dict | None, str, bool]] = {}
        self._signalled: dict[int, float] = {}
        # the memory cgroup's OOM count before the children started, and the last one given to a death
        # (_errors Note [OOM kills]); start_processes sets it from before it started them
        self._oom_base = self._oom_claimed = _errors.oom_kills()
        _live_contexts.add(self)

    def pids(self) -> list[int]:
        """The process ids, in index order."""
        return [int(process.pid) for process in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        r"""Wait for the processes; raise if one of them failed.

        Returns ``True`` when every process exited cleanly (and keeps returning
        ``True`` when called again), ``False`` when ``timeout`` seconds passed
        and some still run.  When one failed (an exception, a non-zero exit
        code or a signal), waits ``grace_period`` seconds for the others, then
        sends SIGTERM to those still running, waits ``grace_period`` again (30
        seconds when it is ``None``), sends SIGKILL to the rest, logs a warning
        naming each pid it signals, and raises :class:`ProcessRaisedException`
        or :class:`ProcessExitedException` for the first failure, with every
        other failure it found in the message.  Called again after that, it
        raises the same exception.
        """
        if self._failure is not None:
            raise self._failure
        if not self.sentinels:
            self._finish()
            return True

        try:
            ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        except KeyboardInterrupt:
            self._relay(signal.SIGINT)
            raise
        failed = []
        for sentinel in ready:
            index = self._reap(sentinel)  # type: ignore[arg-type]  # wait() gives back the ints it was given
            if self.processes[index].exitcode != 0:
                failed.append(index)

        if not failed:
            if self.sentinels:
                return False
            self._finish()
            return True

        failed.sort()
        self._terminate(first_wait=grace_period, term_wait=30.0 if grace_period is None else grace_period)
        for index in range(len(self.processes)):
            if index not in failed and self._failed_on_its_own(index):
                failed.append(index)
        exceptions = [self._exception(index) for index in failed]
        self._failure = _combine(exceptions)
        self._finish()
        raise self._failure

    # -- internals

    def _relay(self, signum: int) -> None:
        """Send ``signum`` to the process group of every child not yet joined.

        Each child leads a session of its own, so the terminal's Ctrl-C no
        longer reaches it (Note [process groups] in ``_deathsig``).
        """
        for index in self.sentinels.values():
            process = self.processes[index]
            # Not reaped yet, so its pid, and the group named after it, are still its own.
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signum)

    def _exit_fd(self, process) -> int:
        """A descriptor that turns readable when ``process`` exits (Note [waiting for exits])."""
        pid = process.pid
        fields = _deathsig._stat_fields(pid)
        if fields is None or int(fields[1]) != os.getpid():
            return process.sentinel  # a forkserver child (or one joined already)
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # no pidfds
            fd, write_end = os.pipe()
            threading.Thread(target=_signal_exit, args=(pid, write_end), name="mp_spawn-exit", daemon=True).start()
        self._exit_fds.add(fd)
        return fd

    def _reap(self, sentinel: int) -> int:
        """Join the finished process of ``sentinel`` and collect (then remove) its files; return its index."""
        index = self.sentinels.pop(sentinel)
        if sentinel in self._exit_fds:
            self._exit_fds.discard(sentinel)
            os.close(sentinel)
        process = self.processes[index]
        process.join()
        record = None
        fault = ""
        started = True
        path = self.error_files[index]
        if path is not None:
            record = _errors.read_record(path)
            fault_path = os.path.join(os.path.dirname(path), f"{index}.fault")
            try:
                with open(fault_path, errors="replace") as fh:
                    fault = fh.read()
                os.unlink(fault_path)
            except FileNotFoundError:
                started = False
        self._outcomes[index] = (record, fault, started)
        return index

    def _failed_on_its_own(self, index: int) -> bool:
        exitcode = self.processes[index].exitcode
        if exitcode == 0:
            return False
        if index not in self._signalled:
            return True
        record = self._outcomes[index][0]
        return record is not None and record["time"] < self._signalled[index]

    def _exception(self, index: int) -> ProcessException:
        process = self.processes[index]
        record, fault, started = self._outcomes[index]
        if record is not None:
            return _errors.raised_exception(index, process.pid, record)
        oom = self._oom_kill() if process.exitcode == -signal.SIGKILL and index not in self._signalled else None
        msg, name = _errors.exited_message(index, process.exitcode, started, oom)
        if process.exitcode < 0 and fault.strip():
            msg += f"\n\n-- Python stack of process {index:d} when it received {name}:\n{fault.rstrip()}\n"
        return ProcessExitedException(msg, index, process.pid, process.exitcode, name)

    def _oom_kill(self) -> bool | None:
        """Whether a child's SIGKILL was the OOM killer's: the count rose past the last one given (None: unknown)."""
        now = _errors.oom_kills()
        if now is None or self._oom_claimed is None:
            return None
        if now > self._oom_claimed:
            self._oom_claimed += 1
            return True
        return False

    def _wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every unjoined process."""
        deadline = time.monotonic() + seconds
        while self.sentinels:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for sentinel in multiprocessing.connection.wait(list(self.sentinels), timeout=remaining):
                self._reap(sentinel)  # type: ignore[arg-type]  # as in join()

    def _terminate(self, first_wait: float | None, term_wait: float) -> None:
        """Wait, SIGTERM, wait, SIGKILL: afterwards every process is joined."""
        if first_wait is not None:
            self._wait(first_wait)
        for index in list(self.sentinels.values()):
            process = self.processes[index]
            if process.is_alive():
                log.warning("Terminating process %s via signal SIGTERM", process.pid)
                self._signalled[index] = time.time()
                process.terminate()
        self._wait(term_wait)
        for index in list(self.sentinels.values()):
            process = self.processes[index]
            if process.is_alive():
                log.warning(
                    "Unable to shutdown process %s via SIGTERM, forcefully exiting via SIGKILL",
                    process.pid,
                )
                self._signalled.setdefault(index, time.time())
                process.kill()
        for sentinel in list(self.sentinels):
            self._reap(sentinel)

    def _finish(self) -> None:
        """Forget this context once every process is joined; remove its directory."""
        _live_contexts.discard(self)
        if self._finalizer is not None:
            self._finalizer()


class SpawnContext(ProcessContext):
    """Deprecated alias of :class:`ProcessContext` (its name before torch 1.4)."""

    def __init__(self, processes, error_files):
        warnings.warn(
            "SpawnContext is renamed to ProcessContext; use ProcessContext",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(processes, error_files)


def _signal_exit(pid: int, write_end: int) -> None:
    """Write a byte to ``write_end`` once child ``pid`` exited (Note [waiting for exits])."""
    with contextlib.suppress(ChildProcessError):  # reaped already (is_alive() in _terminate may reap it)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    with contextlib.suppress(OSError):  # the context was dropped and closed the read end
        os.write(write_end, b"x")
    os.close(write_end)


def _close_fds(fds: set[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _combine(exceptions: list[ProcessException]) -> ProcessException:
    """The first failure, with the others in its message."""
    first, others = exceptions[0], exceptions[1:]
    first.other_failures = others
    if not others:
        return first
    text = ""
    for other in others:
        if isinstance(other, ProcessRaisedException):
            text += f"\n\n-- Process {other.error_index:d} also failed with the following error:\n"
            text += other.child_traceback or ""
        else:
            text += f"\n\n-- Process {other.error_index:d} also failed: {other.msg}"
    if isinstance(first, ProcessRaisedException):
        # The first failure's traceback keeps ending the message, as in torch.
        first.msg = f"\n\n-- {len(exceptions)} processes failed; process {first.error_index:d} first.{text}{first.msg}"
    else:
        first.msg = first.msg + text
    first.args = (first.msg,)
    return first


# --- starting ---------------------------------------------------------------


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
    if start_method != "fork" and getattr(multiprocessing.current_process(), "_inheriting", False):
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
