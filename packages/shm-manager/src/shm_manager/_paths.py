"""Group locks, the runtime directory and segment names.

Note [Proof of death]
~~~~~~~~~~~~~~~~~~~~~
Every process of a group holds ``flock(LOCK_SH)`` on ``<runtime dir>/<group>.lock``
for as long as it lives; the kernel drops the lock when the process dies,
whatever killed it. So a group is dead exactly when ``flock(LOCK_EX | LOCK_NB)``
on its lock file succeeds: that is proof, not a guess from pids (pids are
reused and are not visible across pid namespaces).

Whoever proves a group dead keeps the exclusive lock while it removes the
group's segments, then unlinks the lock file and closes it. A process joining
the group meanwhile blocks in ``LOCK_SH``; once it has the lock it checks that
the path still names the inode it locked, and starts over when it does not. So
nobody ever holds a lock on a file that is no longer the group's lock file.

The runtime directory is, by default, ``<shm dir>/.arraymp-<uid>`` (0700, owned
by the user): the liveness locks live on the same filesystem, and are seen by
the same processes, as the segments they vouch for, whatever $XDG_RUNTIME_DIR
or private /tmp each process has. ``ARRAYMP_RUNTIME_DIR`` overrides it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat

import shm_core

LOCK_SUFFIX = ".lock"
LOG_NAME = "manager.log"
GROUP_ENV = "ARRAYMP_GROUP"
RUNTIME_ENV = "ARRAYMP_RUNTIME_DIR"
LINGER_ENV = "ARRAYMP_MANAGER_LINGER"
GROUP_RE = re.compile(r"[0-9a-z]{1,32}")
# <prefix><uid>_<group>_<pid>_<16 hex>; a prefix is empty or ends in a non-digit
NAME_RE = re.compile(r"(?P<prefix>(?:.*[^0-9])?)(?P<uid>[0-9]+)_(?P<group>[0-9a-z]+)_(?P<pid>[0-9]+)_[0-9a-f]{16}",
                     re.DOTALL)


def parse(name: str) -> tuple[str, int, str, int] | None:
    """``(prefix, uid, group, pid)`` of a segment name made by ``segment_name``, else None."""
    m = NAME_RE.fullmatch(name)
    if m is None:
        return None
    return m["prefix"], int(m["uid"]), m["group"], int(m["pid"])


def group_pattern(uid: int, group: str) -> re.Pattern:
    """Names of one group's segments, whatever their prefix."""
    return re.compile(rf"(?:.*[^0-9])?{uid}_{re.escape(group)}_[0-9]+_[0-9a-f]{{16}}", re.DOTALL)


def runtime_dir(dir: str | os.PathLike | None = None, *, create: bool = True) -> str:
    """The owner-only directory of group locks (and the daemons' log) for segments in ``dir``.

    Raises PermissionError when the path exists but is not a directory owned by
    this user (another user may have planted it).
    """
    path = os.environ.get(RUNTIME_ENV) or os.path.join(shm_core.shm_dir(dir), f".arraymp-{os.getuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise
        return path
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(errno.EPERM, f"{path} is not a directory owned by uid {os.getuid()}; it may have been "
                              f"planted by another user: remove it, or set {RUNTIME_ENV} to an owner-only directory",
                              path)
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def lock_path(rdir: str, group: str) -> str:
    return os.path.join(rdir, group + LOCK_SUFFIX)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def open_lock(path: str, *, exclusive_create: bool = False) -> int:
    """Open ``path`` and hold LOCK_SH on it; -1 when ``exclusive_create`` and it exists."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    if exclusive_create:
        flags |= os.O_EXCL
    while True:
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            return -1
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while someone cleans a dead group
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed by whoever proved the group dead: take the new file
        if exclusive_create:
            return -1


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


def release_dead(fd: int, rdir: str, group: str, *, remove: bool = True) -> None:
    """Unlink a dead group's lock file (while still holding it), then close it."""
    try:
        if remove:
            try:
                os.unlink(lock_path(rdir, group))
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def group_state(rdir: str, group: str) -> str:
    """'alive', 'dead' (lock free) or 'unknown' (no lock file); takes nothing for good."""
    try:
        fd = take_if_dead(rdir, group)
    except FileNotFoundError:
        return "unknown"
    except OSError:
        return "unknown"
    if fd is None:
        return "alive"
    os.close(fd)
    return "dead"


def socket_address(uid: int, group: str) -> bytes:
    """The daemon's abstract AF_UNIX address (no file; access checked with SO_PEERCRED)."""
    return f"\0arraymp-manager.{uid}.{group}".encode()


def linger_default() -> float:
    try:
        return max(0.0, float(os.environ.get(LINGER_ENV, "0.5")))
    except ValueError:
        return 0.5
