"""Children die with their supervisor (PR_SET_PDEATHSIG plus a watchdog), their process groups with them.

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

What the child starts without us (``subprocess.Popen``, ``os.fork``) has no
death signal and no watchdog, and PR_SET_PDEATHSIG kills the child before its
watchdog can look for it.  So each child also leads its own session (Note [a session of its own]), and so
its own process group (torchrun starts its workers so too), and starts a
*group reaper* in it: a small process (this module, run as a script) that ends
the group once the child is gone, however it went::

    child C (pgid C)              reaper R (pgid C)           C's descendants (pgid C)
    ----------------              -----------------           ------------------------
    setsid()
    posix_spawn R  --exec----->   poll(pidfd(C))
    fn(i, *args)  --Popen, fork, multiprocessing, shells--->  ...
        ... C ends: SIGKILL (its supervisor died), SIGTERM (spawn
            terminates it), an exception, a return ...
                                  killpg(C, SIGTERM) -------> most exit; cleanup daemons
                                  wait <= 1 s for them          (resource tracker) ignore
                                  SIGKILL each member  -----> it; the rest are killed;
                                    but the cleanup daemons     the daemons clean up and
                                  exit                          exit (Note [cleanup daemons])

Note [pid reuse]
~~~~~~~~~~~~~~~~
Invariant: a process known by its pid is watched or signalled only through a pidfd opened before a check of its start
time (field 22 of ``/proc/<pid>/stat``), so a recycled pid is recognised as a stranger.

A pid alone names a process only while it lives. The supervisor sends its pid *and* its start time; the child opens
the pidfd first and then checks the start time, so a pid recycled between the supervisor's death and ``pidfd_open``
is caught. The group reaper watches its child the same way.

Note [process groups]
~~~~~~~~~~~~~~~~~~~~~
Invariant: the group reaper is a member of its child's process group from before ``fn`` runs until it has sent
SIGKILL to the group's other members.

Why: a process group's id is not handed out again while the group has a member, so ``killpg(C)`` from the reaper
reaches C's group and no one else's, even after C is dead and its pid recycled; and a process whose ``/proc`` entry
says group C is in C's group. SIGKILL goes to each member by pidfd, after a check of its start time and group (Note
[pid reuse]): a member that left the group in between (``setsid``) is spared. The reaper ignores SIGINT, SIGTERM and
SIGHUP, so signals meant for the group (``killpg`` in user code, its own SIGTERM) do not take it away first.

Covered: everything the child starts that stays in its process group (``subprocess.Popen``, ``os.fork``,
``multiprocessing`` pools and managers, shells and their pipelines), at any depth, however the child ends.

One rule for what leaves the group (``setsid``, ``setpgid``, ``start_new_session=True``; daemons do): it is never
killed, under every start method. The reaper spares it, and so does the watchdog, which kills only the members of the
child's group below it (under ``forkserver`` the watchdog, not PR_SET_PDEATHSIG, ends the child, so a scan of the
whole tree would kill a daemon that ``fork`` and ``spawn`` leave alive). Nested ``spawn`` children lead groups of
their own and die by their own watchdogs. A reaper killed by someone else kills nothing.

Note [cleanup daemons]
~~~~~~~~~~~~~~~~~~~~~~
Invariant: the group reaper never sends SIGKILL to a cleanup daemon (known by its command line:
``_CLEANUP_DAEMONS``): it SIGKILLs the other members one by one and leaves, and the daemons see their clients go,
clean up and exit on their own, as they do outside mp-spawn. A daemon that still serves someone outside the group (a
process that left it) goes on serving it.

Why: some processes exist to clean up after the others. multiprocessing's resource tracker (started by the first
``SharedMemory`` or semaphore of a fork child, in the child's group) unlinks the segments its clients leaked once the
last holder of its pipe is gone; shm-manager's daemon does the same for named segments. They ignore SIGTERM. SIGKILL,
sent to the whole group while a grandchild that inherited the tracker's pipe was still handling SIGTERM, would kill
the tracker before it sees the end of its pipe, and ``psm_*`` segments would stay in /dev/shm.

Note [a session of its own]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: each child leads a session of its own (``os.getsid(pid) == pid``), so it has no controlling terminal: what
the terminal sends (Ctrl-C, Ctrl-Z, Ctrl-\\, hangup) reaches only the supervisor, and ``ProcessContext.join`` relays
a KeyboardInterrupt to the children's groups as SIGINT, which is what the terminal did when they shared the
supervisor's group.

The price: Ctrl-Z stops the supervisor alone; ``/dev/tty`` cannot be opened in a child; and a child, a session
leader, cannot call ``setsid`` or ``setpgid`` itself (EPERM). Why a new session rather than only a new group: as the
terminal is not the child's controlling terminal, a child that reads from it (``open("/dev/stdin")``, a debugger say)
or sets its modes is not stopped by SIGTTIN or SIGTTOU, as a background job would be.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import sys
import threading
import time
import warnings

PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.2
# How long the group reaper lets a dead child's group handle SIGTERM before it sends SIGKILL.
_GROUP_GRACE_S = 1.0
_GROUP_POLL_INTERVAL_S = 0.05
# How long the group reaper of a dead child waits for its supervisor to finish dying (``_died_without_cleaning_up``).
_SUPERVISOR_EXIT_S = 5.0
# The command lines of the cleanup daemons the group reaper lets finish (Note [cleanup daemons]):
# an argument that follows the flag starts with the prefix.
_CLEANUP_DAEMONS = (
    (b"-c", b"from multiprocessing.resource_tracker import main"),  # the stdlib's resource tracker
    (b"-m", b"shm_manager._daemon"),  # shm-manager's (it starts in a session of its own anyway)
)


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


def _scan() -> dict[int, list[str]]:
    """Fields 3.. of /proc/<pid>/stat of every process, from one scan of /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for name in entries:
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and len(fields) >= 3:
                found[int(name)] = fields
    return found


