"""Groups, locks, the client and the daemon's process hygiene."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from conftest import exit_actor, figure, kill, pid_alive, segments_of, wait_until


def _py(code: str, env: dict, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, **kw)
    assert r.returncode == 0, r.stderr
    return r


def test_group_token_env_name_and_lock(env):
    r = _py("""
import json, os, shm_core, shm_manager
g = shm_manager.group()
assert shm_manager.group() == g and shm_manager.current_group() == g
n = shm_manager.new_name()
prefix = shm_manager.new_name("other_")
lock = os.path.join(shm_manager.runtime_dir(), g + ".lock")
st = os.stat(shm_manager.runtime_dir())
print(json.dumps({"g": g, "env": os.environ["ARRAYMP_GROUP"], "parsed": shm_core.parse_name(n),
                  "other": prefix, "state": [s for s in [__import__("shm_manager._paths").
                  _paths.group_state([shm_manager.runtime_dir()], g)]][0], "mode": st.st_mode & 0o777,
                  "lock": os.path.exists(lock)}))
""", env)
    out = json.loads(r.stdout)
    assert "_" not in out["g"] and out["env"] == out["g"]
    assert out["parsed"][0] == os.getuid() and out["parsed"][1] == out["g"]
    assert out["other"].startswith("other_")
    assert out["state"] == "alive" and out["lock"] and out["mode"] == 0o700


def test_fork_child_keeps_group_alive_after_main_dies(env, actors, shm_manager_cli):
    d = env["ARRAYMP_SHM_DIR"]
    p = actors(env)
    g = p.call("group")["group"]
    names = p.call("create", n=1)["names"]
    child = p.call("spawn", method="fork", k=1, n=1, pdeathsig=False)["children"][0]
    kill(p.pid)
    p.proc.wait(5)
    time.sleep(0.8)  # past the linger: the child still holds the lock on its own description
    segs = json.loads(shm_manager_cli("list", "--json", env=env, check_rc=0).stdout)
    assert {s["state"] for s in segs} == {"alive"}
    shm_manager_cli("gc", env=env, check_rc=0)
    assert segments_of(d, [g]) == sorted(names + child["names"])
    kill(child["pid"])
    wait_until(lambda: not segments_of(d, [g]), 2, "clean once the last member died")


def test_join_group_validates_and_switches(env):
    _py("""
import os, shm_manager
try:
    shm_manager.join_group("bad_token")
except ValueError as e:
    assert "group token" in str(e)
else:
    raise AssertionError
g = shm_manager.group()
assert shm_manager.join_group("gabc123") == "gabc123" == shm_manager.group() == os.environ["ARRAYMP_GROUP"]
""", env)


def test_spawned_process_inherits_group_from_env(env):
    r = _py("""
import os, subprocess, sys, shm_manager
g = shm_manager.group()
out = subprocess.run([sys.executable, "-c", "import shm_manager; print(shm_manager.group())"],
                     capture_output=True, text=True).stdout.strip()
assert out == g, (out, g)
""", env)
    assert r.returncode == 0


def test_register_never_raises_without_daemon(env):
    _py("""
import sys, time, shm_core, shm_manager
sys.executable = "/nonexistent/python"  # the daemon cannot start
n = shm_manager.new_name()
seg = shm_core.create(10, name=n)
t = time.monotonic()
for _ in range(1000):
    shm_manager.register(n)
    shm_manager.unregister(n)
assert time.monotonic() - t < 10.0  # no wait for a daemon that cannot start (a hang check, loose for load)
assert shm_manager.daemon_pid() is None
seg.unlink()
""", env)


def test_daemon_detached_ignores_signals_and_refuses_other_uids(env, actors):
    p = actors(env)
    g = p.call("group")["group"]
    p.call("create", n=1)
    daemon = p.call("daemon_pid")["pid"]
    assert os.getsid(daemon) != os.getsid(p.pid) and os.getsid(daemon) == daemon
    ppid = int(open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()[1])
    assert ppid != p.pid
    assert len(os.listdir(f"/proc/{daemon}/fd")) <= 7  # stdio, listener, selector, segment dir, one client
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        os.kill(daemon, sig)
    time.sleep(0.2)
    assert pid_alive(daemon)

    sock = os.path.join(env["ARRAYMP_SHM_DIR"], f".arraymp-{os.getuid()}", g + ".sock")
    assert os.path.exists(sock)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user cannot even reach the socket (0700 runtime dir); see test_other_users for more
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(sock)
            os.write(w, b"open")
        except PermissionError:
            os.write(w, b"closed")
        except BaseException as exc:
            os.write(w, repr(exc).encode())
        os._exit(0)
    os.close(w)
    assert os.read(r, 100) == b"closed"
    os.close(r)
    os.waitpid(pid, 0)
    exit_actor(p)
    wait_until(lambda: not pid_alive(daemon), 2, "the daemon to exit after its group")


def test_registration_has_no_round_trip(env):
    r = _py("""
