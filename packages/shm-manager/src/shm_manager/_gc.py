"""Finding and removing segments of dead groups: ``gc``, ``list_segments``, ``stats``.

Only files that are (a) named ``<prefix><our uid>_<group>_<pid>_<random>``,
(b) regular files owned by the caller and (c) of a group proved dead (see
Note [Proof of death] in _paths.py) are ever removed. A group without a lock
file is 'unknown': plain ``gc`` leaves its segments alone; ``orphans=True``
removes those whose creating pid no longer exists in this pid namespace, which
is a guess and therefore opt-in. Files are found, checked and unlinked by name
inside the directory, through a descriptor of it (``unlinkat``), never
following a link: a path from anywhere else is never touched.
"""

from __future__ import annotations

import os
import resource
import stat
import struct
import time

import shm_core

from . import _paths

DEFAULT_PREFIXES = (shm_core.DEFAULT_PREFIX,)
_HEAD = struct.Struct("<8sIIQqQq")  # magic, version, flags, size, pid, id, refcount


def open_dir(d: str) -> int:
    """A descriptor of the segment directory ``d``: everything below works by name inside it."""
    return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _ours(dfd: int, name: str) -> os.stat_result | None:
    """The stat of ``name`` in ``dfd`` when it is a regular file owned by us (never following a link), else None."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else None


def _unlink(dfd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False


def _entries(dfd: int) -> list[dict]:
    """Our uid's segment-named regular files in the directory ``dfd`` (owned by us)."""
    uid = os.getuid()
    out = []
    for name in os.listdir(dfd):
        parsed = _paths.parse(name)
        if parsed is None or parsed[1] != uid:
            continue
        st = _ours(dfd, name)
        if st is None:
            continue  # named like ours but not ours: never touched
        prefix, _uid, group, pid = parsed
        out.append({"name": name, "prefix": prefix, "group": group, "pid": pid, "bytes": st.st_size,
                    "ctime": st.st_ctime})
    return out


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False


def remove_group(group: str, dfd: int, names=()) -> list[tuple[str, int]]:
    """Unlink a dead group's segments in the directory ``dfd``: the given names and every file of the group.
    The caller must hold the proof (LOCK_EX on the group's lock)."""
    pat = _paths.group_pattern(os.getuid(), group)
    removed = []
    for name in dict.fromkeys([*names, *os.listdir(dfd)]):
        if not pat.fullmatch(name):
            continue
        st = _ours(dfd, name)
        if st is not None and _unlink(dfd, name):
            removed.append((name, st.st_size))
    return removed


def end_group(group: str, rdir: str, dfd: int, names=(), held=frozenset()) -> list[tuple[str, int]] | None:
    """When the group's lock proves it dead, remove what is left of it in ``dfd`` (segments, then its socket and
    lock in ``rdir``) and log what leaked, all but the ``held`` names (the exiting caller still held them); None
    while it lives. Note [Proof of death] in _paths.py."""
    try:
        fd = _paths.take_if_dead(rdir, group)
    except FileNotFoundError:
        return []  # whoever proved it dead cleaned up already
    if fd is None:
        return None
    try:
        removed = remove_group(group, dfd, names)
    finally:
        _paths.release_dead(fd, rdir, group)
    leaked = [(n, size) for n, size in removed if n not in held]
    if leaked:
        _paths.log(rdir, group, f"all processes of the group ended; removed {len(leaked)} leaked segment(s), "
                                f"{sum(size for _, size in leaked):,} bytes: {', '.join(n for n, _ in leaked)}")
    return removed


def gc(dry_run: bool = False, dir: str | os.PathLike | None = None, *, prefixes=DEFAULT_PREFIXES,
       orphans: bool = False) -> list[tuple[str, int]]:
    """Remove our segments whose group is provably dead; ``[(name, bytes)]`` removed (or, dry, removable).

    Segments of any prefix count when their group has a lock file; without one
    (an 'unknown' group) only ``prefixes`` count, and only with ``orphans``.
    Lock files of dead groups are removed too.
    """
    dfd = open_dir(shm_core.shm_dir(dir))
    try:
        return _gc(dfd, _paths.runtime_dirs(dir), dry_run, prefixes, orphans)
    finally:
        os.close(dfd)


