"""Fixtures for the real-process tests: actors, kills by pid, waits, figures."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES: list[str] = []


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until(pred, timeout: float, what: str) -> float:
    """Seconds until ``pred()`` holds; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def segments_of(d: str, groups) -> list[str]:
    groups = set(groups)
    return sorted(n for n in os.listdir(d) if n.startswith("arraymp_") and n.split("_")[2] in groups)


def figure(text: str) -> None:
    FIGURES.append(text)


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("shm-manager figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


class Actor:
    """A scripted arraymp process (tests/_actor.py) driven over stdin/stdout."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", os.path.join(HERE, "_actor.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=HERE)
        self.pid = self.proc.pid
        self._buf = b""

    def call(self, op: str, timeout: float = 60, **kw) -> dict:
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"actor {self.pid}: no answer to {op}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError(f"actor {self.pid} exited (rc {self.proc.poll()}) during {op}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"actor {self.pid} failed {op}:\n{reply['error']}")
        return reply

    def stop(self) -> None:
        kill(self.pid)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _actor_env(monkeypatch, shm_dir) -> dict:
    """The environment of actors: segments in ``shm_dir`` (None: the real /dev/shm), no inherited group."""
    if shm_dir is None:
        monkeypatch.delenv("ARRAYMP_SHM_DIR", raising=False)
    else:
        monkeypatch.setenv("ARRAYMP_SHM_DIR", str(shm_dir))
    monkeypatch.delenv("ARRAYMP_GROUP", raising=False)
    monkeypatch.delenv("ARRAYMP_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("ARRAYMP_MANAGER_LINGER", "0.5")
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private segment directory ($ARRAYMP_SHM_DIR) and no inherited group."""
    d = tmp_path / "shm"
    d.mkdir()
    return _actor_env(monkeypatch, d)


@pytest.fixture
def real_env(monkeypatch):
    """The real /dev/shm."""
    return _actor_env(monkeypatch, None)


@pytest.fixture
def actors():
    made: list[Actor] = []
    extra_pids: list[int] = []

    def start(env: dict) -> Actor:
        a = Actor(env)
        made.append(a)
        return a

    start.extra_pids = extra_pids
    yield start
    for a in made:
        a.stop()
    kill(*extra_pids)


@pytest.fixture
def shm_manager_cli():
    exe = shutil.which("shm-manager", path=os.path.dirname(sys.executable))

    def run(*args, env=None, check_rc=None):
        cmd = [exe] if exe else [sys.executable, "-m", "shm_manager"]
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=60)
        if check_rc is not None:
            assert r.returncode == check_rc, (r.returncode, r.stdout, r.stderr)
        return r

    return run


def exit_actor(a: Actor, timeout: float = 30) -> None:
    """Ask an actor to exit normally and wait for it."""
    a.proc.stdin.write(b'{"op": "exit"}\n')
    a.proc.stdin.flush()
    assert a.proc.wait(timeout) == 0
