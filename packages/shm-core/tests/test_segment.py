import errno
import fcntl
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import shm_core


def run_child(code, *, pass_fds=(), env=None):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], pass_fds=pass_fds,
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def mapped(address):
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == address for line in f)


def test_anonymous_segment_crosses_processes_by_fd():
    seg = shm_core.create_anonymous(8 * 1000)
    a = seg.ndarray((1000,), np.float64)
    a[:] = np.arange(1000)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with parent, child:
        shm_core.send_fds(parent, [b"seg"], [seg.fd])
        out = run_child(f"""
            import socket, os, numpy as np, shm_core
            s = socket.socket(fileno={child.fileno()})
            data, fds, _ = shm_core.recv_fds(s, 16, 4)
            seg = shm_core.attach_fd(fds[0], expected_size=8000)
            os.close(fds[0])
            b = seg.ndarray((1000,), np.float64)
            print(data.decode(), b.sum(), seg.creator_pid)
            b *= 2
        """, pass_fds=[child.fileno()])
    assert out.split() == ["seg", str(float(sum(range(1000)))), str(os.getpid())]
    assert a[10] == 20.0  # the child's write is seen here
    del a
    seg.close()
    assert seg.fd == -1


def test_named_segment_written_here_read_there(tmp_path):
    seg = shm_core.create(64, dir=tmp_path)
    try:
        assert oct(os.stat(seg.path).st_mode & 0o777) == "0o600"
        seg.ndarray((8,), np.int64)[:] = 7
        out = run_child(f"""
            import numpy as np, shm_core
            s = shm_core.attach({seg.name!r}, {str(tmp_path)!r})
            print(s.ndarray((8,), np.int64).tolist())
        """, env=dict(os.environ, ARRAYMP_SHM_DIR=str(tmp_path)))
        assert out.strip() == str([7] * 8)
    finally:
        seg.unlink()
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        shm_core.attach(seg.name, tmp_path)


def test_shm_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    seg = shm_core.create(10)
    assert seg.dir == str(tmp_path) and os.listdir(tmp_path) == [seg.name]
    shm_core.unlink(seg.name)
    assert os.listdir(tmp_path) == []


def test_exclusive_create(tmp_path):
    seg = shm_core.create(10, dir=tmp_path)
    with pytest.raises(FileExistsError):
        shm_core.create(10, name=seg.name, dir=tmp_path)
    seg.unlink()


