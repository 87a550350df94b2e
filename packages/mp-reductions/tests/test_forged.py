"""Forged handles: a receiver raises a clear error, stays alive, takes the next good message, and opens nothing
outside its shared-memory directory.

The receiver is a real spawned process reading an arraymp SimpleQueue. The forged messages are framed as our
channels frame them (``b"H"`` + a pickle, the descriptors in the same sendmsg, see _channel.py); each pickle
holds an object whose ``__reduce__`` is ``(rebuild_ndarray, forged fields)``, exactly what a confused or
malicious peer could send.
"""

import contextlib
import ctypes
import fcntl
import multiprocessing
import os
import pickle
import queue
import socket
import struct
import time
from multiprocessing import reduction
from pathlib import Path

import _targets
import _views
import mp_reductions as mpr
import numpy as np
import pytest
import shm_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mp_reductions._reductions import rebuild_ndarray

SHM = "/dev/shm"  # the receiver's segment directory (no ARRAYMP_SHM_DIR in these tests unless set)
HEAD = struct.Struct("<8sIIQqQ")  # magic, version, flags, size, pid, id: the header's first fields
OBJECT_DTYPES = ["O", [("a", "f8"), ("b", "O")], [("a", [("c", "O")])], [("s", "O", (2,))],
                 *(["T"] if hasattr(np, "dtypes") and hasattr(np.dtypes, "StringDType") else [])]  # numpy 2 strings
FUZZ = settings(max_examples=500, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -------------------------------------------------------------------------------------------- the receiver
def _touch(arr) -> None:
    """Read every byte the array covers, then its repr (which dereferences an object array's pointers)."""
    lo, hi = getattr(np.lib, "array_utils", np).byte_bounds(arr)  # numpy 2, numpy 1
    if hi > lo:
        bytes((ctypes.c_char * (hi - lo)).from_address(lo))
    repr(arr)


def _receive(q, results):
    """The receiver: answers each message with what arrived, or the error it raised."""
    mpr.init_reductions()
    while True:
        try:
            got = q.get()
        except Exception as exc:
            results.put(("error", type(exc).__name__, str(exc), isinstance(exc, shm_core.SegmentError)))
            continue
        if got is None:
            return
        _touch(got)  # (a forged handle may describe 2**40 elements with zero strides: no sum of those)
        results.put(("ok", got.dtype.str, got.shape, float(got.sum()) if got.dtype.kind == "f" and got.size <= 1000
                     else None))
        del got


class Forged:
    """Pickles as a handle with the given fields."""

    def __init__(self, *fields):
        self.fields = fields

    def __reduce__(self):
        return rebuild_ndarray, self.fields


class FakeDupFd:
    """A ("d", ...) reference whose detach() gives whatever it was made with."""

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self.value


class Receiver:
    """A spawned receiver, the queue it reads and the queue of its answers."""

    def __init__(self):
        self.q, self.results = mpr.SimpleQueue(), mpr.Queue()
        self.proc = multiprocessing.get_context("spawn").Process(target=_receive, args=(self.q, self.results))
        self.proc.start()
        self.good = mpr.share_memory(np.arange(1000, dtype=np.float64))

    def answer(self) -> tuple:
        deadline = time.monotonic() + 120  # a hang guard only
        while True:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.is_alive(), f"the receiver died: exit code {self.proc.exitcode}"
                assert time.monotonic() < deadline, "the receiver did not answer"

    def forged(self, *fields, fds=()) -> tuple:
        """Send one forged handle (with ``fds`` as the message's descriptors); the receiver's answer."""
        shm_core.send_fds(self.q._writer._sock, [b"H", pickle.dumps(Forged(*fields))], list(fds))
        return self.answer()

    def refused(self, *fields, fds=(), error="SegmentError", match="") -> str:
        """``fields`` are refused with ``error`` (a message containing ``match``), the receiver lives."""
        got = self.forged(*fields, fds=fds)
        assert got[0] == "error" and got[1] == error and match in got[2], (fields, got)
        return got[2]

    def takes_a_good_message(self) -> None:
        self.q.put(self.good)
        assert self.answer() == ("ok", "<f8", (1000,), 499500.0)

    def close(self) -> None:
        if self.proc.is_alive():
            self.q.put(None)
        self.proc.join(60)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(10)
        exitcode = self.proc.exitcode
        self.proc.close()
        self.q.close()
        self.q = self.results = self.good = None  # pytest keeps the fixture's value until its test is torn down
        assert exitcode == 0, f"the receiver ended with exit code {exitcode}"


@pytest.fixture
def receiver():
    r = Receiver()
    try:
        r.takes_a_good_message()
        yield r
        r.takes_a_good_message()
    finally:
        r.close()


def memfd_with(content: bytes, length: int | None = None) -> int:
    """A memfd holding ``content``, extended to ``length`` bytes with a hole (never allocated), sealed against
    resizing as shm_core seals its own (an unsealed one is refused before anything else: test_untrusted)."""
    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, content)
    if length is not None:
        os.ftruncate(fd, length)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def header(size: int, magic=b"ARRAYMP\0", version=1) -> bytes:
    return HEAD.pack(magic, version, 0, size, 1, 2).ljust(shm_core.HEADER_SIZE, b"\0")


