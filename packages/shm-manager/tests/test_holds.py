"""A holder that dies gives its count back through the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import shm_core
import shm_manager
from conftest import HOLDER, figure, kill, segments_of, wait_until
from shm_manager import _client


def test_a_killed_holder_gives_its_count_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = shm_core.create(1 << 20, name=shm_manager.new_name(), dir=d)
    seg.incref()
    shm_manager.register(seg.name, d)
    shm_manager.hold(seg.name, d)
    env = dict(os.environ, ARRAYMP_GROUP=shm_manager.group())
    p = subprocess.Popen([sys.executable, "-c", HOLDER, seg.name, d], stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "held"
        assert seg.refcount == 2
        kill(p.pid)
        p.wait(10)
        took = wait_until(lambda: seg.refcount == 1, 5, "the daemon to give back the dead holder's count")
        figure(f"holds: a SIGKILLed holder's count was given back {took:.3f} s after its death")
        assert os.path.exists(seg.path)  # we still hold it
        assert shm_manager.release(seg.name, d)  # the daemon takes our count back and unlinks
        wait_until(lambda: not os.path.exists(seg.path), 5, "the daemon to unlink on the last release")
    finally:
        kill(p.pid)
        seg.close()


def test_last_holder_killed_unlinks(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = shm_core.create(4096, name=shm_manager.new_name(), dir=d)
    shm_manager.register(seg.name, d)  # nobody here holds it: the in-flight count goes to the holder
    seg.incref()
    env = dict(os.environ, ARRAYMP_GROUP=shm_manager.group())
    p = subprocess.Popen([sys.executable, "-c", HOLDER.replace("seg.incref()\n", ""), seg.name, d],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "held"
        kill(p.pid)
        p.wait(10)
        wait_until(lambda: not os.path.exists(seg.path), 5, "the daemon to unlink the segment nobody holds")
    finally:
        kill(p.pid)
        seg.close()


def test_a_holder_of_another_group_keeps_the_segment_past_its_group(env, actors):
    """Note [Holds across groups]: a process of group B holds a segment of group A; A ends (normal exit of its
    main process); the segment lives on while B's process holds it, and goes when that holder is SIGKILLed."""
    from conftest import exit_actor

    d = env["ARRAYMP_SHM_DIR"]
    a = actors(env)
    group_a = a.call("group")["group"]
    (name,) = a.call("create", n=1)["names"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name, d], stdout=subprocess.PIPE, text=True,
                              env=env)  # no ARRAYMP_GROUP: a group of its own
    try:
        assert holder.stdout.readline().strip() == "held"
        assert a.call("drop", names=[name])["unlinked"] == []  # the holder's count keeps it
        exit_actor(a)  # group A's only member ends: its exit and its daemon would clean the group up
        assert os.path.exists(os.path.join(d, name)), "a segment held by another group's process was removed"
        assert shm_manager.gc(dir=d) == []  # group A is not proved dead while the holder lives
        kill(holder.pid)
        holder.wait(10)
        took = wait_until(lambda: not os.path.exists(os.path.join(d, name)), 5,
                          "group A's daemon to give back the killed foreign holder's count")
        figure(f"holds: a SIGKILLed holder of another group released the segment {took:.3f} s after its death")
        wait_until(lambda: not any(group_a in n for n in os.listdir(d)), 5, "group A's files to go")
    finally:
        kill(holder.pid)
        holder.wait(10)
        holder.stdout.close()


def test_a_clean_exit_closes_the_daemon_connection_and_unlinks(env):
    """A program that made and held a named segment exits: nothing is left, and its daemon connection is closed
    before the interpreter goes down, after every exit hook that may release a segment (a socket left to the
    interpreter's teardown warns 'unclosed socket' when it is collected). ``check`` runs last of the exit hooks
    (registered first)."""
    code = ("import atexit\n"
            "def check():\n"
            "    import shm_manager._client as c\n"
            "    print('open' if any(x.sock is not None for x in c._conns.values()) else 'closed', flush=True)\n"
            "atexit.register(check)\n"
            "import shm_core, shm_manager\n"
            "seg = shm_core.create(4096, name=shm_manager.new_name())\n"
            "seg.incref(); shm_manager.register(seg.name); shm_manager.hold(seg.name)\n"
            "print(seg.name, shm_manager.daemon_pid(), flush=True)\n")
    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    name, _daemon, state = out.stdout.split()
    assert state == "closed" and "ResourceWarning" not in out.stderr, (out.stdout, out.stderr)
    wait_until(lambda: not os.path.exists(os.path.join(env["ARRAYMP_SHM_DIR"], name)), 10, "the segment to go")


EXIT_HOLDING = """
import sys, shm_core, shm_manager
d = sys.argv[1]
held = shm_core.create(4096, name=shm_manager.new_name(), dir=d)  # a module-level array at exit: held
held.incref()
shm_manager.register(held.name, d)
shm_manager.hold(held.name, d)
lost = shm_core.create(4096, name=shm_manager.new_name(), dir=d)  # the count of a message lost in flight
lost.incref()
shm_manager.register(lost.name, d)
print(held.name, lost.name, flush=True)
"""


def test_a_normal_exit_still_holding_a_segment_is_no_leak(env, tmp_path):
    # issue 20: a program that exits normally with a live module-level shared array logged "removed 1 leaked
    # segment(s)"; a segment still held at exit is removed with the group, silently; a count nobody held is a leak
    d = env["ARRAYMP_SHM_DIR"]
    out = subprocess.run([sys.executable, "-c", EXIT_HOLDING, d], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    held, lost = out.stdout.split()
    wait_until(lambda: not segments_of(d, [held.split("_")[2]]), 10, "the group's end to remove its segments")
    logs = [os.path.join(root, "manager.log") for root, _, files in os.walk(d) if "manager.log" in files]
    text = "".join(open(log).read() for log in logs)
    assert lost in text and held not in text, text


def test_a_daemon_far_behind_its_clients_gives_back_none_of_their_counts(tmp_path, monkeypatch):
    # a stopped (or starved) daemon left a busy client with more than _MAX_PENDING bytes unsent: the client closed
    # its connection, and the daemon, reading that EOF, gave back the counts the client still held
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(_client, "_MAX_PENDING", 64 << 10)
    d = str(tmp_path)
    seg = shm_core.create(4096, name=shm_manager.new_name(), dir=d)
    shm_manager.register(seg.name, d)
    shm_manager.hold(seg.name, d)
    seg.incref()
    shm_manager.flush()
    daemon = shm_manager.daemon_pid(d)
    os.kill(daemon, signal.SIGSTOP)
    resume = threading.Timer(2.0, os.kill, (daemon, signal.SIGCONT))
    resume.start()
    try:
        other = shm_manager.new_name()
        for _ in range(20_000):  # ~2.4 MB of frames
            shm_manager.register(other, d)
            shm_manager.unregister(other, d)
    finally:
        resume.join()
        os.kill(daemon, signal.SIGCONT)
    assert shm_manager.flush(10)
    time.sleep(0.3)
    assert os.path.exists(seg.path) and seg.refcount == 1
    assert shm_manager.daemon_pid(d) == daemon
    assert shm_manager.release(seg.name, d)
    wait_until(lambda: not os.path.exists(seg.path), 5, "the last release to unlink")
    seg.close()