@pytest.mark.parametrize("content, message", [
    (b"NOTOURS!" + bytes(100), "bad magic"),
    (b"AR", "too short"),
])
def test_foreign_or_truncated_file_is_refused(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    name = shm_core.segment_name()
    (tmp_path / name).write_bytes(content)
    with pytest.raises(shm_core.SegmentError, match=message):
        shm_core.attach(name, tmp_path)


def test_size_mismatch_is_refused(tmp_path):
    seg = shm_core.create(100, dir=tmp_path)
    os.truncate(seg.path, shm_core.HEADER_SIZE + 50)
    with pytest.raises(shm_core.SegmentError, match="header says 100 data bytes but the file holds 50"):
        shm_core.attach(seg.name, tmp_path)
    os.truncate(seg.path, shm_core.HEADER_SIZE + 100)
    with pytest.raises(shm_core.SegmentError, match="the handle says 99"):
        shm_core.attach(seg.name, tmp_path, expected_size=99)
    seg.unlink()


def test_corrupted_version_is_refused(tmp_path):
    seg = shm_core.create(100, dir=tmp_path)
    seg.store(8, 99)
    with pytest.raises(shm_core.SegmentError, match="version 99"):
        shm_core.attach(seg.name, tmp_path)
    seg.unlink()


def test_atomic_increments_from_two_processes(tmp_path):
    seg = shm_core.create(8, dir=tmp_path)
    code = f"""
        import shm_core
        s = shm_core.attach({seg.name!r}, {str(tmp_path)!r})
        add = s.fetch_add
        for _ in range(1_000_000):
            add(64, 1)
    """
    env = dict(os.environ, ARRAYMP_SHM_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert seg.load(64) == 2_000_000
    seg.unlink()


def test_compare_exchange_and_bounds():
    seg = shm_core.create_anonymous(16)
    assert seg.compare_exchange(64, 0, 5) == (True, 0)
    assert seg.compare_exchange(64, 0, 6) == (False, 5)
    seg.store(72, -3)
    assert seg.load(72) == -3
    for bad in (-8, 63, 80, 1 << 40):
        with pytest.raises(ValueError):
            seg.load(bad)
    seg.close()


def test_futex_wait_and_wake():
    import threading

    seg = shm_core.create_anonymous(8)
    assert seg.futex_wait(64, 0, 0.01) is False  # timed out
    assert seg.futex_wait(64, 1, 1.0) is True  # value differs: returns at once

    def wake():
        seg.store(64, 1)
        seg.futex_wake(64)
    t = threading.Timer(0.05, wake)
    t.start()
    while seg.load(64) == 0:
        seg.futex_wait(64, 0, 5.0)
    t.join()
    seg.close()


def test_close_with_live_views_raises_and_last_view_unmaps():
    seg = shm_core.create_anonymous(4096)
    address = seg.address
    view = seg.ndarray((4096,), np.uint8)
    assert seg.views == 1 and mapped(address)
    with pytest.raises(BufferError):
        seg.close()
    view2 = view[10:]
    del seg, view
    assert mapped(address)  # view2 keeps it
    view2[:] = 1
    del view2
    assert not mapped(address)


def test_plain_numpy_buffer_keeps_mapping_alive():
    seg = shm_core.create_anonymous(800)
    address = seg.address
    a = np.ndarray((100,), np.float64, buffer=seg, offset=0)
    a[:] = 1.5
    seg.close_fd()
    del seg
    assert mapped(address) and a.sum() == 150.0
    del a
    assert not mapped(address)


def test_views_counts_processes_not_arrays():
    seg = shm_core.create_anonymous(64)
    a, b = seg.ndarray((8,), np.int64), seg.ndarray((4,), np.int64, offset=32)
    assert seg.views == 1
    del a
    assert seg.views == 1
    del b
    assert seg.views == 0
    seg.close()


def test_readonly_view():
    seg = shm_core.create_anonymous(64)
    a = seg.ndarray((8,), np.int64, readonly=True)
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    del a
    seg.close()


def test_populate_and_zero_size():
    seg = shm_core.create_anonymous(1 << 20, populate=True)
    assert seg.size == 1 << 20 and bytes(memoryview(seg)[:4]) == bytes(4)
    seg.close()
    empty = shm_core.create_anonymous(0)
    assert empty.size == 0 and len(memoryview(empty)) == 0
    empty.close()


def test_pickle_named_reattaches(tmp_path):
    import pickle

    seg = shm_core.create(8, dir=tmp_path)
    seg.ndarray((1,), np.int64)[0] = 42
    other = pickle.loads(pickle.dumps(seg))
    assert other.ndarray((1,), np.int64)[0] == 42 and other.id == seg.id
    with pytest.raises(TypeError, match="file descriptor"):
        pickle.dumps(shm_core.create_anonymous(1))
    seg.unlink()


def test_names_identify_owner():
    name = shm_core.segment_name(group="g1")
    assert shm_core.parse_name(name) == (os.getuid(), "g1", os.getpid())
    assert shm_core.parse_name("sem.mp-123") is None


def test_full_tmpfs_raises_instead_of_sigbus(mount_tmpfs, monkeypatch):
    tiny_tmpfs = mount_tmpfs("1m")
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tiny_tmpfs))
    with pytest.raises(shm_core.SharedMemoryFullError) as info:
        shm_core.create(4 << 20)
    msg = str(info.value)
    assert str(tiny_tmpfs) in msg and "4,194,304" in msg and "bytes free" in msg
    # the remedy names the directory ARRAYMP_SHM_DIR points at, not /dev/shm (issue 24)
    assert "ARRAYMP_SHM_DIR" in msg and "/dev/shm" not in msg and "file_descriptor" in msg
    assert info.value.errno == 28 and isinstance(info.value, OSError)
    assert os.listdir(tiny_tmpfs) == []
    small = shm_core.create(1000)  # the process is fine and can still use it
    small.unlink()
    small.close()


