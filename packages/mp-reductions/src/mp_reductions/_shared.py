"""Arrays in shared memory: making segments, finding them, attaching them.

Every process keeps one table of the segments it has mapped, keyed by what
identifies the memory (the inode of a memfd, the name of a named segment), so a
segment that arrives a hundred times is mapped once, and a same-process round
trip gives back views of the very memory that was sent. The table holds weak
references: a segment goes when its last array goes.

Note [descriptors]: a mapping needs no descriptor, but re-sending a received
memfd segment does. Received segments keep their descriptor in a small LRU
(``KEPT_FDS``); older ones close theirs, so a process holding 20,000 received
arrays does not run out of descriptors. Re-sending one whose descriptor was
closed re-opens it from /proc/self/map_files where the kernel allows, else
sends a copy (with a warning).

Note [named segments]: the header refcount counts holders: every process that
maps the segment, plus one per message in flight. The sender adds the
in-flight count before sending; a receiver that already maps the segment gives
it back, one that does not keeps it as its own. The holder that takes the count
to zero unlinks the name and tells shm_manager. Holders tell shm_manager's
daemon (hold), and give their count back through it (release): so the count of
a holder that dies, even by SIGKILL, is given back exactly once; that includes
a fork child, which holds (and tells the daemon it holds) every named segment
it inherits. What a crash can still leak (a message lost in flight) is removed
when the group ends.

Small ``empty_shared`` arrays are carved out of per-process arenas (one segment
holds many arrays), which keeps mappings, descriptors and messages' descriptor
counts low; an arena is freed when its last array is gone in every process.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
import weakref
from multiprocessing import util

import numpy as np
import shm_core
import shm_manager  # before our at-fork hook: a fork child gets its own daemon connection first

from ._strategy import get_sharing_strategy

ALIGN = 64
KEPT_FDS = 16
ARENA_SIZE = 4 << 20
ARENA_ITEM_MAX = 64 << 10


class _Table:
    """This process's mapped segments, and the LRU of received ones' descriptors."""

    def __init__(self):
        self.lock = threading.Lock()
        self.segments: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.fd_lru: collections.OrderedDict = collections.OrderedDict()  # key -> weakref(Segment)

    def add(self, key, seg: shm_core.Segment) -> None:
        seg.key = key
        self.segments[key] = seg

    def keep_fd(self, seg: shm_core.Segment) -> None:
        """Remember that ``seg`` holds a received descriptor; close the oldest beyond KEPT_FDS."""
        lru = self.fd_lru
        lru[seg.key] = weakref.ref(seg)
        lru.move_to_end(seg.key)
        while len(lru) > KEPT_FDS:
            _, ref = lru.popitem(last=False)
            old = ref()
            if old is not None:
                old.close_fd()


_table = _Table()


def _after_fork_in_child():
    global _arena
    # Same segments, fresh lock; the parent's arena must not be carved twice;
    # the child now holds the named segments it inherited, so it counts them,
    # through its own daemon connection (given back if it is killed).
    _table.lock = threading.Lock()
    _arena = _Arena()
    for key, seg in list(_table.segments.items()):
        if key[0] == "n" and seg.release_hook is not None:
            seg.incref()
            shm_manager.hold(seg.name, seg.dir)


def _release_all_named() -> None:
    """At process exit: give back this process's counts (a child exits without running __del__)."""
    for key, seg in list(_table.segments.items()):
        if key[0] == "n":
            hook, seg.release_hook = seg.release_hook, None
            if hook is not None:
                hook(seg)


_exit_hook_pid = None


def _ensure_exit_hook(again: bool = False) -> None:
    global _exit_hook_pid
    # again: multiprocessing clears the finalizers of a new child before running it
    if again or _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        util.Finalize(None, _release_all_named, exitpriority=0)


# ---------------------------------------------------------------- named segments
def _release_named(seg: shm_core.Segment) -> None:
    if shm_manager.release(seg.name, seg.dir):
        return  # the daemon takes the count back, and unlinks at zero
    try:
        if seg.decref() == 0:
            seg.unlink()
            shm_manager.unregister(seg.name)
    except FileNotFoundError:
        pass


def _adopt_named(seg: shm_core.Segment) -> shm_core.Segment:
    """This process holds one count of ``seg``; the daemon gives it back if we die."""
    _ensure_exit_hook()
    shm_manager.hold(seg.name, seg.dir)
    seg.release_hook = _release_named
    _table.add(("n", seg.name), seg)
    return seg


# ---------------------------------------------------------------------- creating
def fd_key(fd: int) -> tuple:
    st = os.fstat(fd)
    return "f", st.st_dev, st.st_ino


def new_segment(size: int, strategy: str | None = None, name: str | None = None) -> shm_core.Segment:
    """A fresh segment of ``size`` data bytes under the current (or given) strategy (file_system: ``name``,
    from shm_manager.new_name(), or a new one)."""
    if (strategy or get_sharing_strategy()) == "file_system":
        seg = shm_core.create(size, name=name or shm_manager.new_name())
        seg.incref()
        shm_manager.register(seg.name)
        with _table.lock:
            return _adopt_named(seg)
    seg = shm_core.create_anonymous(size)
    with _table.lock:
        _table.add(fd_key(seg.fd), seg)
    return seg