def segment_file(path, size: int, *, fill: bytes = b"\0") -> None:
    """A file with a valid header and ``size`` allocated data bytes."""
    with open(path, "wb") as f:
        f.write(header(size) + fill * size)
    os.chmod(path, 0o600)


@pytest.fixture
def good_segment():
    """A valid memfd segment of 4096 bytes, all 0x41 (as object pointers: 0x4141414141414141)."""
    seg = shm_core.create_anonymous(4096)
    memoryview(seg)[:] = b"A" * 4096
    yield seg
    seg.close()


# ------------------------------------------------------------------------------------------- defect 1: dtypes
@pytest.mark.parametrize("dtype", OBJECT_DTYPES, ids=str)
def test_object_dtypes_are_never_rebuilt_over_shared_bytes(receiver, good_segment, dtype):
    for kind in ("m", "c"):
        receiver.refused((kind, 0), 4096, 0, (4,), None, dtype, False, fds=[good_segment.fd], match="Python objects")
    receiver.refused(("d", reduction.DupFd(good_segment.fd)), 4096, 0, (4,), None, dtype, False,
                     match="Python objects")


# ------------------------------------------------------------------------------------ defect 2: names and dirs
class OpenWatch:
    """Every open, read or write of a file in a directory, by any process (inotify)."""

    IN_ACCESS, IN_MODIFY, IN_OPEN = 0x1, 0x2, 0x20

    def __init__(self, path):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path),
                                                 self.IN_ACCESS | self.IN_MODIFY | self.IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), "inotify", path)

    def events(self) -> list[tuple[str, int]]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                _wd, mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                out.append((buf[i + 16:i + 16 + n].rstrip(b"\0").decode(), mask))
                i += 16 + n

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def outside(tmp_path):
    """A directory outside the shm dir with a text file and a valid segment; nothing may open or change them."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    seg = d / shm_core.segment_name()
    segment_file(seg, 64, fill=b"A")
    files = {p: (p.read_bytes(), os.stat(p).st_mtime_ns, os.stat(p).st_atime_ns) for p in (d / "passwd", seg)}
    # (read, then stat: the atime recorded is after our own read; at the end, stat before reading)
    watch = OpenWatch(d)
    try:
        yield d, seg
        assert watch.events() == [], "a file outside the shm dir was opened"
    finally:
        watch.close()
    stats = {p: (os.stat(p).st_mtime_ns, os.stat(p).st_atime_ns) for p in files}
    assert {p: (p.read_bytes(), *stats[p]) for p in files} == files


@contextlib.contextmanager
def planted(path, make):
    make(path)
    try:
        yield path
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


def test_names_and_dirs_stay_inside_the_shm_dir(receiver, outside):
    d, seg = outside
    escapes = [os.path.relpath(seg, SHM), str(seg), "../" * 12 + "etc/passwd", "/etc/passwd",
               os.path.relpath(d / "passwd", SHM), "..", ".", "", seg.name + "/", seg.name + "\n"]
    for name in escapes:
        receiver.refused(("n", name, SHM), 64, 0, (8,), None, "f8", False, match="not an arraymp segment name")
    for name, dir in [(seg.name, str(d)), (seg.name, str(d) + "/"), (seg.name, SHM + "/../.." + str(d)),
                      ("passwd", "/etc"), (seg.name, "/etc"), (seg.name, os.path.relpath(d))]:
        receiver.refused(("n", name, dir), 64, 0, (8,), None, "f8", False)
    for ref in [("n", seg.name, None), ("n", seg.name), ("n", os.fsencode(seg.name), SHM), ("n", 7, SHM),
                ("n", seg.name, SHM, "extra")]:
        receiver.refused(ref, 64, 0, (8,), None, "f8", False, match="unknown segment reference")
    # a symlink in the shm dir named like a segment, to the segment outside: not followed
    with planted(os.path.join(SHM, shm_core.segment_name()), lambda p: os.symlink(seg, p)) as link:
        receiver.refused(("n", os.path.basename(link), SHM), 64, 0, (8,), None, "f8", False, match="symbolic link")
    with open(f"/proc/{receiver.proc.pid}/maps") as f:
        assert str(d) not in f.read()  # nothing outside is mapped


def test_special_files_under_segment_names_are_refused(receiver):
    def sock(path):
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()

    for make, what in [(lambda p: os.mkfifo(p, 0o600), "pipe or FIFO"), (lambda p: os.mkdir(p, 0o700), "directory"),
                       (sock, "socket")]:
        with planted(os.path.join(SHM, shm_core.segment_name()), make) as path:
            receiver.refused(("n", os.path.basename(path), SHM), 64, 0, (8,), None, "f8", False, match=what)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_segment_is_refused(receiver):
    with planted(os.path.join(SHM, shm_core.segment_name()), lambda p: segment_file(p, 64)) as path:
        os.chown(path, 65534, 65534)  # nobody
        before = Path(path).read_bytes(), os.stat(path).st_mtime_ns
        receiver.refused(("n", os.path.basename(path), SHM), 64, 0, (8,), None, "f8", False,
                         error="PermissionError", match="belongs to uid 65534")
        assert (Path(path).read_bytes(), os.stat(path).st_mtime_ns) == before


# ------------------------------------------------------------------------- defect 3: what a descriptor holds
def test_received_descriptors_must_be_allocated_segment_files(receiver):
    r, w = os.pipe()
    a, b = socket.socketpair()
    dirfd = os.open(SHM, os.O_RDONLY | os.O_DIRECTORY)
    efd = os.eventfd(0)
    forged = [
        (memfd_with(header(1 << 20), shm_core.HEADER_SIZE + (1 << 20)), "are allocated"),  # sparse
        (memfd_with(header(64)[:40]), "too short"),
        (memfd_with(header(64, magic=b"NOTOURS!") + bytes(64)), "bad magic"),
        (memfd_with(header(64, version=7) + bytes(64)), "format version 7"),
        (memfd_with(header(1 << 30) + bytes(64)), "header says 1073741824 data bytes but the file holds 64"),
    ]
    try:
        for fd, what in [*forged, (r, "pipe or FIFO"), (a.fileno(), "socket"), (dirfd, "directory"),
                         (efd, "special descriptor")]:
            receiver.refused(("m", 0), None, 0, (8,), None, "f8", False, fds=[fd], match=what)
            receiver.refused(("d", reduction.DupFd(fd)), None, 0, (8,), None, "f8", False, match=what)
    finally:
        for fd in [fd for fd, _ in forged] + [r, w, dirfd, efd]:
            os.close(fd)
        a.close()
        b.close()


def test_malformed_frames_raise_and_keep_no_descriptor(receiver, good_segment):
    """A message whose frame fits no kind of the wire format (see _channel.py) raises SegmentError, and every
    descriptor it carried is closed; a plain pickle that carries descriptors is read, its descriptors closed."""
    fds_dir = f"/proc/{receiver.proc.pid}/fd"
    before = len(os.listdir(fds_dir))
    spill = memfd_with(header(64) + bytes(64))
    try:
        for frame, fds, what in [
            ([b"S", (64).to_bytes(8, "little")], [], "fits no kind"),  # spilled, its descriptor missing
            ([b"S", b"\1"], [spill], "fits no kind"),  # spilled, its length cut short
            ([b"S", (1 << 40).to_bytes(8, "little")], [spill, good_segment.fd], "1099511627776"),  # too long
            # in parts (Note [spilled pickles]): more parts than descriptors, none, or parts that do not add up
            ([b"S", (128).to_bytes(8, "little") + (3).to_bytes(2, "little")], [spill, spill], "into 3 of its 2"),
            ([b"S", (128).to_bytes(8, "little") + (0).to_bytes(2, "little")], [spill, spill], "into 0 of its 2"),
            ([b"S", (100).to_bytes(8, "little") + (2).to_bytes(2, "little")], [spill, spill], "not the message's 100"),
            ([b"S", (1 << 40).to_bytes(8, "little") + (2).to_bytes(2, "little")], [spill, spill], "1099511627776"),
            ([b"Z", pickle.dumps(np.arange(3.0))], [good_segment.fd], "kind b'Z'"),
        ]:
            shm_core.send_fds(receiver.q._writer._sock, frame, fds)
            got = receiver.answer()
            assert got[0] == "error" and got[3] and what in got[2], (frame, got)
        shm_core.send_fds(receiver.q._writer._sock, [b"P", pickle.dumps(np.arange(3.0))], [good_segment.fd] * 3)
        assert receiver.answer() == ("ok", "<f8", (3,), 3.0)
        receiver.takes_a_good_message()
        assert len(os.listdir(fds_dir)) <= before + 1  # (the good message's segment, kept for its next arrival)
    finally:
        os.close(spill)


def test_descriptor_references_are_checked(receiver, good_segment):
    fd = good_segment.fd
    for ref, fds in [(("m", 1), [fd]), (("m", -1), [fd]), (("m", 1 << 70), [fd]), (("c", 0), []), (("m", 0), [])]:
        receiver.refused(ref, 4096, 0, (8,), None, "f8", False, fds=fds, match="descriptor")
    for ref in [("m", True), ("m", "0"), ("m", 0.0), ("m",), ("x", 0), "m0", None, [("m", 0)], (), ("d", 3)]:
        receiver.refused(ref, 4096, 0, (8,), None, "f8", False, fds=[fd], match="unknown segment reference")
    for value in ["3", -1, None, 1.5]:
        receiver.refused(("d", FakeDupFd(value)), 4096, 0, (8,), None, "f8", False, match="not a descriptor")


def test_sparse_segments_on_a_full_tmpfs_raise_instead_of_sigbus(mount_tmpfs, monkeypatch):
    full_tiny_tmpfs = mount_tmpfs("4m")
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(full_tiny_tmpfs))
    name = shm_core.segment_name()
    with open(full_tiny_tmpfs / name, "wb") as f:  # claims 8 MiB on a 4 MiB tmpfs: holes
        f.write(header(8 << 20))
        f.truncate(shm_core.HEADER_SIZE + (8 << 20))
    with contextlib.suppress(OSError), open(full_tiny_tmpfs / "filler", "wb") as f:
        f.write(bytes(8 << 20))  # now a touched hole has no page to get
    r = Receiver()
    fd = os.open(full_tiny_tmpfs / name, os.O_RDWR)
    try:
        r.refused(("n", name, str(full_tiny_tmpfs)), 8 << 20, 0, (1 << 20,), None, "f8", False, match="allocated")
        r.refused(("m", 0), 8 << 20, 0, (1 << 20,), None, "f8", False, fds=[fd], match="allocated")
        r.takes_a_good_message()
    finally:
        os.close(fd)
        r.close()


# ------------------------------------------------------------------------------------------- fuzzed fields
WEIRD = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4), st.binary(max_size=4),
                  st.lists(st.integers(0, 9), max_size=3), st.tuples(st.text(max_size=2)))
INTS = st.one_of(st.integers(-16, 5000), st.sampled_from([4096, 1 << 31, (1 << 63) - 1, 1 << 63, -(1 << 63), 1 << 64]),
                 st.integers(-(1 << 70), 1 << 70))
DIMS = st.one_of(st.integers(0, 600), st.sampled_from([1 << 40, (1 << 63) - 1, 1 << 63, 1 << 64]), st.integers(-3, -1))
SHAPES = st.one_of(st.lists(DIMS, max_size=5).map(tuple),
                   st.lists(st.integers(0, 2), min_size=60, max_size=70).map(tuple),  # numpy's 64 dimensions
                   st.lists(st.one_of(DIMS, WEIRD), max_size=3).map(tuple), WEIRD)
STRIDES = st.one_of(st.none(), st.lists(INTS, max_size=5).map(tuple), st.lists(st.one_of(INTS, WEIRD), max_size=3)
                    .map(tuple), WEIRD)
DTYPES = st.one_of(st.sampled_from(["f8", "<i4", ">u2", "u1", "c16", "?", "V0", "S0", "U3", "M8[ns]", "V4096",
                                    "V8192", ("f8", (2,)), ("u1", (0,)), ("O", (3,)), [("a", "<i2"), ("b", ">f8")],
                                    "not a dtype", *OBJECT_DTYPES]), WEIRD)


def _has_objects(dtype) -> bool:
    try:
        return np.dtype(dtype).hasobject
    except Exception:
        return False


def test_fuzzed_layout_fields_raise_clearly(receiver, good_segment):
    fd = good_segment.fd

    @FUZZ
    @given(size=st.one_of(st.just(4096), st.none(), INTS, WEIRD), offset=st.one_of(INTS, WEIRD), shape=SHAPES,
           strides=STRIDES, dtype=DTYPES, readonly=st.one_of(st.booleans(), WEIRD))
    def check(size, offset, shape, strides, dtype, readonly):
        got = receiver.forged(("m", 0), size, offset, shape, strides, dtype, readonly, fds=[fd])
        assert got[0] == "ok" or got[3], got  # a refusal is a SegmentError, never TypeError / OverflowError / ...
        assert got[0] == "error" or not _has_objects(dtype), got

    check()


REFS = st.one_of(WEIRD, st.tuples(st.sampled_from(["m", "c", "d", "n", "x", ""]), st.one_of(INTS, WEIRD)),
                 st.tuples(st.sampled_from(["n", "m"]), st.one_of(st.text(max_size=40), WEIRD),
                           st.one_of(st.sampled_from([SHM, "/etc", "/", "/tmp", SHM + "/"]), st.text(max_size=10),
                                     WEIRD)),
                 st.lists(st.one_of(st.sampled_from(["m", "n", "d"]), INTS, WEIRD), max_size=4).map(tuple))


def test_fuzzed_segment_references_raise_clearly(receiver, good_segment):
    @FUZZ
    @given(ref=REFS, nfds=st.integers(0, 2))
    def check(ref, nfds):
        got = receiver.forged(ref, 4096, 0, (8,), None, "f8", False, fds=[good_segment.fd] * nfds)
        if got[0] == "ok":  # a valid index into the message's descriptors
            assert ref[0] in ("m", "c") and 0 <= ref[1] < nfds, (ref, got)
        else:
            assert got[3], (ref, got)

    check()


def test_fuzzed_headers_raise_clearly(receiver):
    @FUZZ
    @given(magic=st.one_of(st.just(b"ARRAYMP\0"), st.binary(min_size=8, max_size=8)),
           version=st.one_of(st.just(1), st.integers(0, (1 << 32) - 1)),
           claimed=st.one_of(st.none(), st.integers(0, 1 << 14), st.integers(0, (1 << 64) - 1)),  # None: the truth
           length=st.integers(0, 1 << 13), hole=st.one_of(st.just(0), st.integers(1, 1 << 14)),
           head=st.one_of(st.just(shm_core.HEADER_SIZE), st.integers(0, shm_core.HEADER_SIZE)))
    def check(magic, version, claimed, length, hole, head):
        """A memfd of ``head`` header bytes, ``length`` data bytes written, then ``hole`` bytes never allocated."""
        data = length + hole
        fd = memfd_with((header(data if claimed is None else claimed, magic, version)[:head] + bytes(length))
                        if head == shm_core.HEADER_SIZE else header(0)[:head],
                        shm_core.HEADER_SIZE + data if head == shm_core.HEADER_SIZE else None)
        try:
            st_ = os.fstat(fd)
            valid = (head == shm_core.HEADER_SIZE and magic == b"ARRAYMP\0" and version == 1
                     and claimed in (None, data) and st_.st_blocks * 512 >= st_.st_size)
            got = receiver.forged(("m", 0), None, 0, (0,), None, "u1", False, fds=[fd])
        finally:
            os.close(fd)
        assert got[0] == ("ok" if valid else "error") and (valid or got[3]), (magic, version, claimed, length, got)

    check()



def bare(code: bytes, shape, data: bytes, flags: int = 0, ndim=None) -> bytes:
    """A bare array message's payload (_bare Note [bare arrays]) with the given fields."""
    ndim = len(shape) if ndim is None else ndim
    return struct.pack("<cBBB", b"A", flags, len(code), ndim) + code + struct.pack(f"<{len(shape)}q", *shape) + data


