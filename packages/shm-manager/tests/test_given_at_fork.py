"""Note [Counts given at fork] (_books.py): the counts a parent takes for a fork child go back when the child dies,
even if it dies before it ran a line of ours; a child that claims them holds them as any hold; G and C frames may
come in either order; a segment whose maker died making it is removed."""

from __future__ import annotations

import os
import signal
import time

import shm_core
import shm_manager
from conftest import wait_until
from shm_manager import _paths


def made(d: str) -> shm_core.Segment:
    seg = shm_core.create(4096, name=shm_manager.new_name(), dir=d)
    shm_manager.register(seg.name, d)
    shm_manager.hold(seg.name, d)
    seg.incref()
    return seg


def fork_child(then, linger: bool = False):
    """A fork child that runs ``then()`` in place of everything else, reported by a pipe (then, ``linger``: it waits
    to be killed); returns (pid, start time, the pipe's reading end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            then()
        finally:
            os.write(w, b"x")
            if linger:
                time.sleep(30)
            os._exit(0)
    os.close(w)
    return pid, _paths.start_time(pid), r


def test_counts_given_to_a_child_that_never_claims_go_back_when_it_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = made(d)
    seg.incref()  # the child's count, taken before the fork
    pid, start, r = fork_child(lambda: time.sleep(0.5))  # it never claims it: as if killed at once
    shm_manager.give(pid, start, [(seg.name, d)])
    assert seg.refcount == 2
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    wait_until(lambda: seg.refcount == 1, 5, "the daemon to give back the count given to the dead child")
    assert shm_manager.release(seg.name, d)
    wait_until(lambda: not os.path.exists(seg.path), 5, "the last release to unlink")
    seg.close()


def test_a_claim_before_or_after_its_give_is_one_count(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    for claim_first in (True, False):
        seg = made(d)
        seg.incref()  # the child's
        go_r, go_w = os.pipe()

        def child(seg=seg, go_r=go_r, claim_first=claim_first):
            if not claim_first:
                os.read(go_r, 1)  # the parent's give first
            shm_manager.claim(seg.name, d)
            shm_manager.flush()
            os.read(go_r, 1)  # then wait to be killed

        pid, start, r = fork_child(child)
        if claim_first:
            time.sleep(0.3)  # its claim is read first
        shm_manager.give(pid, start, [(seg.name, d)])
        shm_manager.flush()
        if not claim_first:
            os.write(go_w, b"g")
        time.sleep(0.3)
        assert seg.refcount == 2
        os.kill(pid, signal.SIGKILL)  # it holds its count: given back once, at its death
        os.waitpid(pid, 0)
        for fd in (r, go_r, go_w):
            os.close(fd)
        wait_until(lambda seg=seg: seg.refcount == 1, 5, "the daemon to give back the dead child's count once")
        time.sleep(0.3)
        assert seg.refcount == 1, f"claim_first={claim_first}: counted twice"
        assert shm_manager.release(seg.name, d)
        wait_until(lambda seg=seg: not os.path.exists(seg.path), 5, "the last release to unlink")
        seg.close()


def test_a_child_that_claims_and_releases_gives_back_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = made(d)
    seg.incref()

    def child():
        shm_manager.claim(seg.name, d)
        assert shm_manager.release(seg.name, d)
        shm_manager.flush()

    pid, start, r = fork_child(child)
    shm_manager.give(pid, start, [(seg.name, d)])
    assert os.read(r, 1) == b"x"
    os.waitpid(pid, 0)
    os.close(r)
    wait_until(lambda: seg.refcount == 1, 5, "the child's release")
    time.sleep(0.3)
    assert seg.refcount == 1
    assert shm_manager.release(seg.name, d)
    wait_until(lambda: not os.path.exists(seg.path), 5, "the last release to unlink")
    seg.close()


def test_a_segment_its_maker_died_making_is_removed(tmp_path, monkeypatch):
    # the name and the count are told first (mp_reductions _shared.create_segment); the maker is killed with the file
    # made but no header in it
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    named_r, named_w = os.pipe()

    def make_half():
        name = shm_manager.new_name()  # its own: a maker's count is on its word before the file exists
        shm_manager.register(name, d)
        shm_manager.hold(name, d)
        shm_manager.flush()
        fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 8192)
        os.write(named_w, name.encode())

    pid, _, r = fork_child(make_half, linger=True)
    assert os.read(r, 1) == b"x"
    os.close(named_w)
    name = os.read(named_r, 200).decode()
    os.close(named_r)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    wait_until(lambda: not os.path.exists(os.path.join(d, name)), 5, "the daemon to remove the half-made segment")
