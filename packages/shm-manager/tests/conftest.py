"""Fixtures for the real-process tests: actors, kills by pid, waits, figures."""

from __future__ import annotations

import json
import os
import pickle
import pwd
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings

import pytest

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))

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
def shared_env(monkeypatch):
    """A private segment directory in /dev/shm that every user may write into, as /dev/shm (1777, sticky)."""
    d = tempfile.mkdtemp(prefix="arraymp-test-", dir="/dev/shm")
    os.chmod(d, 0o1777)
    try:
        yield _actor_env(monkeypatch, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


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


@pytest.fixture
def other_user():
    """``(uid, gid)`` of a second local user, made for the test and removed after it (needs root)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second local user")
    name = f"arraymp_t{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True, timeout=60)
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:  # userdel refuses while a process of the user runs (a daemon may still be on its way out)
        deadline = time.monotonic() + 30
        while subprocess.run(["userdel", name], capture_output=True, timeout=60).returncode != 0:
            if time.monotonic() > deadline:
                pytest.fail(f"cannot remove the test user {name}: a process of it still runs")
            time.sleep(0.1)


def as_user(user, fn, *args, keep: bool = False):
    """``fn(*args)`` in a forked child running as ``user``: its result, and with ``keep`` also the child's pid
    (the child then stays, e.g. holding what ``fn`` made, until the test kills it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            out = ("ok", fn(*args))
        except BaseException:
            out = ("error", traceback.format_exc())
        data = pickle.dumps(out)
        os.write(w, len(data).to_bytes(8, "little") + data)
        os.close(w)
        while keep:
            signal.pause()
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:  # a length first: what fn started may keep the pipe open
        status, value = pickle.loads(f.read(int.from_bytes(f.read(8), "little")))
    if not keep:
        os.waitpid(pid, 0)
    if status != "ok":
        kill(pid)
        raise AssertionError(f"as uid {user[0]}: {value}")
    return (value, pid) if keep else value


HOLDER = textwrap.dedent("""
    import sys, time, shm_core, shm_manager
    name, d = sys.argv[1], sys.argv[2]
    seg = shm_core.attach(name, d)
    seg.incref()
    shm_manager.hold(name, d)
    shm_manager.flush()
    print("held", flush=True)
    time.sleep(600)
""")


def killed_holder_is_released(env: dict, p: Actor) -> float:
    """The actor ``p`` makes a segment, a second process of its group holds it, ``p`` lets go; the holder is
    SIGKILLed: seconds until the segment is gone (the daemon gave the count back); fails after 2 s."""
    d = env["ARRAYMP_SHM_DIR"]
    g = p.call("group")["group"]
    (name,) = p.call("create", n=1)["names"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name, d], stdout=subprocess.PIPE, text=True,
                              env=dict(env, ARRAYMP_GROUP=g))
    try:
        assert holder.stdout.readline().strip() == "held"
        assert p.call("drop", names=[name])["unlinked"] == []  # the holder's count keeps it
        assert os.path.exists(os.path.join(d, name))
        kill(holder.pid)
        holder.wait(10)
        return wait_until(lambda: not os.path.exists(os.path.join(d, name)), 2,
                          "the daemon to give back the killed holder's count")
    finally:
        kill(holder.pid)
        holder.wait(10)
        holder.stdout.close()