def test_forged_bare_arrays_raise_clearly_and_keep_no_descriptor(receiver, good_segment):
    """Every field of a bare array comes from another process: one that names no array (or one of Python
    objects) is a SegmentError; descriptors sent along are closed; the receiver goes on."""
    fds_dir = f"/proc/{receiver.proc.pid}/fd"
    before = len(os.listdir(fds_dir))
    for payload in [
        bare(b"O", (2,), bytes(16)),  # object pointers
        bare(b"|O8", (1,), b"A" * 8),
        *([bare(b"T", (1,), bytes(16))] if "T" in OBJECT_DTYPES else []),
        bare(b"f8,O", (1,), bytes(16)),  # a field of objects
        bare(b"<f8", (3,), bytes(16)),  # fewer bytes than the shape holds
        bare(b"<f8", (1,), bytes(16)),  # more
        bare(b"<f8", (1 << 40, 1 << 40), bytes(8)),
        bare(b"<f8", (-1,), bytes(8)),
        bare(b"<f8", (2,), bytes(13)),  # not whole items
        bare(b"qq", (1,), bytes(8)),  # no dtype
        bare(b"\xff\xfe", (1,), bytes(8)),  # not ASCII
        bare(b"<f8", (1,), bytes(8), flags=4),
        bare(b"<f8", (1,), b"", ndim=3),  # the shape cut short
        bare(b"V0", (3,), b"xyz"),  # no bytes to a V0 item
        bare(b"<f8", (1,) * 70, bytes(8)),  # more dimensions than numpy's
        b"A",
        b"A\0\xff",
    ]:
        shm_core.send_fds(receiver.q._writer._sock, [b"P", payload], [good_segment.fd])
        got = receiver.answer()
        assert got[0] == "error" and got[3], (payload[:40], got)
    shm_core.send_fds(receiver.q._writer._sock, [b"P", bare(b"<f8", (2,), np.array([1.5, 2.0]).tobytes())], [])
    assert receiver.answer() == ("ok", "<f8", (2,), 3.5)
    assert len(os.listdir(fds_dir)) <= before