def test_a_full_dev_shm_says_how_to_enlarge_it():
    msg = str(shm_core.SharedMemoryFullError("/dev/shm/x", 100, 10, "/dev/shm"))
    assert "--shm-size" in msg and "remount" in msg and "file_descriptor" in msg


def test_recv_many_takes_every_queued_message_in_one_call_and_no_descriptor():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        buf = bytearray(8 * 16)
        assert shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT) == []  # nothing queued: no BlockingIOError
        for n in range(1, 11):
            a.send(bytes([n]) * n)
        got = shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT)
        assert got == [(n, 0) for n in range(1, 9)]  # as many as the buffer holds, in order
        assert all(buf[k * 16:k * 16 + n] == bytes([n]) * n for k, n in enumerate(range(1, 9)))
        assert shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT) == [(9, 0), (10, 0)]
        a.send(b"x" * 40)  # longer than a frame: cut, and said so
        ((n, flags),) = shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT)
        assert flags & socket.MSG_TRUNC
        before = len(os.listdir("/proc/self/fd"))
        seg = shm_core.create_anonymous(4096)
        shm_core.send_fds(a, [b"fd"], [seg.fd])  # descriptors sent along are dropped by the kernel, not leaked
        seg.close()
        ((n, flags),) = shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT)
        assert n == 2 and flags & socket.MSG_CTRUNC
        assert len(os.listdir("/proc/self/fd")) == before
        with pytest.raises(ValueError):
            shm_core.recv_many(b, buf, 0)
        with pytest.raises(ValueError):
            shm_core.recv_many(b, buf, len(buf) + 1)
        a.close()
        got = shm_core.recv_many(b, buf, 16, socket.MSG_DONTWAIT)  # the peer closed: 0-byte reads, as recv's
        assert got and all(entry == (0, 0) for entry in got)


def test_recv_fds_receives_whole_messages_and_drops_only_what_it_must():
    """recv_fds (a peek, then the receive: Note [descriptor headroom]) returns each message with exactly its
    descriptors, close-on-exec; a message with too many, or too long, is dropped with its descriptors closed."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    segs = [shm_core.create_anonymous(64) for _ in range(5)]
    try:
        with a, b:
            with pytest.raises(BlockingIOError):
                shm_core.recv_fds(b, 16, 4, socket.MSG_DONTWAIT)
            before = len(os.listdir("/proc/self/fd"))
            shm_core.send_fds(a, [b"thr", b"ee"], [s.fd for s in segs[:3]])
            data, fds, flags = shm_core.recv_fds(b, 16, 4)
            assert data == b"three" and len(fds) == 3 and flags == 0
            assert [os.fstat(fd).st_ino for fd in fds] == [os.fstat(s.fd).st_ino for s in segs[:3]]
            assert all(not os.get_inheritable(fd) and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds)
            for fd in fds:
                os.close(fd)
            shm_core.send_fds(a, [b"five"], [s.fd for s in segs])
            with pytest.raises(OSError, match="message dropped"):
                shm_core.recv_fds(b, 16, 4)
            a.send(b"x" * 17)
            with pytest.raises(OSError, match="message dropped"):
                shm_core.recv_fds(b, 16, 4)
            assert len(os.listdir("/proc/self/fd")) == before  # none of theirs left open
            a.send(b"after")  # the channel goes on
            assert shm_core.recv_fds(b, 16, 4) == (b"after", [], 0)
            a.close()
            assert shm_core.recv_fds(b, 16, 4) == (b"", [], 0)  # the peer closed: end of file, as recv's
    finally:
        for s in segs:
            s.close()


def test_recv_fds_short_of_descriptors_leaves_the_message_queued():
    """A receiver that could not install a message's descriptors raises EMFILE and dequeues nothing: once it
    has room, the same message arrives whole."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seg = shm_core.create_anonymous(64)
    with a, b:
        shm_core.send_fds(a, [b"msg"], [seg.fd] * 3)
        seg.close()
        out = run_child(f"""
            import errno, os, resource, socket, shm_core
            s = socket.socket(fileno={b.fileno()})
            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            while (fd := os.dup(0)) < top:  # every number up to top in use: top + 1 the one free under the limit
                pass
            os.close(fd)
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 2, hard))
            n = len(os.listdir("/proc/self/fd"))
            for _ in range(2):
                try:
                    shm_core.recv_fds(s, 16, 4)
                except OSError as e:
                    assert e.errno == errno.EMFILE and "stays queued" in str(e), e
                else:
                    raise AssertionError("received with no room")
            assert len(os.listdir("/proc/self/fd")) == n  # the peeked ones were closed
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, hard))
            data, fds, _ = shm_core.recv_fds(s, 16, 4)
            print(data.decode(), len(fds))
        """, pass_fds=[b.fileno()])
    assert out.split() == ["msg", "3"]


