"""Group locks, the runtime directory, the daemon's socket, its log, and segment names.

Note [Proof of death]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a group is dead in a directory D exactly when ``flock(LOCK_EX | LOCK_NB)`` on ``<runtime dir of
D>/<group>.lock`` succeeds, and nobody ever holds a lock on a file that is no longer the group's lock file.

Every process of the group that has made or received a named segment in D, and every process of another group that
holds one of the group's segments there (Note [Holds across groups] in _group.py), holds ``flock(LOCK_SH)`` on that
file from then on for as long as it lives; the kernel drops the lock when the process dies, whatever killed it. That
is proof, not a guess from pids (pids are reused and are not visible across pid namespaces).

Whoever proves a group dead keeps the exclusive lock while it removes the group's segments (and its daemon's socket),
then unlinks the lock file and closes it. A process joining the group meanwhile blocks in ``LOCK_SH``; once it has
the lock it checks that the path still names the inode it locked, and starts over when it does not.

Not covered: membership is taken at the first named segment (see _group.py), not at import, so a segment in flight to
a process that has the token but never touched a named segment is kept alive only by the members that did: when all
of them have ended before it arrives, it is gone, like a message lost in a crash.

Note [Runtime directory]
~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: every process of a user uses the same runtime directory for segments in D: ``ARRAYMP_RUNTIME_DIR`` where
it is set, else ``D/.arraymp-<uid>`` (a real directory, owned by the user, 0700), else the first
``D/.arraymp-<uid>-<random>`` by name. So the liveness locks live on the same filesystem, and are seen by the same
processes, as the segments they vouch for, whatever $XDG_RUNTIME_DIR or private /tmp each process has.

D is shared (sticky, world-writable), so another user can create that name first (a directory or a symlink): then a
fallback made by ``mkdtemp`` is used, with one warning. Nobody else can make a directory owned by us, so every
process of the user finds the same fallback by listing D, and lookups (gc, the sweep) cover all of our runtime
directories in D. A fallback that exists is used even after the squatter left, so running groups and new ones agree.
Inside, files are opened with ``O_NOFOLLOW``; the daemon's socket is reached through a descriptor of the directory
(``/proc/self/fd/<n>/<group>.sock``: no path length limit).

Not covered: two processes that both find no fallback at the same moment each make one; gc covers both, and a member
joins its group's lock wherever it is: only members of one group making their first segments at that very moment
could end up in different lock files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
import warnings

import shm_core

LOCK_SUFFIX = ".lock"
SOCK_SUFFIX = ".sock"
LOG_NAME = "manager.log"
LOG_CAP = 256 << 10  # the log is in tmpfs (RAM): it is cut back to empty before it grows past this
GROUP_ENV = "ARRAYMP_GROUP"
RUNTIME_ENV = "ARRAYMP_RUNTIME_DIR"
LINGER_ENV = "ARRAYMP_MANAGER_LINGER"
GROUP_RE = re.compile(r"[0-9a-z]{1,32}")
# <prefix><uid>_<group>_<pid>_<16 hex>; a prefix is empty or ends in a non-digit; never a '/' or NUL
_PREFIX = r"(?:[^/\0]*[^/\0-9])?"
NAME_RE = re.compile(rf"(?P<prefix>{_PREFIX})(?P<uid>[0-9]+)_(?P<group>[0-9a-z]+)_(?P<pid>[0-9]+)_[0-9a-f]{{16}}",
                     re.DOTALL)
_warned: set = set()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (field 22 of /proc/<pid>/stat, clock ticks since boot): with its pid, a name for a
    process that no later process can have. None when it is gone."""
    got = parent_and_start(pid)
    return None if got is None else got[1]


def now_ticks() -> int:
    """Now, in the clock of :func:`start_time` (clock ticks since boot)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK") // 1_000_000_000


def parent_and_start(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of ``pid`` (fields 4 and 22 of /proc/<pid>/stat; a zombie has both), or None
    when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def ticks_now() -> int:
    """Now, in the clock ticks since boot of ``start_time``."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")) + 1


def parse(name: str) -> tuple[str, int, str, int] | None:
    """``(prefix, uid, group, pid)`` of a segment name made by ``segment_name``, else None."""
    m = NAME_RE.fullmatch(name)
    if m is None:
        return None
    return m["prefix"], int(m["uid"]), m["group"], int(m["pid"])


def group_pattern(uid: int, group: str) -> re.Pattern:
    """Names of one group's segments, whatever their prefix: plain names, never a path."""
    return re.compile(rf"{_PREFIX}{uid}_{re.escape(group)}_[0-9]+_[0-9a-f]{{16}}", re.DOTALL)