import time, shm_manager
names = [shm_manager.new_name() for _ in range(20000)]
shm_manager.register(names[0])  # starts the daemon
t = time.perf_counter()
for n in names:
    shm_manager.register(n)
for n in names:
    shm_manager.unregister(n)
print((time.perf_counter() - t) / (2 * len(names)) * 1e6)
assert shm_manager.flush(5)
""", env)
    figure(f"register/unregister (fire-and-forget, daemon running): {float(r.stdout):.2f} us per call")


@pytest.mark.parametrize("linger", ["0", "1.5"])
def test_linger_is_configurable(env, actors, linger):
    env = dict(env, ARRAYMP_MANAGER_LINGER=linger)
    d = env["ARRAYMP_SHM_DIR"]
    p = actors(env)
    g = p.call("group")["group"]
    p.call("create", n=1)
    kill(p.pid)
    t = wait_until(lambda: not segments_of(d, [g]), 4, "clean")
    assert (t >= 1.4) if linger == "1.5" else (t < 1.0)


def test_daemon_frames_from_client_are_small(env):
    from shm_manager import _client

    frame = _client._frame(b"R", "arraymp_0_gabc_1_" + "0" * 16)
    (n,) = struct.unpack_from("<I", frame)
    assert n == len(frame) - 4 < 64 and socket.AF_UNIX


def test_group_touches_no_file_until_the_first_named_segment(env):
    d = env["ARRAYMP_SHM_DIR"]
    _py("""
import os, shm_manager
d = os.environ["ARRAYMP_SHM_DIR"]
g = shm_manager.group()
shm_manager.join_group(g)
assert os.listdir(d) == [], os.listdir(d)  # import arraymp calls group(): it leaves nothing in the shm dir
name = shm_manager.new_name()
assert os.listdir(os.path.join(d, f".arraymp-{os.getuid()}")) == [g + ".lock"]
""", env)
    assert os.listdir(os.path.join(d, f".arraymp-{os.getuid()}")) == []  # the group ended: its lock went too


def test_a_bad_shm_dir_fails_at_the_first_named_segment_not_before(env):
    r = _py("""
import shm_manager
g = shm_manager.group()
shm_manager.register("arraymp_0_" + g + "_1_" + "0" * 16)  # never raises
try:
    shm_manager.new_name()
except FileNotFoundError as exc:
    print(exc)
else:
    raise AssertionError("no error")
""", dict(env, ARRAYMP_SHM_DIR="/nonexistent/shm"))
    assert "/nonexistent/shm" in r.stdout and "ARRAYMP_SHM_DIR" in r.stdout and "file_descriptor" in r.stdout


@pytest.mark.parametrize("who", ["main", "child"])
def test_a_group_whose_first_segment_failed_leaves_nothing(env, who):
    d = env["ARRAYMP_SHM_DIR"]
    _py(f"""
import multiprocessing, shm_core, shm_manager

def first_segment_fails():
    name = shm_manager.new_name()  # a member now: the group's lock file is made
    try:
        shm_core.create(-1, name=name)  # the first allocation fails (as on a full tmpfs)
    except ValueError:
        pass

if __name__ == "__main__":
    shm_manager.group()
    if {who!r} == "main":
        first_segment_fails()
    else:  # only a child (it leaves by os._exit) was ever a member
        p = multiprocessing.get_context("fork").Process(target=first_segment_fails)
        p.start()
        p.join()
        assert p.exitcode == 0
""", env)
    rdir = os.path.join(d, f".arraymp-{os.getuid()}")
    assert os.listdir(rdir) == [] and [n for n in os.listdir(d) if not n.startswith(".")] == []