def test_fuzzed_bare_arrays_raise_clearly(receiver):
    @FUZZ
    @given(code=st.one_of(st.sampled_from([b"<f8", b">i2", b"|b1", b"V0", b"S3", b"<M8[s]", b"O", b"(2,)f8"]),
                          st.binary(max_size=12)),
           shape=st.lists(st.integers(-2, 1 << 62), max_size=5), data=st.binary(max_size=64),
           flags=st.integers(0, 255), ndim=st.one_of(st.none(), st.integers(0, 255)))
    def check(code, shape, data, flags, ndim):
        shm_core.send_fds(receiver.q._writer._sock, [b"P", bare(code, shape, data, flags, ndim)], [])
        got = receiver.answer()
        assert got[0] == "ok" or got[3], (code, shape, got)  # an array, or SegmentError: never another error

    check()


def bare_handle(code: bytes, shape, strides=None, *, size=4096, offset=0, block=-1, flags=0, ndim=None,
                tail=b"") -> bytes:
    """A bare handle's payload (_bare Note [bare arrays]) with the given fields."""
    ndim = len(shape) if ndim is None else ndim
    flags |= 4 if strides is not None else 0
    return (struct.pack("<cqqqBBB", b"B", size, offset, block, flags, len(code), ndim) + code
            + struct.pack(f"<{len(shape)}q", *shape) + struct.pack(f"<{len(strides or ())}q", *(strides or ())) + tail)


