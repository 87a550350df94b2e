"""Finding and removing segments of dead groups: ``gc``, ``list_segments``, ``stats``.

Only files that are (a) named ``<prefix><our uid>_<group>_<pid>_<random>``,
(b) regular files owned by the caller and (c) of a group proved dead (see
Note [Proof of death] in _paths.py) are ever removed. A group without a lock
file is 'unknown': plain ``gc`` leaves its segments alone; ``orphans=True``
removes those whose creating pid no longer exists in this pid namespace, which
is a guess and therefore opt-in.
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


def _entries(d: str) -> list[dict]:
    """Our uid's segment-named regular files in ``d`` (owned by us)."""
    uid = os.getuid()
    out = []
    with os.scandir(d) as it:
        for de in it:
            parsed = _paths.parse(de.name)
            if parsed is None or parsed[1] != uid:
                continue
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue  # named like ours but not ours: never touched
            prefix, _uid, group, pid = parsed
            out.append({"name": de.name, "path": de.path, "prefix": prefix, "group": group, "pid": pid,
                        "bytes": st.st_size, "ctime": st.st_ctime})
    return out


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def remove_group(group: str, dirs, names=()) -> list[tuple[str, int]]:
    """Unlink a dead group's segments: the given ``(dir, name)`` pairs and every file of the
    group in ``dirs``. The caller must hold the proof (LOCK_EX on the group's lock)."""
    uid = os.getuid()
    pat = _paths.group_pattern(uid, group)
    removed = []
    seen = set()
    for d, name in names:
        if not pat.fullmatch(name) or "/" in name:
            continue
        path = os.path.join(d, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid and _unlink(path):
            removed.append((path, st.st_size))
            seen.add(path)
    for d in dirs:
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for de in it:
                if de.path in seen or not pat.fullmatch(de.name):
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == uid and _unlink(de.path):
                    removed.append((de.path, st.st_size))
    return removed


def gc(dry_run: bool = False, dir: str | os.PathLike | None = None, *, prefixes=DEFAULT_PREFIXES,
       orphans: bool = False) -> list[tuple[str, int]]:
    """Remove our segments whose group is provably dead; ``[(name, bytes)]`` removed (or, dry, removable).

    Segments of any prefix count when their group has a lock file; without one
    (an 'unknown' group) only ``prefixes`` count, and only with ``orphans``.
    Lock files of dead groups are removed too.
    """
    d = shm_core.shm_dir(dir)
    rdir = _paths.runtime_dir(dir, create=False)
    groups: dict[str, list[dict]] = {}
    for e in _entries(d):
        groups.setdefault(e["group"], []).append(e)
    removed: list[tuple[str, int]] = []
    for group, entries in groups.items():
        try:
            fd = _paths.take_if_dead(rdir, group)
        except FileNotFoundError:
            fd = -1
        except OSError:
            continue
        if fd is None:
            continue  # alive: never touched
        try:
            if fd == -1:  # no lock file: 'unknown'
                entries = [e for e in entries if e["prefix"] in prefixes]
                if not orphans or not entries or not all(_pid_gone(e["pid"]) for e in entries):
                    continue
            for e in entries:
                if dry_run or _unlink(e["path"]):
                    removed.append((e["name"], e["bytes"]))
        finally:
            if fd >= 0:
                _paths.release_dead(fd, rdir, group, remove=not dry_run)
    if not dry_run:
        _remove_stale_locks(rdir, set(groups))
    return removed


def _remove_stale_locks(rdir: str, skip: set) -> None:
    try:
        names = os.listdir(rdir)
    except OSError:
        return
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


def _header(path: str) -> tuple[int | None, int | None]:
    """(creator pid, refcount) from the segment header, or Nones."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
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
    rdir = _paths.runtime_dir(dir, create=False)
    states: dict[str, str] = {}
    now = time.time()
    out = []
    for e in _entries(d):
        group = e["group"]
        if group not in states:
            states[group] = _paths.group_state(rdir, group)
        creator, refcount = _header(e["path"])
        out.append({"name": e["name"], "path": e["path"], "bytes": e["bytes"],
                    "size": max(0, e["bytes"] - shm_core.HEADER_SIZE), "group": group, "state": states[group],
                    "pid": e["pid"], "creator_pid": creator, "refcount": refcount,
                    "age": round(max(0.0, now - e["ctime"]), 3)})
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
