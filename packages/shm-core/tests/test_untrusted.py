"""Attaching is safe against forged handles (shm_core Note [untrusted handles]).

Each test plants what a confused peer or another user could plant, then
checks that attach / attach_fd / unlink refuse it with a clear error, before
anything is mapped and without touching anything outside the segment directory.
"""

import contextlib
import fcntl
import os
import socket
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import shm_core

HEAD = struct.Struct("<8sIIQqQ")  # the header's first fields (see shm_core._segment)


def header(size, magic=b"ARRAYMP\0", version=1):
    return HEAD.pack(magic, version, 0, size, os.getpid(), 1234).ljust(shm_core.HEADER_SIZE, b"\0")


def forge(path, size, *, claimed=None, sparse=False, **fields):
    """A file that looks like a segment of ``size`` data bytes whose header says ``claimed`` (default: size)."""
    with open(path, "wb") as f:
        f.write(header(size if claimed is None else claimed, **fields))
        if sparse:
            f.truncate(shm_core.HEADER_SIZE + size)
        else:
            f.write(bytes(size))
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """This process's segment directory (ARRAYMP_SHM_DIR), with an outside directory beside it."""
    d = tmp_path / "shm"
    d.mkdir()
    (tmp_path / "outside").mkdir()
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(d))
    return d


@pytest.fixture
def outside_segment(shm):
    """A file with a valid header outside the shm dir, and a check that nobody changed it."""
    path = forge(shm.parent / "outside" / shm_core.segment_name(), 64)
    before = path.read_bytes(), os.stat(path).st_mtime_ns
    yield path
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before, "the file outside the shm dir was written"


def refuse(name, dir=None, error=shm_core.SegmentError, match=None, **kw):
    with pytest.raises(error, match=match):
        shm_core.attach(name, dir, **kw)


def test_names_that_escape_the_directory_are_refused(shm, outside_segment):
    escape = os.path.relpath(outside_segment, shm)
    assert escape.startswith("../")
    for name in (escape, str(outside_segment), "../" * 10 + "etc/passwd", "/etc/passwd", ".", "..", "",
                 outside_segment.name + "/", outside_segment.name + "\n", "a\0b", b"arraymp_0_1_2_" + b"0" * 16, 7,
                 None, "x" * 300 + outside_segment.name):
        refuse(name, match="not an arraymp segment name")
    for name in (escape, "/etc/passwd"):
        with pytest.raises(shm_core.SegmentError, match="not an arraymp segment name"):
            shm_core.unlink(name)


def test_directories_not_ours_are_refused(shm, outside_segment):
    name = outside_segment.name
    for d in (outside_segment.parent, "/etc", str(shm) + "/../outside", b"/dev/shm", 3, ["/dev/shm"]):
        refuse(name, d, match="this process's segment directories are")
        with pytest.raises(shm_core.SegmentError, match="segment directories"):
            shm_core.unlink(name, d)
    assert outside_segment.exists()


def test_trusted_directories_are_ours_and_those_we_created_in(shm, tmp_path):
    seg = shm_core.create(8)  # in shm_dir()
    seg.close()
    shm_core.attach(seg.name, str(shm) + "/").close()  # the same directory, spelt differently
    other = tmp_path / "created_here"
    other.mkdir()
    theirs = forge(other / shm_core.segment_name(), 8)
    refuse(theirs.name, other, match="segment directories")
    mine = shm_core.create(8, dir=other)  # creating there makes it one of ours
    shm_core.attach(theirs.name, other).close()
    mine.unlink()
    shm_core.unlink(theirs.name, other)
    shm_core.unlink(seg.name)
    assert os.listdir(other) == [] and os.listdir(shm) == []


def test_symlink_named_like_a_segment_is_not_followed(shm, outside_segment):
    name = shm_core.segment_name()
    os.symlink(outside_segment, shm / name)
    refuse(name, match="symbolic link")
    shm_core.unlink(name)  # removes the link, never its target
    assert outside_segment.exists() and os.listdir(shm) == []