def test_forged_bare_handles_raise_clearly_and_keep_no_descriptor(receiver, good_segment):
    """A bare handle's fields, and the descriptor it names, come from another process: one that names no view
    inside the segment (or a view of Python objects) is a SegmentError before any array is made; its descriptor
    is closed; the receiver goes on."""
    fds_dir = f"/proc/{receiver.proc.pid}/fd"
    arena = mpr.empty_shared(10)  # a block of an arena segment
    arena_seg = mpr._shared.segment_of(arena)[0]
    arena_fd = mpr._attach.fd_for_sending(arena_seg, dup=True)
    r, w = os.pipe()
    foreign = memfd_with(b"x" * 8192)
    good = good_segment.fd
    before = len(os.listdir(fds_dir))
    wrong = []
    try:
        for payload, fds, match in [
            (bare_handle(b"<f8", (8,), size=1000), [good], "says 1000"),  # not the segment's size
            (bare_handle(b"<f8", (8,), size=-1), [good], "size -1"),
            (bare_handle(b"<f8", (8,), offset=4090), [good], "out of bounds"),
            (bare_handle(b"<f8", (8,), offset=-8), [good], "out of bounds"),
            (bare_handle(b"<f8", (2,), (-8,)), [good], "out of bounds"),  # the second item before the start
            (bare_handle(b"<f8", (2, 2), (1 << 62, 8)), [good], "out of bounds"),
            (bare_handle(b"<f8", (2,), (-(1 << 63),)), [good], "stride"),
            (bare_handle(b"<f8", (1 << 40, 1 << 40)), [good], "more items"),
            (bare_handle(b"u1", (1 << 32, 1 << 32, 0), (0, 0, 1)), [good], "more items"),
            (bare_handle(b"<f8", (-1,)), [good], "negative"),
            (bare_handle(b"|O8", (2,)), [good], "Python objects"),  # object pointers over 0x41 bytes
            (bare_handle(b"f8,O", (1,)), [good], "Python objects"),
            (bare_handle(b"<f8", (2,), flags=2), [good], "flags"),  # Fortran: for inline arrays only
            (bare_handle(b"<f8", (2,), flags=8), [good], "flags"),
            (bare_handle(b"<f8", (2,), tail=b"x"), [good], "too long"),
            (bare_handle(b"<f8", (2,), (8,))[:-3], [good], "cut short"),
            (bare_handle(b"<f8", (2,), ndim=70), [good], "dimensions"),
            (bare_handle(b"<f8", (2,))[:20], [good], "names no array"),
            (bare_handle(b"<f8", (2,)), [], "0 descriptors"),
            (bare_handle(b"<f8", (2,)), [good, good], "2 descriptors"),
            (bare_handle(b"<f8", (2,)), [r], "pipe"),
            (bare_handle(b"<f8", (2,), size=8192), [foreign], "magic"),  # a memfd that is no segment
            (bare_handle(b"<f8", (2,), block=0), [good], "not an arena"),
            (bare_handle(b"<f8", (2,), size=arena_seg.size), [arena_fd], "arena without its block"),
            (bare_handle(b"<f8", (2,), size=arena_seg.size, block=3), [arena_fd], "block"),
            (bare(b"<f8", (1,), bytes(8)), [good], "kind b'A' with 1 descriptors"),
        ]:
            shm_core.send_fds(receiver.q._writer._sock, [b"H", payload], fds)
            got = receiver.answer()
            if not (got[0] == "error" and got[3] and match in got[2]):
                wrong.append((payload[:40], match, got))
        assert not wrong, wrong
        shm_core.send_fds(receiver.q._writer._sock, [b"P", bare_handle(b"<f8", (2,))], [])  # no descriptor
        got = receiver.answer()
        assert got[0] == "error" and got[3] and "kind b'B' with 0 descriptors" in got[2], got
        shm_core.send_fds(receiver.q._writer._sock, [b"H", bare_handle(b"<u1", (4, 2), (1, 4), offset=8)], [good])
        assert receiver.answer() == ("ok", "|u1", (4, 2), None)  # a good one, strided, goes through
        assert len(os.listdir(fds_dir)) <= before + 2  # (the good segment and the arena, kept for their next arrival)
    finally:
        for fd in (r, w, foreign, arena_fd):
            os.close(fd)
        del arena


