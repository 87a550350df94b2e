"""Shared-memory segments: the policy above ``_native``.

A segment is a file in tmpfs (an anonymous memfd, or a named file in a
directory, ``/dev/shm`` by default) that starts with a 64-byte header::

    offset  field
    0       magic        b"ARRAYMP\\0"
    8       version u32, flags u32
    16      data size    (bytes after the header)
    24      creator pid
    32      random 64-bit id
    40      refcount     (atomic; holders of a named segment, see shm_manager)
    48      views        (atomic; processes with live buffer exports)
    56      user word    (atomic; free for the layer above)

Pages are reserved with posix_fallocate when the segment is created, so a full
tmpfs raises ``SharedMemoryFullError`` at creation instead of SIGBUS on first
touch. Attaching checks the header against the file before any byte is used.

Lifecycle (as ``multiprocessing.shared_memory``): ``close()`` per process,
``unlink()`` once; the mapping itself does not keep a file descriptor.
"""

from __future__ import annotations

import os
import secrets
import struct

from . import _native

HEADER_SIZE = 64
MAGIC = b"ARRAYMP\0"
VERSION = 1
REFCOUNT_OFFSET = 40
VIEWS_OFFSET = 48
USER_OFFSET = 56
DEFAULT_PREFIX = "arraymp_"
_HEAD = struct.Struct("<8sIIQqQ")  # magic, version, flags, size, pid, id


def shm_dir(dir: str | os.PathLike | None = None) -> str:
    """The directory for named segments: ``dir``, else $ARRAYMP_SHM_DIR, else /dev/shm."""
    return os.fspath(dir) if dir is not None else os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")


class SegmentError(ValueError):
    """Raised when a file is not a valid arraymp segment (foreign, corrupted or truncated)."""


class SharedMemoryFullError(OSError):
    """Raised when tmpfs has no room for a new segment's pages."""

    def __init__(self, where: str, asked: int, free: int | None):
        free_text = "unknown" if free is None else f"{free:,} bytes free"
        super().__init__(
            28,  # ENOSPC
            f"no space in {where} for a {asked:,}-byte shared-memory segment "
            f"({asked + HEADER_SIZE:,} with its header) "
            f"({free_text}). Give the container a larger /dev/shm (docker run "
            f"--shm-size=8g, or mount -o remount,size=8G /dev/shm), free memory, "
            f"or use the 'file_descriptor' sharing strategy",
            where,
        )
        self.asked = asked
        self.free = free


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, length: int, where: str, free_path: str) -> None:
    try:
        _native.fallocate(fd, length, where)
    except OSError as exc:
        if exc.errno in (28, 12):  # ENOSPC, ENOMEM
            raise SharedMemoryFullError(where, length - HEADER_SIZE, _free_bytes(free_path)) from None
        if exc.errno not in (95,):  # EOPNOTSUPP: a filesystem without fallocate
            raise
        os.ftruncate(fd, length)


def segment_name(prefix: str = DEFAULT_PREFIX, group: str | None = None) -> str:
    """An unguessable segment name ``<prefix><uid>_<group>_<pid>_<random>``.

    ``group`` identifies the process group that owns the segment (see
    shm_manager); it defaults to this process's pid.
    """
    pid = os.getpid()
    return f"{prefix}{os.getuid()}_{group or pid}_{pid}_{secrets.token_hex(8)}"


def parse_name(name: str, prefix: str = DEFAULT_PREFIX) -> tuple[int, str, int] | None:
    """``(uid, group, pid)`` of a name made by :func:`segment_name`, else None."""
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].split("_")
    if len(parts) != 4 or not (parts[0].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[0]), parts[1], int(parts[2])