def test_special_files_named_like_segments_are_refused(shm):
    fifo, directory, sock = (shm / shm_core.segment_name() for _ in range(3))
    os.mkfifo(fifo, 0o600)
    directory.mkdir()
    dfd = os.open(shm, os.O_PATH | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(f"/proc/self/fd/{dfd}/{sock.name}")  # (a long tmp path, as a normal user's, passes 108 bytes)
            for path, what in ((fifo, "pipe or FIFO"), (directory, "directory"), (sock, "socket")):
                refuse(path.name, match=what)  # and the FIFO does not block
    finally:
        os.close(dfd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_file_is_refused(shm):
    path = forge(shm / shm_core.segment_name(), 64)
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        shm_core.attach(path.name)
    os.unlink(path)


def test_a_mount_over_a_segment_name_is_refused(shm, tmp_path):
    elsewhere = forge(tmp_path / "elsewhere", 64)  # valid, but on another filesystem than the shm dir
    other_fs = tmp_path / "otherfs"
    other_fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(other_fs)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting is not permitted here")
    try:
        forge(other_fs / "seg", 64)
        target = shm / shm_core.segment_name()
        target.touch()
        subprocess.run(["mount", "--bind", str(other_fs / "seg"), str(target)], check=True)
        try:
            refuse(target.name, match="another filesystem")
        finally:
            subprocess.run(["umount", str(target)], check=True)
        os.unlink(target)
    finally:
        subprocess.run(["umount", "--lazy", str(other_fs)], check=True)
    assert elsewhere.exists()


@pytest.mark.parametrize("fields, match", [
    (dict(magic=b"NOTOURS!"), "bad magic"),
    (dict(version=2), "format version 2"),
    (dict(version=0xFFFFFFFF), "format version 4294967295"),
    (dict(claimed=64 + 8), "header says 72 data bytes but the file holds 64"),
    (dict(claimed=(1 << 64) - 1), "header says 18446744073709551615"),
    (dict(claimed=0), "header says 0 data bytes"),
])
def test_forged_headers_are_refused(shm, fields, match):
    path = forge(shm / shm_core.segment_name(), 64, **fields)
    refuse(path.name, match=match)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(shm_core.SegmentError, match=match):
            shm_core.attach_fd(fd)
    finally:
        os.close(fd)


def test_truncated_file_is_refused(shm):
    path = shm / shm_core.segment_name()
    path.write_bytes(header(64)[:40])
    refuse(path.name, match="too short")


def test_sparse_named_segment_is_refused(shm):
    path = forge(shm / shm_core.segment_name(), 1 << 20, sparse=True)
    refuse(path.name, match="only .* of its 1,048,640 bytes are allocated")
    shm_core.unlink(path.name)


def test_received_descriptors_must_be_allocated_regular_files():
    memfd = os.memfd_create("forged")
    os.write(memfd, header(1 << 20))
    os.ftruncate(memfd, shm_core.HEADER_SIZE + (1 << 20))  # a hole: never reserved
    r, w = os.pipe()
    a, b = socket.socketpair()
    dirfd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    efd = os.eventfd(0)
    try:
        for fd, what in ((memfd, "allocated"), (r, "pipe or FIFO"), (a.fileno(), "socket"), (dirfd, "directory"),
                         (efd, "special descriptor")):
            with pytest.raises(shm_core.SegmentError, match=what):
                shm_core.attach_fd(fd)
    finally:
        for fd in (memfd, r, w, dirfd, efd):
            os.close(fd)
        a.close()
        b.close()


def test_memfd_segments_are_sealed_against_resizing():
    # issue 20: a sender that shrank its memfd killed a receiver that had mapped it with SIGBUS
    seg = shm_core.create_anonymous(1 << 20)
    for size in (0, shm_core.HEADER_SIZE, 4 << 20):
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, size)
    with pytest.raises(PermissionError):  # and no one may add a seal (F_SEAL_FUTURE_WRITE) either
        fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    other = shm_core.attach_fd(seg.fd)
    other.ndarray((1 << 17,), "f8")[:] = 1  # every page there, and stays
    assert os.fstat(seg.fd).st_size == shm_core.HEADER_SIZE + (1 << 20)


def test_unsealed_descriptors_are_refused():
    good = shm_core.create_anonymous(1 << 16)
    for flags in (0, os.MFD_ALLOW_SEALING):  # a memfd that could be shrunk under the receiver's mapping
        memfd = os.memfd_create("forged", flags)
        try:
            os.write(memfd, good.read(0, shm_core.HEADER_SIZE))
            os.posix_fallocate(memfd, 0, shm_core.HEADER_SIZE + (1 << 16))
            with pytest.raises(shm_core.SegmentError, match="not sealed against shrinking"):
                shm_core.attach_fd(memfd)
        finally:
            os.close(memfd)


def test_real_segments_are_fully_allocated(shm):
    for seg in (shm_core.create(3 << 20), shm_core.create_anonymous(3 << 20)):
        st = os.fstat(seg.fd) if seg.fd >= 0 else os.stat(seg.path)
        assert stat.S_ISREG(st.st_mode) and st.st_blocks * 512 >= st.st_size == (3 << 20) + shm_core.HEADER_SIZE
        seg.unlink()
        seg.close()


def test_created_names_are_checked(shm):
    for name in ("../escape", "/tmp/x", "x"):
        with pytest.raises(shm_core.SegmentError, match="not an arraymp segment name"):
            shm_core.create(8, name=name)
    with pytest.raises(shm_core.SegmentError, match="not an arraymp segment name"):
        shm_core.create(8, prefix="../")
    assert os.listdir(shm) == [] and os.listdir(shm.parent / "outside") == []


def test_name_pattern_is_what_segment_name_makes():
    for prefix in ("arraymp_", "arraymp_cuda_", "other-", ""):
        name = shm_core.segment_name(prefix, group="g1")
        m = shm_core.NAME_RE.fullmatch(name)
        assert m and m["prefix"] == prefix and shm_core.parse_name(name, prefix) == (os.getuid(), "g1", os.getpid())
    assert shm_core.parse_name("arraymp_../1_g_2_" + "0" * 16) is None


def test_sparse_segment_on_a_full_tmpfs_raises_instead_of_sigbus(mount_tmpfs):
    full_tiny_tmpfs = mount_tmpfs("4m")
    name = shm_core.segment_name()
    forge(full_tiny_tmpfs / name, 8 << 20, sparse=True)  # claims 8 MiB on a 4 MiB tmpfs
    with contextlib.suppress(OSError):  # fill it: a touched hole has no page to get
        with open(full_tiny_tmpfs / "filler", "wb") as f:
            f.write(bytes(8 << 20))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import shm_core
        try:
            seg = shm_core.attach({name!r})
        except shm_core.SegmentError as exc:
            print("refused:", exc)
        else:
            print(bytes(memoryview(seg)[-8:]))  # the last page: not there
    """)], capture_output=True, text=True, timeout=60, env=dict(os.environ, ARRAYMP_SHM_DIR=str(full_tiny_tmpfs)))
    assert out.returncode == 0, (out.returncode, out.stderr)  # -7: SIGBUS
    assert "refused:" in out.stdout and "are allocated" in out.stdout