def test_fuzzed_bare_handles_raise_clearly(receiver, good_segment):
    @FUZZ
    @given(code=st.one_of(st.sampled_from([b"<f8", b">i2", b"|b1", b"V0", b"S3", b"<M8[s]", b"O", b"(2,)f8"]),
                          st.binary(max_size=12)),
           shape=st.lists(st.integers(-2, 1 << 62), max_size=4),
           strides=st.one_of(st.none(), st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4)),
           offset=st.one_of(st.integers(-64, 4160), st.integers(-(1 << 63), (1 << 63) - 1)),
           size=st.sampled_from([4096, 4096, 0, 8192, -5]), block=st.sampled_from([-1, -1, 0, 64, -(1 << 63)]),
           flags=st.integers(0, 255), ndim=st.one_of(st.none(), st.integers(0, 255)))
    def check(code, shape, strides, offset, size, block, flags, ndim):
        payload = bare_handle(code, shape, strides, size=size, offset=offset, block=block, flags=flags, ndim=ndim)
        shm_core.send_fds(receiver.q._writer._sock, [b"H", payload], [good_segment.fd])
        got = receiver.answer()  # (the receiver reads every byte of what it got)
        assert got[0] == "ok" or got[3], (payload, got)  # an array, or SegmentError: never another error

    check()


