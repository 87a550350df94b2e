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
touch. Attaching checks the file and its header before anything is mapped
(Note [untrusted handles]).

Lifecycle (as ``multiprocessing.shared_memory``): ``close()`` per process,
``unlink()`` once; the mapping itself does not keep a file descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import reprlib
import resource
import stat
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
#: the seals of every memfd segment (Note [untrusted handles]); 0 where memfds do not exist
_MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: a segment name, as segment_name() makes it: ``<prefix><uid>_<group>_<pid>_<16 hex>``, the prefix empty or
#: ending in a non-digit; letters, digits, '_' and '-' only (never '/' or '.'). The one definition: shm_manager
#: may reuse it.
NAME_RE = re.compile(r"(?P<prefix>(?:[A-Za-z0-9_-]{0,63}[A-Za-z_-])?)(?P<uid>[0-9]{1,10})_(?P<group>[0-9a-z]{1,32})"
                     r"_(?P<pid>[0-9]{1,10})_[0-9a-f]{16}")

# Note [untrusted handles]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: nothing a handle names is mapped before it is checked, so a forged handle (a name and directory, or a
# received descriptor: untrusted input from another process) raises SegmentError (PermissionError: another user's
# file) in the receiver, never SIGBUS, SIGSEGV or a write elsewhere. The checks:
#
# - a name must match NAME_RE (one path component, no '/', no '..'); the directory must be one this process trusts
#   (its shm_dir(), or one it created segments in: _created_dirs), never a path from the wire;
# - the name is opened (and unlinked) relative to a descriptor of that directory, with O_NOFOLLOW (a symlink named
#   like a segment is not followed); fstat then wants a regular file owned by our euid on that filesystem;
# - the file (named or received) must be a regular file whose header, read with pread, is ours and says exactly the
#   file's length, and whose allocated blocks cover that length: _reserve allocates every page of every segment
#   (fallocate, or zeros written), so a sparse file is a forgery, whose first touch would SIGBUS on a full tmpfs. We
#   never map past the file's end;
# - a received descriptor must be sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, added by create_anonymous once
#   its pages are reserved): its sender cannot cut it under our mapping, and nobody can add a seal
#   (F_SEAL_FUTURE_WRITE) that would break another holder's next mapping.
#
# Not covered: a process of our own uid shrinking a named file after we mapped it (named tmpfs files cannot be
# sealed).
_created_dirs: set[str] = set()
_repr = reprlib.Repr()  # untrusted values in messages, cut at 200 characters
_repr.maxstring = _repr.maxother = 200


def shm_dir(dir: str | os.PathLike | None = None) -> str:
    """The directory for named segments: ``dir``, else $ARRAYMP_SHM_DIR, else /dev/shm."""
    return os.fspath(dir) if dir is not None else os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")


class SegmentError(ValueError):
    """Raised when a file is not a valid arraymp segment (foreign, corrupted or truncated)."""