def descendants(root: int, pgid: int | None = None) -> list[int]:
    """Pids of ``root``'s descendants, deepest first, from one scan of /proc (``pgid``: those of that process group
    only, at any depth)."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    for pid, fields in _scan().items():
        children.setdefault(int(fields[1]), []).append(pid)
        groups[pid] = int(fields[2])
    order: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, ()):
            if pgid is None or groups[child] == pgid:
                order.append(child)
            stack.append(child)
    order.reverse()
    return order


def _is_cleanup_daemon(pid: int) -> bool:
    """Whether ``pid``'s command line is one of ``_CLEANUP_DAEMONS`` (Note [cleanup daemons])."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return any(
        flag == option and value.startswith(prefix)
        for flag, prefix in _CLEANUP_DAEMONS
        for option, value in zip(argv, argv[1:], strict=False)
    )


def _group_members(pgid: int) -> set[tuple[int, int]]:
    """(pid, start time) of each process of group ``pgid`` but this one, zombies and cleanup daemons."""
    me = os.getpid()
    return {
        (pid, int(fields[19]))
        for pid, fields in _scan().items()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X", "x") and pid != me and not _is_cleanup_daemon(pid)
    }


def _kill_member(pid: int, started: int, pgid: int) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``started``, in group ``pgid``."""
    try:
        fd = _open_pidfd(pid, started)
    except ProcessLookupError:
        return
    try:
        fields = _stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid:  # else it left the group since: not ours
            if fd is None:
                os.kill(pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass  # gone, or not ours to signal (a setuid program)
    finally:
        if fd is not None:
            os.close(fd)


def _die() -> None:
    """Kill everything below this process in its process group, then this process (Note [process groups]: what
    left the group is spared, as the group reaper spares it)."""
    me = os.getpid()
    for pid in descendants(me, os.getpgid(0)):
        if pid == _reaper:
            continue  # it ends the group once we are gone, and cleans up after a dead supervisor
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(me, signal.SIGKILL)


def _open_pidfd(pid: int, started: int | None) -> int | None:
    """A pidfd of ``pid``, None where there are none (old kernel, seccomp: poll /proc instead).

    Raises ProcessLookupError when ``pid`` is gone or now names someone else:
    the fd is opened first and the start time checked second (Note [pid reuse]).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        fd = None
    if not is_alive(pid, started):
        if fd is not None:
            os.close(fd)
        raise ProcessLookupError(pid)
    return fd