def test_a_replayed_named_handle_is_named_as_a_cause():
    # issue 20: the same pickled bytes received twice take a count never owned. Where the daemon booked the first
    # receipt's hold before the replay took the in-flight count off the header (shm_manager Note [Booked counts]),
    # the receiver's end gives back a count its sender still needs and the segment is unlinked while the sender
    # holds it: the next receiver must be told that a replay is a cause (the order load_twice waits for). In the other
    # order the daemon books nothing and the count stays right: the next receiver maps the sender's array.
    ctx = multiprocessing.get_context("spawn")
    mpr.set_sharing_strategy("file_system")
    try:
        a = mpr.empty_shared(100_000)
        a[:] = 1
        p = ctx.Process(target=_targets.load_twice, args=(bytes(reduction.ForkingPickler.dumps(a)),))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        # the child's counts go back through the daemon, which reads its frames when it gets to them: the segment
        # goes once it has (sending before then would add a count to a segment that the replay has not emptied yet)
        seg = _views.segment_under(a)
        path = os.path.join(seg.dir, seg.name)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        unlinked = not os.path.exists(path)
        out = mpr.Queue()
        p = ctx.Process(target=_targets.load_and_report, args=(bytes(reduction.ForkingPickler.dumps(a)), out))
        p.start()
        message = out.get(timeout=60)
        p.join(60)
        named = message.startswith("FileNotFoundError") and "received twice" in message
        assert named if unlinked else named or message == "loaded", message
        assert (a == 1).all()  # the sender's array itself is untouched
    finally:
        mpr.set_sharing_strategy("file_descriptor")