class SharedMemoryFullError(OSError):
    """Raised when tmpfs has no room for a new segment's pages, or (errno EFBIG) the segment is larger than the
    process's file-size limit (RLIMIT_FSIZE, ``ulimit -f``), which memfds obey too."""

    def __init__(self, where: str, asked: int, free: int | None, dir: str = "/dev/shm", fsize: int | None = None):
        if fsize is not None:
            super().__init__(errno.EFBIG, f"a {asked + HEADER_SIZE:,}-byte shared-memory segment in {where} is "
                             f"past this process's file-size limit of {fsize:,} bytes (RLIMIT_FSIZE). Raise it "
                             "(ulimit -f unlimited) to send large arrays by shared memory", where)
            self.asked, self.free = asked, free
            return
        free_text = "unknown" if free is None else f"{free:,} bytes free"
        if os.path.normpath(dir) == "/dev/shm":
            fix = ("Give the container a larger /dev/shm (docker run --shm-size=8g, or mount -o remount,size=8G "
                   "/dev/shm), free memory, or use the 'file_descriptor' sharing strategy")
        else:
            fix = (f"Make {dir} larger (ARRAYMP_SHM_DIR names it; e.g. mount -o remount,size=8G {dir}), point "
                   "ARRAYMP_SHM_DIR at a larger tmpfs, free memory, or use the 'file_descriptor' sharing strategy")
        super().__init__(
            28,  # ENOSPC
            f"no space in {where} for a {asked:,}-byte shared-memory segment "
            f"({asked + HEADER_SIZE:,} with its header) ({free_text}). {fix}",
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
    """Allocate every page of the file: receivers refuse sparse segments (Note [untrusted handles])."""
    try:
        try:
            _native.fallocate(fd, length, where)
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:  # else a filesystem without fallocate: write the zeros
                raise
            _write_zeros(fd, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFullError(where, length - HEADER_SIZE, _free_bytes(free_path), free_path) from None
        if exc.errno == errno.EFBIG:
            raise SharedMemoryFullError(where, length - HEADER_SIZE, None, free_path,
                                        fsize=resource.getrlimit(resource.RLIMIT_FSIZE)[0]) from None
        raise


def _write_zeros(fd: int, length: int) -> None:
    zeros = memoryview(bytes(min(length, 1 << 20)))
    done = 0
    while done < length:
        done += os.pwrite(fd, zeros[:length - done], done)


def segment_name(prefix: str = DEFAULT_PREFIX, group: str | None = None) -> str:
    """An unguessable segment name ``<prefix><uid>_<group>_<pid>_<random>``.

    ``group`` identifies the process group that owns the segment (see
    shm_manager); it defaults to this process's pid.
    """
    pid = os.getpid()
    return f"{prefix}{os.getuid()}_{group or pid}_{pid}_{os.urandom(8).hex()}"


def parse_name(name: str, prefix: str = DEFAULT_PREFIX) -> tuple[int, str, int] | None:
    """``(uid, group, pid)`` of a name made by :func:`segment_name`, else None."""
    m = NAME_RE.fullmatch(name)
    if m is None or m["prefix"] != prefix:
        return None
    return int(m["uid"]), m["group"], int(m["pid"])


def _checked_name(name) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise SegmentError(f"{_repr.repr(name)} is not an arraymp segment name (<prefix><uid>_<group>_<pid>_<16 "
                           "hex digits>, no '/' or '.'): the handle is forged or corrupted; segment names come "
                           "from shm_core.segment_name()")
    return name


def _checked_dir(dir) -> str:
    """``dir`` (normalized) when this process trusts it: its shm_dir(), or one it created segments in."""
    here = os.path.normpath(shm_dir())
    if dir is None:
        return here
    d = os.path.normpath(dir) if isinstance(dir, (str, os.PathLike)) else None
    if d != here and d not in _created_dirs:
        raise SegmentError(f"the handle names a segment in {_repr.repr(dir)}, but this process's segment "
                           f"directories are {', '.join(sorted({here} | _created_dirs))}: set ARRAYMP_SHM_DIR to "
                           "the same directory in every process (or the handle is forged)")
    return d


@contextlib.contextmanager
def _dir_fd(d: str):
    dfd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield dfd
    finally:
        os.close(dfd)


_NOT_FILES = {errno.ELOOP: "a symbolic link (not followed)", errno.EISDIR: "a directory",
              errno.ENXIO: "a socket or device"}
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a pipe or FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}


def _checked_length(fd: int, where: str, expected_size, sealed: bool) -> int:
    """The length of the segment file ``fd``, checked before anything is mapped (Note [untrusted handles])."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "a special descriptor (eventfd, epoll, ...)")
        raise SegmentError(f"{where} is {kind}, not a shared-memory segment file: the handle is forged or "
                           "corrupted; send arrays through arraymp queues and pipes")
    length = st.st_size
    head = os.pread(fd, _HEAD.size, 0) if length >= HEADER_SIZE else b""
    if len(head) < _HEAD.size:
        raise SegmentError(f"{where}: {length} bytes is too short for a segment header (truncated or foreign file)")
    magic, version, _flags, size, _pid, _id = _HEAD.unpack(head)
    if magic != MAGIC:
        raise SegmentError(f"{where}: bad magic {magic!r}; not an arraymp segment")
    if version != VERSION:
        raise SegmentError(f"{where}: segment format version {version}, this shm-core reads {VERSION}; "
                           "use the same arraymp version in every process")
    if size != length - HEADER_SIZE or (expected_size is not None and size != expected_size):
        raise SegmentError(f"{where}: header says {size} data bytes but the file holds {length - HEADER_SIZE}"
                           + ("" if expected_size is None else f" and the handle says {_repr.repr(expected_size)}")
                           + " (truncated or corrupted)")
    if st.st_blocks * 512 < length:
        raise SegmentError(f"{where}: only {st.st_blocks * 512:,} of its {length:,} bytes are allocated, but every "
                           "segment's pages are reserved when it is made: a forged or damaged sparse file (touching "
                           "it could kill this process with SIGBUS); make segments with shm_core only")
    if sealed and _MEMFD_SEALS:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # not a memfd
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SegmentError(f"{where} is not sealed against shrinking, as every memfd segment is when it is made: "
                               "its sender could cut it under this process's mapping (SIGBUS); the handle is forged, "
                               "or comes from another version of shm-core: use the same one in every process")
    return length


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
                 populate: bool = False, expected_size: int | None = None, fresh: bool = False, sealed: bool = False):
        where = os.path.join(dir, name) if name else f"fd {fd}"
        # fresh: the creator reserved the pages and writes the header next, see _new()
        length = os.fstat(fd).st_size if fresh else _checked_length(fd, where, expected_size, sealed)
        # The mapping is writable for the atomics even when arrays over it are
        # read-only: that promise is kept by the arrays.
        super().__init__(fd, length, data_offset=HEADER_SIZE, populate=populate,
                         readonly=False, views_offset=VIEWS_OFFSET)
        self.name, self.dir = name, dir
        _magic, _version, _flags, _size, pid, ident = _HEAD.unpack(self.read(0, _HEAD.size))
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
    seg.write(0, _HEAD.pack(MAGIC, VERSION, 0, size, os.getpid(), int.from_bytes(os.urandom(8))))
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
    global _MEMFD_SEALS
    try:
        fd = _native.memfd_create("arraymp")
        where, free_path = "memfd (anonymous shared memory)", "/dev/shm"
    except OSError as exc:
        if exc.errno != 38:  # ENOSYS
            raise
        _MEMFD_SEALS = 0  # a file unlinked at once: it cannot be sealed (kernels before 3.17)
        free_path = shm_dir()
        where = os.path.join(free_path, segment_name("arraymp_anon_"))
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(where)
    try:
        seg = _new(fd, size, where, free_path, populate)
        if _MEMFD_SEALS:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _MEMFD_SEALS)  # Note [untrusted handles]: never shrunk under a reader
    except BaseException:
        os.close(fd)
        raise
    seg.fd = fd
    return seg


def create(size: int, *, name: str | None = None, dir: str | os.PathLike | None = None,
           prefix: str = DEFAULT_PREFIX, populate: bool = False) -> Segment:
    """A new named segment (mode 0600, created exclusively); unlink it once when done.

    ``dir`` (default: shm_dir()) becomes a directory this process attaches segments in.
    """
    d = os.path.normpath(shm_dir(dir))
    name = _checked_name(name or segment_name(prefix))
    path = os.path.join(d, name)
    with _dir_fd(d) as dfd:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        _created_dirs.add(d)
        try:
            return _new(fd, size, path, d, populate, name=name, dir=d)
        except BaseException:
            os.unlink(name, dir_fd=dfd)
            raise
        finally:
            os.close(fd)


def attach(name: str, dir: str | os.PathLike | None = None, *, expected_size: int | None = None,
           populate: bool = False) -> Segment:
    """Map an existing named segment of this process's shm dir (Note [untrusted handles]).

    Raises FileNotFoundError, SegmentError, or PermissionError (another user's file).
    """
    d, name = _checked_dir(dir), _checked_name(name)
    path = os.path.join(d, name)
    with _dir_fd(d) as dfd:
        # O_NONBLOCK, O_NOCTTY: a FIFO or device planted under a segment name must not block us (or become
        # our terminal) before fstat refuses it
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in _NOT_FILES:
                raise
            raise SegmentError(f"{path} is {_NOT_FILES[exc.errno]}, not a segment file: the handle is forged, or "
                               "something else was planted under a segment name (remove it)") from None
        try:
            st, dst = os.fstat(fd), os.fstat(dfd)
            if st.st_uid != os.geteuid():
                raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this process's uid "
                                      f"{os.geteuid()}: another user's file under a segment name; it is not "
                                      "mapped (remove it, or use the 'file_descriptor' strategy)", path)
            if st.st_dev != dst.st_dev:
                raise SegmentError(f"{path} is on another filesystem than {d} (a mount over a segment name): "
                                   "not a segment; the handle is forged")
            return Segment(fd, name=name, dir=d, populate=populate, expected_size=expected_size)
        finally:
            os.close(fd)


def attach_fd(fd: int, *, expected_size: int | None = None, populate: bool = False, sealed: bool = True) -> Segment:
    """Map a segment from a descriptor; the caller keeps (and closes) ``fd``. ``sealed``: it must be a memfd sealed
    against resizing, as every memfd segment is (Note [untrusted handles]); False for a named file the caller opened
    by its name."""
    return Segment(fd, populate=populate, expected_size=expected_size, sealed=sealed)


def unlink(name: str, dir: str | os.PathLike | None = None) -> None:
    """Remove a named segment's name, inside a directory this process trusts (Note [untrusted handles])."""
    d, name = _checked_dir(dir), _checked_name(name)
    with _dir_fd(d) as dfd:
        os.unlink(name, dir_fd=dfd)