def test_send_fds_sends_one_message_of_its_buffers_and_descriptors():
    """send_fds (one sendmsg, in C): any bytes-like buffers, the descriptors as SCM_RIGHTS; bad input raises
    before anything is sent; a full socket raises BlockingIOError with MSG_DONTWAIT; a peer gone raises
    BrokenPipeError even where SIGPIPE kills (sent with MSG_NOSIGNAL)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seg = shm_core.create_anonymous(64)
    try:
        with a, b:
            before = len(os.listdir("/proc/self/fd"))
            assert shm_core.send_fds(a, (b"ab", bytearray(b"cd"), memoryview(b"xefx")[1:3]), [seg.fd, seg.fd]) == 6
            data, fds, _ = shm_core.recv_fds(b, 16, 4)
            assert data == b"abcdef" and [shm_core.file_id(fd) for fd in fds] == [shm_core.file_id(seg.fd)] * 2
            for fd in fds:
                os.close(fd)
            assert shm_core.send_fds(a, [b""]) == 0 and shm_core.recv_fds(b, 16, 4) == (b"", [], 0)
            assert shm_core.send_fds(a, [bytes([k]) for k in range(200)]) == 200  # a Pool's batch: many buffers
            assert shm_core.recv_fds(b, 256, 4) == (bytes(range(200)), [], 0)
            for buffers, fds, error in (([b"x"], [-1], ValueError), ([b"x"], ["3"], TypeError),
                                        ([b"x"], [1 << 40], ValueError), ([b"x"], [0] * 1025, ValueError),
                                        (["text"], [], TypeError), (b"x", [], TypeError), ([b"x"], 3, TypeError),
                                        ([memoryview(bytes(8))[::2]], [], BufferError)):
                with pytest.raises(error):
                    shm_core.send_fds(a, buffers, fds)
            with pytest.raises(BlockingIOError):
                while True:
                    shm_core.send_fds(a, [bytes(4096)], [seg.fd], socket.MSG_DONTWAIT)
            while shm_core.recv_many(b, bytearray(4096 * 64), 4096, socket.MSG_DONTWAIT):
                pass  # (their descriptors dropped by the kernel)
            with pytest.raises(BlockingIOError):
                shm_core.recv_fds(b, 16, 4, socket.MSG_DONTWAIT)
            assert len(os.listdir("/proc/self/fd")) == before
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        b.close()
        with a:
            out = run_child(f"""
                import signal, socket, shm_core
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                s = socket.socket(fileno={a.fileno()})
                try:
                    shm_core.send_fds(s, [b"x"])
                except BrokenPipeError:
                    print("raised")
            """, pass_fds=[a.fileno()])
        assert out.split() == ["raised"]
    finally:
        seg.close()


def test_file_id_names_the_file_a_descriptor_opens():
    seg = shm_core.create_anonymous(64)
    fd = os.dup(seg.fd)
    try:
        st = os.fstat(seg.fd)
        assert shm_core.file_id(fd) == shm_core.file_id(seg.fd) == (st.st_dev, st.st_ino)
        assert shm_core.file_id(0) != shm_core.file_id(fd)
    finally:
        os.close(fd)
        seg.close()
    with pytest.raises(OSError) as e:
        shm_core.file_id(fd)
    assert e.value.errno == errno.EBADF