# ------------------------------------------------------------------------ spilled messages (_pickling Note [spills])
def spill_segment(nbuf: int, length: int, entries=(), pickled: bytes = b"", pieces=(), *, table: int = 512,
                  at: int = 64, size: int = 4096) -> int:
    """A memfd segment laid out as a spill: count, the table's offset, the pickle's offset and length, the pickle at
    ``at``, the buffer table at ``table``, and ``pieces`` ((offset, bytes)) where the buffers lie."""
    data = bytearray(size)
    data[at:at + len(pickled)] = pickled
    struct.pack_into("<qqqq", data, 0, nbuf, table, at, length)
    for i, (offset, n) in enumerate(entries):
        struct.pack_into("<qq", data, table + 16 * i, offset, n)
    for offset, piece in pieces:
        data[offset:offset + len(piece)] = piece
    return memfd_with(header(size) + bytes(data))


def test_forged_spills_raise_and_keep_no_descriptor(receiver):
    """A spilled message (its pickle and out-of-band buffers in a segment) whose table does not fit the segment, whose
    count is negative, or whose buffers are not exactly those its pickle names raises SegmentError; the receiver
    lives, keeps no descriptor, and reads a well-formed one."""
    fds_dir = f"/proc/{receiver.proc.pid}/fd"
    before = len(os.listdir(fds_dir))
    arr = np.arange(8.0)
    one = pickle.dumps(arr, 5, buffer_callback=lambda b: False)  # names one out-of-band buffer
    two = pickle.dumps([arr, arr + 1], 5, buffer_callback=lambda b: False)  # names two
    data = arr.tobytes()
    cases = [
        (spill_segment(0, 1 << 40), "pickle of 1099511627776 bytes"),  # the pickle past the segment
        (spill_segment(0, 0), "pickle of 0 bytes"),
        (spill_segment(0, len(one), pickled=one, at=16), "at 16 of"),  # the pickle over the header
        (spill_segment(-1, len(one), pickled=one), "-1 buffers"),  # a negative count
        (spill_segment(1 << 60, len(one), pickled=one), "buffers"),  # a count past the segment
        (spill_segment(1, len(one), [(1024, 64)], one, table=16), "listed at 16"),  # the table over the header
        (spill_segment(1, len(one), [], one, table=1 << 40), "listed at 1099511627776"),  # past the segment
        (spill_segment(1, len(one), [(1024, 1 << 40)], one), "not inside"),  # a buffer past the segment
        (spill_segment(1, len(one), [(-8, 64)], one), "not inside"),
        (spill_segment(0, len(one), [], one), "more out-of-band buffers than the 0"),  # fewer than the pickle's
        (spill_segment(1, len(two), [(1024, 64)], two, [(1024, data)]), "more out-of-band buffers than the 1"),
        (spill_segment(2, len(one), [(1024, 64), (2048, 64)], one, [(1024, data)]),
         "names 1 out-of-band buffers, its message carries 2"),
    ]
    good = spill_segment(1, len(one), [(1024, 64)], one, [(1024, data)])
    try:
        for fd, what in cases:
            for kind in (b"OP", b"OH"):
                shm_core.send_fds(receiver.q._writer._sock, [kind], [fd])
                got = receiver.answer()
                assert got[0] == "error" and got[3] and what in got[2], (what, kind, got)
        for frame in ([b"OP"], [b"OX"]):  # no descriptor, an unknown flag
            shm_core.send_fds(receiver.q._writer._sock, frame, [])
            got = receiver.answer()
            assert got[0] == "error" and got[3] and "fits no kind" in got[2], (frame, got)
        shm_core.send_fds(receiver.q._writer._sock, [b"OP"], [good])
        assert receiver.answer() == ("ok", "<f8", (8,), 28.0)
        receiver.takes_a_good_message()
        # a segment refused only once unpickled was mapped, and kept for its next arrival as any received one:
        # for the recycling's idle time (0.2 s here, conftest)
        deadline = time.monotonic() + 10
        while len(os.listdir(fds_dir)) > before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(fds_dir)) <= before + 1
    finally:
        for fd, _ in cases:
            os.close(fd)
        os.close(good)
