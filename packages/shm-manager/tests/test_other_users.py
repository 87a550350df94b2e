"""Issue 13: another local user, or a confused peer, can neither stop the cleanup nor point it elsewhere.

The multi-user tests make a second user (root only; they skip without it), act as that user in a forked child,
and then check what a user of arraymp would: it imports, it works, a SIGKILLed holder's segment is released
within 2 s, and the daemon's log stays small.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import sys
import time

import pytest
import shm_core
import shm_manager
from conftest import (
    as_user,
    exit_actor,
    figure,
    kill,
    killed_holder_is_released,
    pid_alive,
    segments_of,
    wait_until,
)
from shm_manager import _daemon, _paths


def _py(code: str, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r


def _squat_runtime_dir(path: str, kind: str) -> None:
    if kind == "dir":
        os.mkdir(path)
        os.chmod(path, 0o777)
    else:  # a symlink to a directory of the squatter's that anybody may write into
        target = path + "-target"
        os.mkdir(target)
        os.chmod(target, 0o777)
        os.symlink(target, path)


@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_a_squatted_runtime_dir_stops_nothing(shared_env, other_user, actors, shm_manager_cli, kind):
    d = shared_env["ARRAYMP_SHM_DIR"]
    default = os.path.join(d, f".arraymp-{os.getuid()}")
    as_user(other_user, _squat_runtime_dir, default, kind)

    r = _py("import shm_manager; shm_manager.group(); shm_manager.new_name(); print(shm_manager.runtime_dir())",
            shared_env)
    fallback = r.stdout.strip()
    assert os.path.dirname(fallback) == d and fallback != default
    assert r.stderr.count("RuntimeWarning") == 1 and default in r.stderr and fallback in r.stderr
    st = os.lstat(fallback)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    shm_manager_cli("gc", env=shared_env, check_rc=0)
    shm_manager_cli("list", env=shared_env, check_rc=0)

    p = actors(shared_env)
    took = killed_holder_is_released(shared_env, p)
    figure(f"squatted runtime dir ({kind}): a killed holder's segment released {took:.3f} s after its death")
    exit_actor(p)

    # another program of the user finds the same fallback, and sweeps a dead group's segments there
    p = actors(shared_env)
    g = p.call("group")["group"]
    names = p.call("create", n=2)["names"]
    daemon = p.call("daemon_pid")["pid"]
    kill(p.pid, daemon)
    wait_until(lambda: not pid_alive(p.pid) and not pid_alive(daemon), 5, "the group and its daemon to die")
    assert os.path.exists(os.path.join(fallback, g + ".lock"))
    out = shm_manager_cli("gc", env=shared_env, check_rc=0).stdout
    assert all(f"removed {n}" in out for n in names) and segments_of(d, [g]) == []

    assert os.lstat(default).st_uid == other_user[0]  # the squatter's path is left as it was, and unused
    if kind == "symlink":
        assert os.listdir(default + "-target") == []
    else:
        assert os.listdir(default) == []


_KEPT: list = []


def _squat_address(d: str, uid: int, group: str) -> dict:
    """Bind every address the daemon of ``uid``'s ``group`` might use, and keep them; what happened to each."""
    out = {}
    for addr in (f"\0arraymp-manager.{uid}.{group}", os.path.join(d, f".arraymp-{uid}", group + ".sock")):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(addr)
            s.listen(8)
            _KEPT.append(s)
            out[addr] = "bound"
        except OSError as exc:
            out[addr] = errno.errorcode[exc.errno]
    return out


def test_a_squatted_daemon_address_stops_no_cleanup(shared_env, other_user, actors):
    d = shared_env["ARRAYMP_SHM_DIR"]
    p = actors(shared_env)
    g = p.call("group")["group"]
    outcome, squatter = as_user(other_user, _squat_address, d, os.getuid(), g, keep=True)
    try:
        assert outcome[os.path.join(d, f".arraymp-{os.getuid()}", g + ".sock")] != "bound", outcome
        took = killed_holder_is_released(shared_env, p)
        daemon = p.call("daemon_pid")["pid"]
        assert daemon is not None and os.stat(f"/proc/{daemon}").st_uid == os.getuid()
        figure(f"squatted daemon address {outcome}: a killed holder's segment released {took:.3f} s after its death")
    finally:
        kill(squatter)
        os.waitpid(squatter, 0)
    exit_actor(p)
    assert segments_of(d, [g]) == []


def _flood(addrs: list[str], n: int) -> dict:
    outcomes: dict[str, int] = {}
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(addrs[i % len(addrs)])
            what = "connected"
        except OSError as exc:
            what = errno.errorcode[exc.errno]
        finally:
            s.close()
        outcomes[what] = outcomes.get(what, 0) + 1
    return outcomes


