"""Start-method independent tests: public API, exception pickling, the watchdog, the group reaper."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

import mp_spawn
import pytest
from _spawn_suite import DEATH_DEADLINE_S, TESTS_DIR, WAIT_S, alive, proc_state, still_alive_after
from mp_spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    _deathsig,
)


def test_public_api():
    assert mp_spawn.__version__ == "0.1.0"
    for name in mp_spawn.__all__:
        assert hasattr(mp_spawn, name), name
    assert {"spawn", "start_processes", "ProcessContext", "SpawnContext"} <= set(mp_spawn.__all__)
    for cls in (ProcessException, ProcessRaisedException, ProcessExitedException):
        assert cls.__doc__.startswith("Raised when")
    assert issubclass(ProcessRaisedException, ProcessException)
    assert issubclass(ProcessExitedException, ProcessException)


@pytest.mark.parametrize(
    "error",
    [
        ProcessException("Oh no!", 1, 1234),
        ProcessRaisedException("Oh no!", 1, 1234),
        ProcessExitedException("Oh no!", 1, 1234, 12),
        ProcessExitedException("Oh no!", 0, 1234, -9, "SIGKILL"),
    ],
)
def test_errors_pickle_intact(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error) == "Oh no!"
    assert copy.args == error.args
    assert vars(copy) == vars(error)
    assert (copy.msg, copy.error_index, copy.error_pid, copy.pid) == ("Oh no!", error.error_index, 1234, 1234)
    if isinstance(error, ProcessExitedException):
        assert (copy.exit_code, copy.signal_name) == (error.exit_code, error.signal_name)


def test_spawn_context_is_deprecated():
    with pytest.warns(DeprecationWarning, match="ProcessContext"):
        ctx = SpawnContext([], [])
    assert isinstance(ctx, ProcessContext)
    assert ctx.join() is True


def test_zero_processes():
    ctx = mp_spawn.start_processes(print, nprocs=0, join=False)
    assert ctx.pids() == []
    assert ctx.join() is True


def test_stale_error_dirs_are_removed(tmp_path, monkeypatch):
    # A supervisor killed by SIGKILL cannot remove its directory; the next
    # start_processes of the same user does, and leaves live ones alone.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=WAIT_S)
    own_start = proc_state(os.getpid())[1]
    stale = tmp_path / f"mp_spawn-{dead.pid}-{own_start}-abc"
    recycled = tmp_path / f"mp_spawn-{os.getpid()}-{own_start + 1}-abc"
    live = tmp_path / f"mp_spawn-{os.getpid()}-{own_start}-abc"
    unrelated = tmp_path / "mp_spawn-notours"
    for path in (stale, recycled, live, unrelated):
        path.mkdir()
        (path / "0.fault").touch()
    ctx = mp_spawn.start_processes(print, nprocs=0, join=False)
    assert ctx.join() is True
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, unrelated.name])


def test_negative_nprocs():
    with pytest.raises(ValueError, match="nprocs"):
        mp_spawn.start_processes(print, nprocs=-1)


def test_unknown_start_method():
    with pytest.raises(ValueError):
        mp_spawn.start_processes(print, nprocs=1, start_method="teleport")


# --- the watchdog alone (no PR_SET_PDEATHSIG: the test process is the parent)


def _watchdog_child(parent_pid: int, parent_start: int | None) -> subprocess.Popen:
    code = f"import sys, _spawn_targets as t; t.watchdog_child({parent_pid}, {parent_start!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_watchdog_kills_child_when_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = None
    try:
        child = _watchdog_child(parent.pid, proc_state(parent.pid)[1])
        assert child.stdout.readline().strip() == "armed"
        assert alive(child.pid)
        parent.kill()
        parent.wait(timeout=WAIT_S)
        assert child.wait(timeout=DEATH_DEADLINE_S) == -signal.SIGKILL
    finally:
        parent.kill()
        parent.wait(timeout=WAIT_S)
        if child is not None:
            child.kill()
            child.wait(timeout=WAIT_S)


def test_watchdog_kills_child_whose_parent_is_already_gone():
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent_start = proc_state(parent.pid)[1] if proc_state(parent.pid) else None
    parent.wait(timeout=WAIT_S)
    child = _watchdog_child(parent.pid, parent_start)
    try:
        assert child.wait(timeout=WAIT_S) == -signal.SIGKILL
        assert child.stdout.read() == ""
    finally:
        child.kill()
        child.wait(timeout=WAIT_S)


def test_watchdog_recognises_a_recycled_pid():
    # Our own pid with a wrong start time stands for "the pid now names
    # someone else": the child must treat its parent as dead.
    own_start = proc_state(os.getpid())[1]
    child = _watchdog_child(os.getpid(), own_start + 1)
    try:
        assert child.wait(timeout=WAIT_S) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(timeout=WAIT_S)


def test_watchdog_kills_grandchildren_too():
    # The watchdog kills the child's descendants before the child itself.
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = (
        "import subprocess, sys, time, _spawn_targets as t\n"
        "from mp_spawn import _deathsig\n"
        f"_deathsig.start_watchdog({parent.pid}, {proc_state(parent.pid)[1]})\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(child.stdout.readline())
        started = {grandchild: proc_state(grandchild)[1]}
        parent.kill()
        parent.wait(timeout=WAIT_S)
        assert child.wait(timeout=DEATH_DEADLINE_S) == -signal.SIGKILL
        assert still_alive_after(started, DEATH_DEADLINE_S) == []
    finally:
        for proc in (parent, child):
            proc.kill()
            proc.wait(timeout=WAIT_S)
        if grandchild is not None and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# --- the group reaper alone


def test_group_reaper_ends_the_group_sigkill_for_those_that_ignore_sigterm():
    # A process that leads a session with a reaper exits normally; what it
    # started dies with it: SIGTERM first, SIGKILL for what ignores SIGTERM.
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    code = (
        "import os, subprocess, sys\n"
        "from mp_spawn import _deathsig\n"
        "_deathsig.start_group_reaper()\n"
        "(reaper,) = _deathsig.descendants(os.getpid())\n"
        f"g = subprocess.Popen([sys.executable, '-c', {stubborn!r}], stdout=subprocess.PIPE)\n"
        "g.stdout.readline()\n"  # SIGTERM is ignored from here on
        "print(reaper, g.pid, flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    started: dict[int, int] = {}
    try:
        pids = [int(pid) for pid in child.stdout.readline().split()]
        started = {pid: proc_state(pid)[1] for pid in pids}
        assert len(started) == 2
        assert child.wait(timeout=WAIT_S) == 0
        assert still_alive_after(started, _deathsig._GROUP_GRACE_S + DEATH_DEADLINE_S) == []
    finally:
        child.kill()
        child.wait(timeout=WAIT_S)
        for pid, start in started.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