class Segment(_native.Mapping):
    """A mapped segment; its buffer is the data after the header.

    ``numpy.ndarray(shape, dtype, buffer=seg, offset=k)`` views it without a
    copy and keeps the mapping alive; the mapping goes when the last view goes.
    ``close()`` while views exist raises ``BufferError``.
    """

    name: str | None = None
    dir: str | None = None
    fd: int = -1
    #: called with the segment just before it is unmapped for good (layers
    #: above use it to drop their count of a named segment)
    release_hook = None

    def __init__(self, fd: int, *, name: str | None = None, dir: str | None = None,
                 populate: bool = False, expected_size: int | None = None, fresh: bool = False):
        where = os.path.join(dir, name) if name else f"fd {fd}"
        length = os.fstat(fd).st_size
        if length < HEADER_SIZE:
            raise SegmentError(f"{where}: {length} bytes is too short for a segment header (truncated or foreign file)")
        # The mapping is writable for the atomics even when arrays over it are
        # read-only: that promise is kept by the arrays.
        super().__init__(fd, length, data_offset=HEADER_SIZE, populate=populate,
                         readonly=False, views_offset=VIEWS_OFFSET)
        self.name, self.dir = name, dir
        magic, version, _flags, size, pid, ident = _HEAD.unpack(self.read(0, _HEAD.size))
        if fresh:  # the creator writes the header next, see _new()
            pass
        elif magic != MAGIC:
            super().close()
            raise SegmentError(f"{where}: bad magic {magic!r}; not an arraymp segment")
        elif version != VERSION:
            super().close()
            raise SegmentError(f"{where}: segment format version {version}, this shm-core reads {VERSION}; "
                               "use the same arraymp version in every process")
        elif size != length - HEADER_SIZE or (expected_size is not None and size != expected_size):
            super().close()
            raise SegmentError(f"{where}: header says {size} data bytes but the file holds "
                               f"{length - HEADER_SIZE}" + ("" if expected_size is None else
                                                           f" and the handle says {expected_size}")
                               + " (truncated or corrupted)")
        self.size = length - HEADER_SIZE
        self.creator_pid = pid
        self.id = ident

    # -- header ------------------------------------------------------------
    @property
    def path(self) -> str | None:
        return os.path.join(self.dir, self.name) if self.name else None

    @property
    def refcount(self) -> int:
        return self.load(REFCOUNT_OFFSET)

    @property
    def views(self) -> int:
        """Processes that hold live views of this segment (all processes), plus what callers add to
        the same word (mp-reductions counts its messages in flight there: one word, read at once)."""
        return self.load(VIEWS_OFFSET)

    def incref(self, n: int = 1) -> int:
        return self.fetch_add(REFCOUNT_OFFSET, n) + n

    def decref(self, n: int = 1) -> int:
        return self.fetch_add(REFCOUNT_OFFSET, -n) - n

    def ndarray(self, shape, dtype, offset: int = 0, strides=None, *, readonly: bool = False):
        """A numpy array over the data, holding a buffer export of this segment.

        Arrays made here count as views: ``close()`` raises BufferError while
        they live, and ``views`` counts this process. (``numpy.ndarray(...,
        buffer=seg)`` also keeps the mapping alive, but numpy drops the export
        at once, so ``close()`` cannot see such an array, exactly as with mmap.)
        """
        import numpy

        # frombuffer keeps the memoryview (and so the export) as the base;
        # ndarray(buffer=memoryview) would unwrap it to the segment.
        buf = memoryview(self)
        raw = numpy.frombuffer(buf.toreadonly() if readonly else buf, numpy.uint8)
        return numpy.ndarray(shape, dtype, buffer=raw, offset=offset, strides=strides)

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Unmap (BufferError while views exist) and close a kept descriptor."""
        if self.exports:
            super().close()  # raises BufferError
        hook, self.release_hook = self.release_hook, None
        if hook is not None and not self.closed:
            hook(self)
        super().close()
        self.close_fd()

    def close_fd(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (named segments); the memory lives while mapped."""
        if self.name:
            unlink(self.name, self.dir)

    def __del__(self):
        hook, self.release_hook = self.release_hook, None
        if hook is not None and not self.closed:
            hook(self)
        if self.fd >= 0:
            os.close(self.fd)

    def __repr__(self) -> str:
        what = self.path or f"memfd fd={self.fd}"
        return f"<Segment {what} size={self.size} id={self.id:#x}{' closed' if self.closed else ''}>"

    def __reduce__(self):
        if not self.name:
            raise TypeError("an anonymous segment travels by its file descriptor, not by pickling; "
                            "use arraymp queues or send its fd with socket.send_fds")
        return attach, (self.name, self.dir)


def _write_header(seg: Segment, size: int) -> None:
    seg.write(0, _HEAD.pack(MAGIC, VERSION, 0, size, os.getpid(), secrets.randbits(64)))
    seg.size, seg.creator_pid = size, os.getpid()
    seg.id = int.from_bytes(seg.read(32, 8), "little")


def _new(fd: int, size: int, where: str, free_path: str, populate: bool, **names) -> Segment:
    if size < 0:
        raise ValueError(f"segment size must be >= 0, got {size}")
    _reserve(fd, HEADER_SIZE + size, where, free_path)
    seg = Segment(fd, populate=populate, fresh=True, **names)
    _write_header(seg, size)
    return seg


def create_anonymous(size: int, *, populate: bool = False) -> Segment:
    """A new anonymous segment of ``size`` data bytes; ``seg.fd`` stays open to send it.

    memfd_create where the kernel has it, else a file in /dev/shm unlinked at
    once: either way nothing has a name that could leak.
    """
    try:
        fd = _native.memfd_create("arraymp")
        where, free_path = "memfd (anonymous shared memory)", "/dev/shm"
    except OSError as exc:
        if exc.errno != 38:  # ENOSYS
            raise
        free_path = shm_dir()
        where = os.path.join(free_path, segment_name("arraymp_anon_"))
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(where)
    try:
        seg = _new(fd, size, where, free_path, populate)
    except BaseException:
        os.close(fd)
        raise
    seg.fd = fd
    return seg


def create(size: int, *, name: str | None = None, dir: str | os.PathLike | None = None,
           prefix: str = DEFAULT_PREFIX, populate: bool = False) -> Segment:
    """A new named segment (mode 0600, created exclusively); unlink it once when done."""
    dir = shm_dir(dir)
    name = name or segment_name(prefix)
    path = os.path.join(dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        return _new(fd, size, path, dir, populate, name=name, dir=dir)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def attach(name: str, dir: str | os.PathLike | None = None, *, expected_size: int | None = None,
           populate: bool = False) -> Segment:
    """Map an existing named segment; raises FileNotFoundError or SegmentError."""
    dir = shm_dir(dir)
    path = os.path.join(dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return Segment(fd, name=name, dir=dir, populate=populate, expected_size=expected_size)
    finally:
        os.close(fd)


def attach_fd(fd: int, *, expected_size: int | None = None, populate: bool = False) -> Segment:
    """Map a segment from a descriptor; the caller keeps (and closes) ``fd``."""
    return Segment(fd, populate=populate, expected_size=expected_size)


def unlink(name: str, dir: str | os.PathLike | None = None) -> None:
    """Remove a named segment's name."""
    os.unlink(os.path.join(shm_dir(dir), name))