def _wait_for_exit(fd: int | None, pid: int, started: int | None) -> None:
    """Return once ``pid`` is gone: when ``fd``, its pidfd, turns readable, or by polling /proc."""
    if fd is not None:
        try:
            exited = select.poll()  # (select.select fails past descriptor 1023)
            exited.register(fd, select.POLLIN)
            exited.poll()
        except (OSError, ValueError):
            pass  # our fd was closed under us: fall back to polling
    # Readable means the process exited; check, in case user code closed our
    # fd and the number now names something else.
    stop = threading.Event()
    while is_alive(pid, started):
        stop.wait(_POLL_INTERVAL_S)


def _watch(fd: int | None, pid: int, started: int | None) -> None:
    """The watchdog thread's body: return only by killing this process tree."""
    _wait_for_exit(fd, pid, started)
    _die()


def start_watchdog(parent_pid: int, parent_start: int | None) -> threading.Thread | None:
    """Start a daemon thread that kills this process tree when ``parent_pid`` dies.

    Dies at once if the parent is already gone.  Returns the thread.
    """
    fd = None
    try:
        fd = _open_pidfd(parent_pid, parent_start)
    except ProcessLookupError:
        _die()
    thread = threading.Thread(target=_watch, args=(fd, parent_pid, parent_start), name="mp_spawn-watchdog", daemon=True)
    thread.start()
    return thread


_reaper: int | None = None  # this process's group reaper


def start_group_reaper(supervisor: tuple[int, int | None, str] | None = None) -> None:
    """Lead a session and process group of our own, and start its reaper (Note [process groups]); ``supervisor``:
    (pid, start time, error directory), the directory the reaper removes if the supervisor died first."""
    me = os.getpid()
    os.setsid()
    # multiprocessing.set_executable() imports multiprocessing.spawn; unless
    # it is imported, sys.executable is the answer (and a fork child does not
    # pay 17 ms to import it).
    spawn = sys.modules.get("multiprocessing.spawn")
    executable = sys.executable if spawn is None else spawn.get_executable()
    # -I: neither the environment nor this package's directory changes what
    # the reaper imports; -S: it needs nothing from site-packages.
    argv = [executable, "-I", "-S", os.path.abspath(__file__), str(me), str(start_time(me))]
    if supervisor is not None:
        argv += [str(supervisor[0]), str(supervisor[1]), supervisor[2]]
    global _reaper
    try:
        _reaper = os.posix_spawn(executable, argv, os.environ, file_actions=_close_inheritable())
    except OSError as exc:
        warnings.warn(
            f"mp_spawn: process {me} could not start its group reaper ({exc}), so what it starts may outlive it; "
            f"point multiprocessing.set_executable() at a Python interpreter (now {executable!r})",
            RuntimeWarning,
            stacklevel=2,
        )


def _close_inheritable() -> list[tuple[int, int]]:
    """posix_spawn file actions that keep our inheritable fds from the reaper.

    A spawn child inherits the write end of the pipe its parent's sentinel
    reads: held by the reaper too, the child would look alive until the reaper
    ends.  Likewise the resource tracker's pipe.
    """
    actions: list[tuple[int, int]] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return actions  # no /proc: the reaper may hold them, a child's end may come late
    for name in names:
        try:
            if int(name) > 2 and os.get_inheritable(int(name)):
                actions.append((os.POSIX_SPAWN_CLOSE, int(name)))
        except OSError:
            pass  # the fd that listed the directory, closed since
    return actions


