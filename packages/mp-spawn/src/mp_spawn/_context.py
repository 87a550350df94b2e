"""The supervisor of the started processes: ``ProcessContext``, which joins them and raises their failures.

Adapted from ``ProcessContext`` of ``torch/multiprocessing/spawn.py`` (same
API, same messages).  What changed: ``join`` waits on each child's exit, not
on its sentinel pipe (Note [waiting for exits]); it reports every failure it
finds, not only the first, each with the Python stack a fatal signal left
(``faulthandler``) and whether the OOM killer sent a SIGKILL (``_errors``
Note [OOM kills]); a failure terminates the others with SIGTERM, then
SIGKILL; Ctrl-C in a blocking ``join`` is relayed to the children's process
groups (Note [a session of its own] in ``_deathsig``).  The contexts of a process
that are not finished yet are kept in ``_live_contexts``, which a failing
child stops before it exits (``_child``).

Note [waiting for exits]
~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: ``join`` sees a child as ended when the child itself exits, as ``Process.join`` (``waitpid``) does, even
while a daemon the child started (fork, ``setsid``, fork) still holds copies of its descriptors.

Why: ``Process.sentinel`` of a fork or spawn child is the read end of a pipe whose write end the child holds; it
turns readable when every copy of that end is closed. ``os.fork`` copies every descriptor, so a daemon the child
starts the classic way (it leaves the child's group, and the group reaper lets it live) holds the pipe open: waiting
on sentinels, ``join`` would return only when the daemon exits. So ``join`` waits on a pidfd of each child, readable
when the child itself exits. An unreaped child keeps its pid, so the pidfd cannot name a stranger. A forkserver child
is the fork server's: its sentinel is a pipe the fork server writes the exit code into, which is right as it is.
Where there are no pidfds (Linux < 5.3, seccomp), a thread per child blocks in ``waitid(WNOWAIT)`` (which reaps
nothing) and then writes a byte into a pipe: data, unlike the end of a pipe, cannot be held back by an inherited
copy.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import warnings
import weakref

from . import _deathsig, _errors
from ._errors import ProcessException, ProcessExitedException, ProcessRaisedException

__all__ = ["ProcessContext", "SpawnContext"]

log = logging.getLogger("mp_spawn")

# Contexts created in this process and not yet finished; a failing child stops
# the ones it owns before it exits.
_live_contexts: weakref.WeakSet[ProcessContext] = weakref.WeakSet()


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
        longer reaches it (Note [a session of its own] in ``_deathsig``).
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
