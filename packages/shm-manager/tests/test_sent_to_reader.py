"""Note [Counts sent to a reader] (_books.py): a sender adds a message's in-flight count and tells the daemon (T)
in one call; the reader's take (A) matches it in either order, once; what a sender told and its reader never took
goes back once the reader is done with it (S); a sender takes back a count whose message failed (V); a T after
the reader was done with its sender goes back at once; malformed frames are ignored and the daemon serves on."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
import shm_manager
from conftest import wait_until
from shm_manager import _client
from test_given_at_fork import fork_child, made


def told_by_a_child(seg, d, then=None):
    """A fork child that tells the daemon of one count of ``seg`` sent to this process (and runs ``then()``); it
    then waits to be killed. Returns (pid, its pipe)."""

    def child():
        assert shm_manager.send_to(os.getppid(), seg.name, d, seg.incref)
        if then is not None:
            then()
        shm_manager.flush()

    pid, _, r = fork_child(child, linger=True)
    assert os.read(r, 1) == b"x"
    return pid, r


def told_on_cue(seg, d):
    """As told_by_a_child, but the child tells once this process writes to ``cue``; returns (pid, its pipe,
    cue)."""
    go_r, go_w = os.pipe()

    def child():
        os.read(go_r, 1)
        assert shm_manager.send_to(os.getppid(), seg.name, d, seg.incref)
        shm_manager.flush()

    pid, _, r = fork_child(child, linger=True)
    os.close(go_r)
    return pid, r, go_w


def released_and_gone(seg, d) -> None:
    """This process's last count of ``seg`` given back: the segment goes."""
    assert shm_manager.release(seg.name, d)
    wait_until(lambda: not os.path.exists(seg.path), 5, "the last release to unlink")
    seg.close()


def killed(pid: int, r: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)


def test_a_count_told_and_never_taken_goes_back_once_the_reader_is_done_with_its_dead_sender(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = made(d)
    pid, r = told_by_a_child(seg, d)  # killed before it sent its message: it added nothing itself
    assert seg.refcount == 2  # its count, added as it told
    killed(pid, r)
    time.sleep(0.3)
    assert seg.refcount == 2  # the reader may still read its message
    shm_manager.done_with([pid])
    wait_until(lambda: seg.refcount == 1, 5, "the daemon to give back the count never taken")
    shm_manager.done_with([pid])  # (once)
    time.sleep(0.3)
    assert seg.refcount == 1
    released_and_gone(seg, d)


def test_a_take_before_or_after_its_tell_is_one_count_the_readers(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    for take_first in (True, False):
        seg = made(d)
        if take_first:
            pid, r, cue = told_on_cue(seg, d)
            shm_manager.take_from(pid, seg.name, d)  # its message read before the daemon read its T
            shm_manager.flush()
            time.sleep(0.3)  # (the daemon reads the take first)
            os.write(cue, b"g")
            os.close(cue)
            assert os.read(r, 1) == b"x"
        else:
            pid, r = told_by_a_child(seg, d)
            assert seg.refcount == 2
            shm_manager.take_from(pid, seg.name, d)
            shm_manager.flush()
        time.sleep(0.3)
        assert seg.refcount == 2, f"take_first={take_first}: counted twice"
        killed(pid, r)
        shm_manager.done_with([pid])  # what it sent was taken: nothing goes back
        time.sleep(0.3)
        assert seg.refcount == 2
        assert shm_manager.release(seg.name, d)  # the taken count is a hold of the reader's, as any
        wait_until(lambda seg=seg: seg.refcount == 1, 5, "the reader's release")
        released_and_gone(seg, d)


def test_a_count_taken_back_unsent_or_told_after_the_reader_was_done_goes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = made(d)
    pid, r = told_by_a_child(seg, d, then=lambda: shm_manager.take_back(os.getppid(), seg.name, d))
    time.sleep(0.3)
    assert seg.refcount == 1
    killed(pid, r)
    shm_manager.done_with([pid])
    time.sleep(0.3)
    assert seg.refcount == 1
    # a reader done with a sender before the daemon read that sender's T (its connection accepted late): back at once
    pid, r, cue = told_on_cue(seg, d)
    shm_manager.done_with([pid])
    shm_manager.flush()
    time.sleep(0.3)
    os.write(cue, b"g")
    os.close(cue)
    assert os.read(r, 1) == b"x"
    killed(pid, r)
    time.sleep(0.3)
    assert seg.refcount == 1
    released_and_gone(seg, d)


def test_malformed_count_frames_are_ignored_and_the_daemon_serves_on(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = made(d)
    daemon = shm_manager.daemon_pid(d)
    name = seg.name
    frames = [(b"S", "\u00b2"), (b"S", "-1"), (b"S", "9" * 30), (b"T", f"\u00b2:{name}"),
              (b"T", name), (b"A", f"-3:{name}"), (b"A", f"1:{'../' + name}"), (b"V", f":{name}"),
              (b"G", f"\u00b2:1:{name}"), (b"G", f"1:\u0663:{name}"), (b"C", f"\u00b2:{name}"), (b"T", f"1:{name}\0")]
    with _client._lock:
        c = _client._conn(d, shm_manager.group())
        c.sock.sendall(b"".join(struct.pack("<I", len(op) + len(p.encode())) + op + p.encode() for op, p in frames))
    time.sleep(0.3)
    assert shm_manager.daemon_pid(d) == daemon and seg.refcount == 1
    pid, r = told_by_a_child(seg, d)  # it serves on
    assert seg.refcount == 2
    killed(pid, r)
    shm_manager.done_with([pid])
    wait_until(lambda: seg.refcount == 1, 5, "the count back")
    released_and_gone(seg, d)


def test_a_reader_done_with_a_pid_is_not_done_with_the_next_process_that_has_it(tmp_path):
    # Note [Reused pids]: in a pid namespace of its own (a user namespace makes it without privileges), where the test
    # can give a new process the pid of a dead one; skipped where this kernel or policy allows no user namespaces
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reused_pid.py")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux's unshare (a pid namespace of its own, to reuse a pid)")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc",
                            "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no user and pid namespaces here (unshare: {probe.stderr.strip()})")
    got = subprocess.run([unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc",
                          sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    if got.returncode != 0 and "SKIP: " in got.stderr:
        pytest.skip(got.stderr.strip().rpartition("SKIP: ")[2])
    assert got.returncode == 0, got.stdout + got.stderr
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".")], "segments left"
