"""Children die with their supervisor: PR_SET_PDEATHSIG plus a watchdog.

torch sets ``PR_SET_PDEATHSIG`` (to SIGINT) in each child and stops there.
That alone misses three cases, which this module covers:

* the parent died *before* the child called ``prctl`` (the kernel then never
  sends the signal): the child compares ``getppid()`` with the pid it expected
  right after the call;
* ``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked the child
  exits, not the parent process.  For ``forkserver`` the forking process is
  the fork server, not the supervisor;
* a catchable SIGINT can be swallowed by user code.

So the signal is SIGKILL, and each child also runs a daemon watchdog thread
that waits on a pidfd of the supervising process (or polls ``/proc`` where
pidfds are unavailable) and, when the supervisor is gone, kills its own
descendants and then itself::

    supervisor (pid P)                  child (one per index)
    ------------------                  ---------------------
    start_processes()  --start----->    prctl(PR_SET_PDEATHSIG, SIGKILL)
                                        getppid() == expected?  else die
                                        watchdog: poll(pidfd(P))
        ... P is SIGKILLed ...
                                        kernel: SIGKILL (forking thread gone)
                                        watchdog: pidfd readable -> kill
                                          descendants, then SIGKILL self

Each level of nesting does the same for its own children, so killing any
process kills everything below it.

Note [pid reuse]
~~~~~~~~~~~~~~~~
A pid alone names a process only while it lives.  The supervisor sends its pid
*and* its start time (field 22 of ``/proc/<pid>/stat``); the child opens the
pidfd first and then checks the start time, so a pid recycled between the
supervisor's death and ``pidfd_open`` is recognised as a stranger.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.2


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised command name)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].decode("ascii", "replace").split()


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, None if unknown."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])


def is_alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (zombies count as dead) and, if given, started at ``started``."""
    fields = _stat_fields(pid)
    if fields is None:
        if not os.path.isdir("/proc/self"):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    if fields[0] in ("Z", "X", "x"):
        return False
    return started is None or int(fields[19]) == started


def _load_prctl():
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Loaded at import, in the parent, so that fork children do not pay for it.
_prctl = _load_prctl()


def set_pdeathsig(signum: int = signal.SIGKILL) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum) for the calling process; False if unavailable."""
    if _prctl is None:
        return False
    return _prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def descendants(root: int) -> list[int]:
    """Pids of ``root``'s descendants, deepest first, from one scan of /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None or len(fields) < 2:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    order: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, ()):
            order.append(child)
            stack.append(child)
    order.reverse()
    return order


def _die() -> None:
    """Kill everything below this process, then this process."""
    me = os.getpid()
    for pid in descendants(me):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(me, signal.SIGKILL)


def _watch(fd: int | None, pid: int, started: int | None) -> None:
    """The watchdog thread's body: return only by killing this process tree."""
    if fd is not None:
        try:
            while True:
                readable, _, _ = select.select([fd], [], [])
                # Readable means the process exited; check, in case user code
                # closed our fd and the number now names something else.
                if readable and not is_alive(pid, started):
                    _die()
                if readable:
                    break
        except (OSError, ValueError):
            pass  # our fd was closed under us: fall back to polling
    stop = threading.Event()
    while is_alive(pid, started):
        stop.wait(_POLL_INTERVAL_S)
    _die()


def start_watchdog(parent_pid: int, parent_start: int | None) -> threading.Thread | None:
    """Start a daemon thread that kills this process tree when ``parent_pid`` dies.

    Dies at once if the parent is already gone.  Returns the thread.
    """
    fd = None
    try:
        fd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        _die()
    except (AttributeError, OSError):
        fd = None  # no pidfd (old kernel, seccomp): poll /proc instead
    if parent_start is not None and not is_alive(parent_pid, parent_start):
        _die()  # gone, or the pid now names someone else (Note [pid reuse])
    thread = threading.Thread(target=_watch, args=(fd, parent_pid, parent_start), name="mp_spawn-watchdog", daemon=True)
    thread.start()
    return thread


def bind_to_parent(parent_pid: int, parent_start: int | None, expected_ppid: int | None) -> None:
    """Make the calling child die with its supervisor (see the module docstring)."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - the package refuses to import
        return
    set_pdeathsig(signal.SIGKILL)
    if expected_ppid is not None and os.getppid() != expected_ppid:
        _die()  # the forking parent died before prctl: the kernel will not tell us
    start_watchdog(parent_pid, parent_start)