def _ours(path: str) -> bool:
    """``path`` is a real directory owned by us (made owner-only if it was not)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return True


def runtime_dirs(dir: str | os.PathLike | None = None) -> list[str]:
    """Every runtime directory of ours for segments in ``dir``: fallbacks by name, then the default (Note [Runtime
    directory])."""
    override = os.environ.get(RUNTIME_ENV)
    if override:
        return [override] if os.path.isdir(override) else []
    shm = shm_core.shm_dir(dir)
    base = f".arraymp-{os.getuid()}"
    with os.scandir(shm) as it:
        found = sorted(de.name for de in it if de.name.startswith(base + "-") and _ours(de.path))
    default = os.path.join(shm, base)
    return [os.path.join(shm, n) for n in found] + ([default] if _ours(default) else [])


def runtime_dir(dir: str | os.PathLike | None = None, *, create: bool = True, group: str | None = None) -> str:
    """The owner-only directory of group locks, daemon sockets and the daemons' log for segments in ``dir``.

    Another user's file or directory at the default path is never used (Note
    [Runtime directory]); among fallbacks, the one holding ``group``'s lock
    file. Without ``create``, the path that would be used.
    """
    override = os.environ.get(RUNTIME_ENV)
    if override:
        if create:
            try:
                os.mkdir(override, 0o700)
            except FileExistsError:
                pass
        if (create or os.path.lexists(override)) and not _ours(override):
            raise PermissionError(errno.EPERM, f"{override} is not a directory owned by uid {os.getuid()}: set "
                                  f"{RUNTIME_ENV} to an owner-only directory of yours", override)
        return override
    shm = shm_core.shm_dir(dir)
    default = os.path.join(shm, f".arraymp-{os.getuid()}")
    if not os.path.lexists(default) or not _ours(default):
        found = runtime_dirs(shm)
        if found:
            return next((r for r in found if group and os.path.exists(lock_path(r, group))), found[0])
        if not create:
            return default
        try:
            os.mkdir(default, 0o700)
        except FileExistsError:
            pass
        if not _ours(default):
            import tempfile  # here only: importing it costs every program ~7 ms (shutil, random)

            fallback = tempfile.mkdtemp(prefix=os.path.basename(default) + "-", dir=shm)
            _warn_once(f"{default} is not a directory of uid {os.getuid()} (another user may have made it): "
                       f"arraymp uses {fallback} instead; to go back, have root remove {default}")
            return fallback
    return default


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def lock_path(rdir: str, group: str) -> str:
    return os.path.join(rdir, group + LOCK_SUFFIX)


def socket_path(rdir: str, group: str) -> str:
    return os.path.join(rdir, group + SOCK_SUFFIX)


def socket_address(dfd: int, group: str) -> str:
    """The daemon's AF_UNIX address, through ``dfd``, a descriptor of the runtime directory (no length limit)."""
    return f"/proc/self/fd/{dfd}/{group}{SOCK_SUFFIX}"


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def open_lock(path: str) -> int:
    """Open (or create) ``path`` and hold LOCK_SH on it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while someone cleans a dead group
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed by whoever proved the group dead: take the new file


def take_if_dead(rdir: str, group: str) -> int | None:
    """An fd holding LOCK_EX on the group's lock when the group is dead, None when it lives.

    Raises FileNotFoundError when the group has no lock file.
    """
    path = lock_path(rdir, group)
    for _ in range(8):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)  # FileNotFoundError: no lock file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)
    raise FileNotFoundError(errno.ENOENT, "group lock file keeps changing", path)


def take_if_dead_anywhere(rdirs, group: str) -> tuple[str | None, int | None]:
    """``(rdir, take_if_dead(rdir, group))`` for the runtime dir holding the group's lock; ``(None, None)``
    when none does ('unknown')."""
    for rdir in rdirs:
        try:
            return rdir, take_if_dead(rdir, group)
        except FileNotFoundError:
            continue
    return None, None


def release_dead(fd: int, rdir: str, group: str, *, remove: bool = True) -> None:
    """Unlink a dead group's socket and lock file (while still holding the lock), then close it."""
    try:
        if remove:
            for path in (socket_path(rdir, group), lock_path(rdir, group)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    finally:
        os.close(fd)


def group_state(rdirs, group: str) -> str:
    """'alive', 'dead' (lock free) or 'unknown' (no lock file); takes nothing for good."""
    try:
        rdir, fd = take_if_dead_anywhere(rdirs, group)
    except OSError:
        return "unknown"
    if rdir is None:
        return "unknown"
    if fd is None:
        return "alive"
    os.close(fd)
    return "dead"


def log(rdir: str, group: str, msg: str) -> None:
    """Append a warning to ``<rdir>/manager.log``, emptying the file first when it would pass LOG_CAP."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    line = f"{stamp} shm-manager[{os.getpid()}] WARNING group {group}: {msg}".encode(errors="replace")
    line = line[:LOG_CAP // 4] + b"\n"
    try:
        fd = os.open(os.path.join(rdir, LOG_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC |
                     os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_size + len(line) > LOG_CAP:
                os.ftruncate(fd, 0)
                line = f"{stamp} (the log reached {LOG_CAP:,} bytes and was emptied)\n".encode() + line
            os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def linger_default() -> float:
    try:
        return max(0.0, float(os.environ.get(LINGER_ENV, "0.5")))
    except ValueError:
        return 0.5