def test_another_users_flood_leaves_the_log_small(shared_env, other_user, actors):
    d = shared_env["ARRAYMP_SHM_DIR"]
    p = actors(shared_env)
    g = p.call("group")["group"]
    p.call("create", n=1)
    assert p.call("daemon_pid")["pid"] is not None
    rdir = os.path.join(d, f".arraymp-{os.getuid()}")
    log = os.path.join(rdir, _paths.LOG_NAME)
    before = os.path.getsize(log) if os.path.exists(log) else 0

    outcomes = as_user(other_user, _flood, [f"\0arraymp-manager.0.{g}", os.path.join(rdir, g + ".sock")], 20_000)
    after = os.path.getsize(log) if os.path.exists(log) else 0
    figure(f"flood of 20,000 connections by another user: {outcomes}; log {before} -> {after} bytes")
    assert after - before < 1024 and after <= _paths.LOG_CAP
    assert "connected" not in outcomes, outcomes

    took = killed_holder_is_released(shared_env, p)
    figure(f"after the flood: a killed holder's segment released {took:.3f} s after its death")
    exit_actor(p)
    assert segments_of(d, [g]) == []


def _group_with_daemon(d: str) -> tuple[str, str, int]:
    """As another user: join a new group in ``d`` (holding its lock) and start its daemon in this process tree."""
    os.environ["ARRAYMP_SHM_DIR"] = d
    token, rdir, shm = shm_manager._group.member()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            # as the real start (a fresh interpreter, close_fds): no group, no lock of ours in the daemon
            shm_manager._group._state = shm_manager._group._State()
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            rc = _daemon.main(["--group", token, "--runtime-dir", rdir, "--dir", shm])
        finally:
            os._exit(rc)
    os.waitpid(pid, 0)  # returns once the daemon listens
    return token, rdir, os.getuid()


def test_refusals_are_logged_at_most_once_per_interval(shared_env, other_user):
    d = shared_env["ARRAYMP_SHM_DIR"]
    (g, rdir, uid), keeper = as_user(other_user, _group_with_daemon, d, keep=True)
    sock = os.path.join(rdir, g + ".sock")
    try:
        t0 = time.monotonic()
        for _ in range(20_000):  # root: it reaches the socket, and the daemon refuses it
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.setblocking(False)
                while s.connect_ex(sock) == errno.EAGAIN:  # the backlog is full: the daemon is behind
                    assert time.monotonic() - t0 < 300, "the daemon stopped accepting"
                    time.sleep(0.001)
                _pid, peer_uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                assert peer_uid == uid
        took = time.monotonic() - t0
    finally:
        kill(keeper)
        os.waitpid(keeper, 0)
    wait_until(lambda: not os.path.exists(sock), 10, "the daemon to end with its group")
    with open(os.path.join(rdir, _paths.LOG_NAME)) as f:
        lines = [line for line in f if "refused" in line]
    counted = sum(int(line.split("refused ")[1].split()[0]) for line in lines)
    figure(f"20,000 refused connections in {took:.1f} s: {len(lines)} log line(s), {counted:,} counted")
    assert 1 <= len(lines) <= 2 + took / _daemon._REFUSAL_INTERVAL
    assert counted <= 20_000 and counted >= 20_000 - 200  # what the backlog held at the end may go uncounted


def test_the_log_is_capped(tmp_path):
    for i in range(3 * _paths.LOG_CAP // 100):
        _paths.log(str(tmp_path), "gtest", f"line {i} " + "x" * 80)
    size = os.path.getsize(tmp_path / _paths.LOG_NAME)
    assert 0 < size <= _paths.LOG_CAP
    _paths.log(str(tmp_path), "gtest", "y" * (4 * _paths.LOG_CAP))
    assert os.path.getsize(tmp_path / _paths.LOG_NAME) <= _paths.LOG_CAP


def _frame(op: bytes, name: bytes) -> bytes:
    return struct.pack("<I", 1 + len(name)) + op + name


def test_forged_frames_never_touch_a_file_outside_the_dir(env, actors, tmp_path):
    d = env["ARRAYMP_SHM_DIR"]
    p = actors(env)
    g = p.call("group")["group"]
    p.call("create", n=1)
    daemon = p.call("daemon_pid")["pid"]
    outside = tmp_path / "x"
    outside.mkdir()
    look = shm_core.segment_name("arraymp_", g)  # our uid, our group: only the place is wrong
    seg = shm_core.create(1000, name=look, dir=str(outside))
    seg.incref()
    seg.close()
    victim = outside / look
    before = victim.read_bytes(), os.stat(victim).st_mtime_ns
    link = shm_core.segment_name("arraymp_", g)
    os.symlink(victim, os.path.join(d, link))  # in the dir, named like a segment of the group, pointing out

    names = [os.path.relpath(victim, d), str(victim), f"/{look}", link, f"..\0{look}",
             f"{outside}\0{look}"]  # the last: a frame of the old format, with a dir
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(d, f".arraymp-{os.getuid()}", g + ".sock"))
    s.sendall(b"".join(_frame(op, os.fsencode(n)) for op in (b"R", b"H", b"H", b"X") for n in names))
    s.close()  # the daemon gives back this connection's "holds"
    exit_actor(p)  # the group ends: its daemon and the actor remove what is left of it
    wait_until(lambda: not pid_alive(daemon), 5, "the daemon to end with its group")
    assert (victim.read_bytes(), os.stat(victim).st_mtime_ns) == before
    assert os.path.islink(os.path.join(d, link))  # not ours to remove: a symlink is never a segment
    os.unlink(os.path.join(d, link))
    assert segments_of(d, [g]) == []
    shm_core.unlink(look, str(outside))