class _Arena:
    """Bump allocation of small shared arrays out of a few large segments."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seg = None
        self.used = 0
        self.strategy = None

    def alloc(self, nbytes: int) -> tuple[shm_core.Segment, int]:
        strategy = get_sharing_strategy()
        with self.lock:
            seg = self.seg() if self.seg is not None else None
            if seg is None or self.strategy != strategy or self.used + nbytes > seg.size:
                seg = new_segment(ARENA_SIZE)
                self.seg, self.used, self.strategy = weakref.ref(seg), 0, strategy
            offset = self.used
            self.used = _aligned(offset + nbytes)
            return seg, offset


_arena = _Arena()
os.register_at_fork(after_in_child=_after_fork_in_child)
util.register_after_fork(_table, lambda table: _ensure_exit_hook(again=True))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _nbytes(shape, dtype) -> tuple[tuple, np.dtype, int]:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"arrays of dtype {dtype} hold Python objects and cannot live in shared memory")
    shape = (shape,) if np.isscalar(shape) else tuple(int(n) for n in shape)
    return shape, dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def empty_shared(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new uninitialised array in shared memory (like ``numpy.empty``)."""
    shape, dtype, nbytes = _nbytes(shape, dtype)
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    if nbytes <= ARENA_ITEM_MAX:
        seg, offset = _arena.alloc(nbytes)
    else:
        seg, offset = new_segment(nbytes), 0
    strides = None if order == "C" else _f_strides(shape, dtype.itemsize)
    return seg.ndarray(shape, dtype, offset, strides)


def zeros_shared(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new zero-filled array in shared memory (like ``numpy.zeros``)."""
    arr = empty_shared(shape, dtype, order)
    arr.fill(0)
    return arr


def _f_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in shape:
        strides.append(step)
        step *= max(n, 1)
    return tuple(strides)


# ------------------------------------------------------------------------ finding
def segment_of(arr: np.ndarray) -> tuple[shm_core.Segment, int] | None:
    """The segment ``arr`` views and the byte offset of its first element, or None."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, shm_core.Segment):
        return None
    return base, shm_core.address(arr) - base.address - shm_core.HEADER_SIZE


def is_shared(arr) -> bool:
    """True when ``arr`` is a view of shared memory (sending it sends no copy)."""
    return isinstance(arr, np.ndarray) and segment_of(arr) is not None


def share_memory(obj):
    """A shared copy of ``obj``: an array, or a dict / list / tuple of them (nested).

    Arrays already shared are kept as they are; all the others are packed into
    one segment (one mapping, one descriptor however many arrays), which is how
    a model's parameters should be shared before starting workers.
    """
    todo = []

    def collect(o):
        if type(o) is np.ndarray and not o.dtype.hasobject and segment_of(o) is None:
            todo.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(obj)
    if not todo:
        return obj
    offsets, total = {}, 0
    for a in todo:
        if id(a) not in offsets:
            offsets[id(a)], total = total, _aligned(total + a.nbytes)
    seg = new_segment(total)
    copies = {}
    for a in todo:
        if id(a) not in copies:
            order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
            dst = seg.ndarray(a.shape, a.dtype, offsets[id(a)], _f_strides(a.shape, a.itemsize)
                              if order == "F" else None)
            np.copyto(dst, a, casting="no")
            copies[id(a)] = dst

    def rebuild(o):
        if type(o) is np.ndarray:
            return copies.get(id(o), o)
        if isinstance(o, dict):
            return type(o)((k, rebuild(v)) for k, v in o.items())
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return type(o)(*(rebuild(v) for v in o))
        if isinstance(o, (list, tuple)):
            return type(o)(rebuild(v) for v in o)
        return o

    return rebuild(obj)


# ---------------------------------------------------------------------- attaching
def attach_fd(fd: int, size: int | None, *, owned: bool) -> shm_core.Segment:
    """The segment behind a received ``fd``, mapped once per process.

    ``owned``: the caller hands ``fd`` over (it is kept or closed here).
    """
    key = fd_key(fd)
    with _table.lock:
        seg = _table.segments.get(key)
        if seg is None:
            try:
                seg = shm_core.attach_fd(fd, expected_size=size)
            except BaseException:
                if owned:
                    os.close(fd)
                raise
            _table.add(key, seg)
        elif size is not None and seg.size != size:
            if owned:
                os.close(fd)
            raise shm_core.SegmentError(f"handle says {size} bytes but the segment holds {seg.size}")
        if not owned:
            return seg
        if seg.fd < 0:
            seg.fd = fd
            _table.keep_fd(seg)
        else:
            os.close(fd)
        if seg.key in _table.fd_lru:
            _table.fd_lru.move_to_end(seg.key)
        return seg


def attach_named(name: str, dir: str, size: int | None) -> shm_core.Segment:
    """The named segment ``name``, mapped once per process; takes over one in-flight count."""
    with _table.lock:
        seg = _table.segments.get(("n", name))
        if seg is not None:
            seg.decref()  # this process already holds a count
            return seg
        try:
            seg = shm_core.attach(name, dir, expected_size=size)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {os.path.join(dir, name)} no longer exists: its holders are gone "
                f"or it was removed by hand (shm-manager gc); keep the sender's array alive until received"
            ) from None
        return _adopt_named(seg)


def fd_for_sending(seg: shm_core.Segment) -> int:
    """A descriptor of ``seg`` to send (see Note [descriptors])."""
    if seg.fd >= 0:
        if seg.key in _table.fd_lru:
            _table.fd_lru.move_to_end(seg.key)
        return seg.fd
    start = seg.address
    try:
        fd = os.open(f"/proc/self/map_files/{start:x}-{start + seg.length:x}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return -1
    seg.fd = fd
    with _table.lock:
        _table.keep_fd(seg)
    return fd


def warn_copy_resend() -> None:
    warnings.warn("re-sending a received array whose descriptor was closed (more than "
                  f"{KEPT_FDS} received segments are alive) sends a copy; the receiver will not "
                  "share memory with this process. Use the 'file_system' strategy to forward many arrays.",
                  ResourceWarning, stacklevel=4)
