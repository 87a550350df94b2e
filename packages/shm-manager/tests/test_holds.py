"""A holder that dies gives its count back through the daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import shm_core
import shm_manager
from conftest import figure, kill, wait_until

HOLDER = """
import sys, time, shm_core, shm_manager
name, d = sys.argv[1], sys.argv[2]
seg = shm_core.attach(name, d)
seg.incref()
shm_manager.hold(name, d)
shm_manager.flush()
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holder_gives_its_count_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    d = str(tmp_path)
    seg = shm_core.create(1 << 20, name=shm_manager.new_name(), dir=d)
    seg.incref()
    shm_manager.register(seg.name, d)
    shm_manager.hold(seg.name, d)
    env = dict(os.environ, ARRAYMP_GROUP=shm_manager.group())
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), seg.name, d], stdout=subprocess.PIPE,
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
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER.replace("seg.incref()\n", "")), seg.name, d],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "held"
        kill(p.pid)
        p.wait(10)
        wait_until(lambda: not os.path.exists(seg.path), 5, "the daemon to unlink the segment nobody holds")
    finally:
        kill(p.pid)
        seg.close()