def _gc(dfd: int, rdirs: list[str], dry_run: bool, prefixes, orphans: bool) -> list[tuple[str, int]]:
    groups: dict[str, list[dict]] = {}
    for e in _entries(dfd):
        groups.setdefault(e["group"], []).append(e)
    removed: list[tuple[str, int]] = []
    for group, entries in groups.items():
        try:
            rdir, fd = _paths.take_if_dead_anywhere(rdirs, group)
        except OSError:
            continue
        if rdir is not None and fd is None:
            continue  # alive: never touched
        try:
            if rdir is None:  # no lock file: 'unknown'
                entries = [e for e in entries if e["prefix"] in prefixes]
                if not orphans or not entries or not all(_pid_gone(e["pid"]) for e in entries):
                    continue
            for e in entries:
                if dry_run or _unlink(dfd, e["name"]):
                    removed.append((e["name"], e["bytes"]))
        finally:
            if fd is not None:
                _paths.release_dead(fd, rdir, group, remove=not dry_run)
    if not dry_run:
        _remove_stale_locks(rdirs, set(groups))
    return removed


def _remove_stale_locks(rdirs: list[str], skip: set) -> None:
    for rdir in rdirs:
        try:
            names = os.listdir(rdir)
        except OSError:
            continue
        for fname in names:
            group = fname[: -len(_paths.LOCK_SUFFIX)]
            if not fname.endswith(_paths.LOCK_SUFFIX) or group in skip or not _paths.GROUP_RE.fullmatch(group):
                continue
            try:
                fd = _paths.take_if_dead(rdir, group)
            except OSError:
                continue
            if fd is not None:
                _paths.release_dead(fd, rdir, group)


def _header(dfd: int, name: str) -> tuple[int | None, int | None]:
    """(creator pid, refcount) from the segment header, or Nones."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None, None
    try:
        raw = os.pread(fd, _HEAD.size, 0)
    except OSError:
        return None, None
    finally:
        os.close(fd)
    if len(raw) < _HEAD.size:
        return None, None
    magic, _v, _f, _size, pid, _id, refcount = _HEAD.unpack(raw)
    if magic != b"ARRAYMP\0":
        return None, None
    return pid, refcount


def list_segments(dir: str | os.PathLike | None = None) -> list[dict]:
    """Our segments in the shm dir, oldest first.

    Each dict: name, path, bytes (file size), size (data bytes), group, state
    ('alive' / 'dead' / 'unknown'), pid (from the name), creator_pid and
    refcount (from the header, None when unreadable), age (seconds).
    """
    d = shm_core.shm_dir(dir)
    rdirs = _paths.runtime_dirs(dir)
    states: dict[str, str] = {}
    now = time.time()
    out = []
    dfd = open_dir(d)
    try:
        for e in _entries(dfd):
            group = e["group"]
            if group not in states:
                states[group] = _paths.group_state(rdirs, group)
            creator, refcount = _header(dfd, e["name"])
            out.append({"name": e["name"], "path": os.path.join(d, e["name"]), "bytes": e["bytes"],
                        "size": max(0, e["bytes"] - shm_core.HEADER_SIZE), "group": group, "state": states[group],
                        "pid": e["pid"], "creator_pid": creator, "refcount": refcount,
                        "age": round(max(0.0, now - e["ctime"]), 3)})
    finally:
        os.close(dfd)
    out.sort(key=lambda s: -s["age"])
    return out


def stats(dir: str | os.PathLike | None = None) -> dict:
    """The shm filesystem's size/used/free, our share of it, and the descriptor limit."""
    d = shm_core.shm_dir(dir)
    st = os.statvfs(d)
    segs = list_segments(dir)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    groups = {s["group"]: s["state"] for s in segs}

    def _lim(v):
        return None if v == resource.RLIM_INFINITY else v

    return {
        "dir": d,
        "runtime_dir": _paths.runtime_dir(dir, create=False),
        "size": st.f_blocks * st.f_frsize,
        "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
        "our_segments": len(segs),
        "our_bytes": sum(s["bytes"] for s in segs),
        "reclaimable_bytes": sum(s["bytes"] for s in segs if s["state"] == "dead"),
        "groups_alive": sum(v == "alive" for v in groups.values()),
        "groups_dead": sum(v == "dead" for v in groups.values()),
        "groups_unknown": sum(v == "unknown" for v in groups.values()),
        "ulimit_nofile_soft": _lim(soft),
        "ulimit_nofile_hard": _lim(hard),
    }
