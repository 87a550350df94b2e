"""Attaching the segments a message names: each mapped once per process (_shared's table), a named one's
in-flight count taken over, a memfd's descriptor kept in the LRU (_shared Note [descriptors]), and re-opened from
/proc/self/map_files when the LRU closed it and the segment is sent again."""

from __future__ import annotations

import mmap
import os

import shm_core
import shm_manager

from ._shared import adopt_named, fd_budget, fd_key, table


def attach_fd(fd: int, size: int | None, *, owned: bool) -> shm_core.Segment:
    """The segment behind a received ``fd``, mapped once per process.

    ``owned``: the caller hands ``fd`` over (it is kept or closed here).
    """
    key = fd_key(fd)
    with table.lock:
        seg = table.segments.get(key)
        if seg is None:
            try:
                seg = shm_core.attach_fd(fd, expected_size=size)
            except BaseException:
                if owned:
                    os.close(fd)
                raise
            table.add(key, seg)
        elif size is not None and seg.size != size:
            if owned:
                os.close(fd)
            raise shm_core.SegmentError(f"handle says {size} bytes but the segment holds {seg.size}")
        if not owned:
            return seg
        if seg.fd < 0:
            seg.fd = fd
            table.keep_fd(seg)
        else:
            os.close(fd)
        if seg.key in table.fd_lru:
            table.fd_lru.move_to_end(seg.key)
        return seg


def attach_named(name: str, dir: str, size: int | None, counted: bool = True,
                 sender: int | None = None, borrowed: bool = False) -> shm_core.Segment:
    """The named segment ``name``, mapped once per process; takes over one in-flight count (``counted``: from the
    daemon when ``sender`` told it, _message Note [results told]), or takes a count of its own (the sender
    keeps its count until then: _message Note [kept counts]), or (``borrowed``) none: its sender keeps one for
    this process's whole life (_pool.core Note [launch counts])."""
    with table.lock:
        seg = table.segments.get(("n", name))
        if seg is not None and borrowed:
            return seg
        if seg is not None:
            if counted:  # this process already holds a count: the in-flight one goes back
                if sender is not None:  # (the daemon was told of it: it forgets it, or would give it back again)
                    shm_manager.drop_from(sender, name, dir)
                seg.decref()
            return seg
        try:
            seg = shm_core.attach(name, dir, expected_size=size)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {os.path.join(dir, name)} no longer exists: every count of it was given "
                "back before this message was received. Either its holders let go of it (keep the sender's array "
                "alive until received), or a message naming it was received twice (the same pickled bytes "
                "delivered again, or a forged handle: each takes a count it never owned), or it was removed by "
                "hand (shm-manager gc)"
            ) from None
        if borrowed:
            table.add(("n", name), seg)
            return seg
        if not counted:  # a count of our own, added as the daemon is told (shm_manager.hold): a count added
            return adopt_named(seg, count=seg.incref)  # with its frame not sent goes with a process killed then
        return adopt_named(seg, sender)


def fd_for_sending(seg: shm_core.Segment, *, dup: bool = False) -> int:
    """This process's descriptor of the memfd segment ``seg``, re-opened if the LRU closed it (Note
    [descriptors]): valid until the next segment is made or received here, or (``dup``) a new one that the
    caller closes. Raises OSError when it cannot be re-opened."""
    with table.lock:
        if seg.fd >= 0:
            if seg.key in table.fd_lru:
                table.fd_lru.move_to_end(seg.key)
            return os.dup(seg.fd) if dup else seg.fd
    fd = _reopen(seg)
    with table.lock:
        if seg.fd >= 0:  # another thread re-opened it meanwhile
            os.close(fd)
        else:
            seg.fd = fd
        table.keep_fd(seg)
        return os.dup(seg.fd) if dup else seg.fd


def _reopen(seg: shm_core.Segment) -> int:
    """A new descriptor of the file ``seg`` maps, through /proc/self/map_files (the kernel names a mapping
    by its page-rounded range)."""
    start = seg.address
    end = start + -(-seg.length // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot send this shared array: this process keeps {fd_budget()} shared-memory "
                      "descriptors open (its share of the open-files limit, RLIMIT_NOFILE) and this segment's was "
                      f"closed; re-opening it from /proc/self/map_files failed ({exc.strerror}; it needs "
                      "CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN). Raise the limit (ulimit -n), keep fewer "
                      "large shared arrays alive (small ones share arenas; arraymp.share_memory packs many into "
                      "one segment), or use the 'file_system' sharing strategy, whose segments re-open by name") \
            from None
    if fd_key(fd) != seg.key:
        os.close(fd)
        raise shm_core.SegmentError("/proc/self/map_files named another file than the segment's; not sending it")
    return fd