def _reap_group(leader: int, started: int | None, supervisor: tuple[int, int | None, str] | None = None) -> None:
    """The group reaper's main: once ``leader`` is gone, end its process group.

    SIGTERM first; then, after at most ``_GROUP_GRACE_S``, SIGKILL to each
    member but the cleanup daemons, which exit on their own once the processes
    they serve are gone, having cleaned up after them (Note [cleanup daemons]).
    Then, if the supervisor died before its child (SIGKILL: it could not clean
    up), remove its error directory, as its next run would (``_spawn``).
    """
    try:
        _end_group(leader, started)
    finally:
        if supervisor is not None and _died_without_cleaning_up(*supervisor):
            _remove_error_dir(supervisor[2])


def _died_without_cleaning_up(pid: int, started: int | None, error_dir: str) -> bool:
    """Whether the supervisor is gone, leaving ``error_dir``: waits up to ``_SUPERVISOR_EXIT_S`` while it lives and
    the directory is there.

    Its death may not show yet: the kernel sends PR_SET_PDEATHSIG when the supervisor's *forking thread* exits, and
    its other threads (the main one, whose state ``/proc/<pid>/stat`` shows) exit after, each when it gets a CPU. A
    supervisor that lives on removes the directory itself once it has joined every child.
    """
    deadline = time.monotonic() + _SUPERVISOR_EXIT_S
    while is_alive(pid, started):
        if not os.path.lexists(error_dir) or time.monotonic() >= deadline:
            return False
        time.sleep(_GROUP_POLL_INTERVAL_S)
    return True


def _remove_error_dir(path: str) -> None:
    """Remove ``path``, a supervisor's error directory, if it is a directory of this user's (never a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def _end_group(leader: int, started: int | None) -> None:
    if os.getpgid(0) != leader:
        return  # not in the child's group: without the invariant of Note [process groups], kill nothing
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        fd = _open_pidfd(leader, started)
    except ProcessLookupError:
        pass  # gone already
    else:
        _wait_for_exit(fd, leader, started)
    os.killpg(leader, signal.SIGTERM)
    deadline = time.monotonic() + _GROUP_GRACE_S
    while _group_members(leader) and time.monotonic() < deadline:
        time.sleep(_GROUP_POLL_INTERVAL_S)
    # Until a scan finds no member not yet killed: what forked before its parent was killed is found by the next.
    killed: set[tuple[int, int]] = set()
    while fresh := _group_members(leader) - killed:
        for pid, started in fresh:
            _kill_member(pid, started, leader)
        killed |= fresh


def bind_to_parent(parent_pid: int, parent_start: int | None, expected_ppid: int | None,
                   error_dir: str | None = None) -> None:
    """Make the calling child, and what it starts, die with its supervisor (see the module docstring); its group
    reaper removes ``error_dir`` if the supervisor dies first."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - the package refuses to import
        return
    set_pdeathsig(signal.SIGKILL)
    if expected_ppid is not None and os.getppid() != expected_ppid:
        _die()  # the forking parent died before prctl: the kernel will not tell us
    start_group_reaper(None if error_dir is None else (parent_pid, parent_start, error_dir))
    start_watchdog(parent_pid, parent_start)


def _number(arg: str) -> int | None:
    return int(arg) if arg.isdigit() else None


if __name__ == "__main__":  # the group reaper: python -I -S _deathsig.py LEADER START [SUPERVISOR START ERROR_DIR]
    _reap_group(int(sys.argv[1]), _number(sys.argv[2]),
                (int(sys.argv[3]), _number(sys.argv[4]), sys.argv[5]) if len(sys.argv) == 6 else None)
