"""The crash matrix of issue 4: real processes, real SIGKILL by pid, the real daemon.

"clean" = no segment of the test's group is left. Each test notes the time to
clean in the "shm-manager figures" section of the pytest summary.
"""

import os
import subprocess
import sys
import time

import pytest
import shm_manager
from conftest import exit_actor, figure, kill, pid_alive, segments_of, wait_until


def _lock_file(d: str, group: str) -> str:
    return os.path.join(d, f".arraymp-{os.getuid()}", group + ".lock")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_crash1_sigkill_child_parent_keeps_working_then_clean(env, actors, method):
    d = env["ARRAYMP_SHM_DIR"]
    p = actors(env)
    g = p.call("group")["group"]
    child = p.call("spawn", method=method, k=1, n=2, size=8192)["children"][0]
    assert child["group"] == g
    p.call("attach", names=child["names"])
    kill(child["pid"])
    wait_until(lambda: not pid_alive(child["pid"]), 5, "the child to die")

    p.call("work")  # the parent keeps using the killed child's segments
    own = p.call("create", n=2)["names"]
    p.call("work")
    assert p.call("drop", names=own)["unlinked"] == own  # refcount at zero: unlinked at once
    assert segments_of(d, [g]) == sorted(child["names"])  # the child's count leaked with it
    assert p.call("drop", names=child["names"])["unlinked"] == []
    t0 = time.monotonic()
    exit_actor(p)  # the parent drops everything and ends: the group is over
    t = wait_until(lambda: not segments_of(d, [g]), 2, "the daemon to remove the killed child's segments")
    figure(f"crash 1 ({method}): clean {t + (time.monotonic() - t0 - t):.2f} s after the parent ended, "
           f"left {len(segments_of(d, [g]))}")
    wait_until(lambda: not os.path.exists(_lock_file(d, g)), 2, "the dead group's lock file to go")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_crash2_sigkill_main_with_children_alive(env, actors, method):
    d = env["ARRAYMP_SHM_DIR"]
    p = actors(env)
    g = p.call("group")["group"]
    own = p.call("create", n=2)["names"]
    children = p.call("spawn", method=method, k=2, n=2, pdeathsig=True)["children"]
    assert {c["group"] for c in children} == {g}
    daemon = p.call("daemon_pid")["pid"]
    names = own + [n for c in children for n in c["names"]]
    assert segments_of(d, [g]) == sorted(names)

    t0 = time.monotonic()
    kill(p.pid)  # children end by PR_SET_PDEATHSIG; the daemon kills nobody
    wait_until(lambda: not any(pid_alive(c["pid"]) for c in children), 2, "the children to exit")
    wait_until(lambda: not segments_of(d, [g]), 2, "clean after the main process was killed")
    t = time.monotonic() - t0
    figure(f"crash 2 ({method}): {len(names)} segments clean {t:.2f} s after SIGKILL of main, left 0")
    assert t < 2.0
    wait_until(lambda: not pid_alive(daemon), 2, "the daemon to exit")
    log = open(os.path.join(d, f".arraymp-{os.getuid()}", "manager.log")).read()
    assert all(n in log for n in names)


def test_crash3_sigkill_whole_group_at_once_real_dev_shm(real_env, actors):
    d = "/dev/shm"
    p = actors(real_env)
    g = p.call("group")["group"]
    own = p.call("create", n=3, size=1 << 16)["names"]
    children = p.call("spawn", method="fork", k=2, n=2, pdeathsig=False)["children"]
    daemon = p.call("daemon_pid")["pid"]
    names = own + [n for c in children for n in c["names"]]
    assert segments_of(d, [g]) == sorted(names)

    t0 = time.monotonic()
    kill(p.pid, *(c["pid"] for c in children))
    wait_until(lambda: not segments_of(d, [g]), 2, "clean after SIGKILL of the whole group")
    t = time.monotonic() - t0
    figure(f"crash 3 (real /dev/shm): {len(names)} segments clean {t:.2f} s after SIGKILL of all, left 0")
    wait_until(lambda: not pid_alive(daemon), 2, "the daemon to exit")


def _group_whose_daemon_was_killed(env, actors, n: int):
    """An actor in a new group holding ``n`` segments, its daemon SIGKILLed: (actor, group, names, daemon pid)."""
    p = actors(env)
    g = p.call("group")["group"]
    names = p.call("create", n=n)["names"]
    d1 = p.call("daemon_pid")["pid"]
    kill(d1)
    wait_until(lambda: not pid_alive(d1), 5, "the daemon to die")
    return p, g, names, d1


def test_crash4_sigkill_daemon_alone_group_keeps_working(env, actors):
    d = env["ARRAYMP_SHM_DIR"]
    p, g, first, d1 = _group_whose_daemon_was_killed(env, actors, 3)

    # no errors: unregister/register reconnect and start a new daemon lazily
    assert p.call("drop", names=first[:1])["unlinked"] == first[:1]  # refcount cleanup still works
    more = p.call("create", n=2)["names"]
    p.call("work")
    d2 = p.call("daemon_pid")["pid"]
    assert d2 != d1 and pid_alive(d2)
    assert segments_of(d, [g]) == sorted(first[1:] + more)

    t0 = time.monotonic()
    kill(p.pid)
    wait_until(lambda: not segments_of(d, [g]), 2, "the new daemon to clean up")
    figure(f"crash 4: daemon killed, group kept working; new daemon cleaned 4 segments "
           f"{time.monotonic() - t0:.2f} s after the group was killed, left 0")


def test_crash4_sigkill_daemon_then_group_gc_cleans(env, actors):
    d = env["ARRAYMP_SHM_DIR"]
    p, g, names, _ = _group_whose_daemon_was_killed(env, actors, 2)
    p.call("work")
    kill(p.pid)
    p.proc.wait(5)
    time.sleep(0.7)  # nobody is left to clean: the segments stay ...
    assert segments_of(d, [g]) == sorted(names)
    t0 = time.monotonic()
    removed = shm_manager.gc(dir=d)  # ... until gc proves the group dead
    t = time.monotonic() - t0
    assert sorted(n for n, _ in removed) == sorted(names)
    assert segments_of(d, [g]) == []
    assert not os.path.exists(_lock_file(d, g))
    figure(f"crash 4 + gc: gc removed {len(names)} segments in {t * 1000:.1f} ms, left 0")


def _foreign_files(d: str) -> list[str]:
    """Segment-named files of another user (uid 65534), one even named with our uid (as root only: a normal user
    cannot give a file away)."""
    paths = []
    for uid_in_name in (65534, os.getuid()) if os.geteuid() == 0 else ():
        name = f"arraymp_{uid_in_name}_gforeign{os.getpid()}_1_{os.urandom(8).hex()}"
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(b"ARRAYMP\0" + bytes(56))
        os.chown(path, 65534, 65534)
        paths.append(path)
    return paths


def _crash5_setup(env, actors, d):
    victim = actors(env)
    g = victim.call("group")["group"]
    names = victim.call("create", n=2)["names"]
    child = victim.call("spawn", method="fork", k=1, n=2, pdeathsig=False)["children"][0]
    names += child["names"]
    daemon = victim.call("daemon_pid")["pid"]
    live = actors(env)
    lg = live.call("group")["group"]
    live_names = live.call("create", n=2)["names"]
    foreign = _foreign_files(d)
    kill(victim.pid, child["pid"], daemon)  # everything of the group, daemon included, at once
    for pid in (victim.pid, child["pid"], daemon):
        wait_until(lambda pid=pid: not pid_alive(pid), 5, f"pid {pid} to die")
    assert segments_of(d, [g]) == sorted(names)
    return g, names, live, lg, live_names, foreign


def test_crash5_sigkill_daemon_and_group_next_program_sweeps_real_dev_shm(real_env, actors):
    d = "/dev/shm"
    g, names, live, lg, live_names, foreign = _crash5_setup(real_env, actors, d)
    try:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import shm_manager; shm_manager.group()"], env=real_env,
                       check=True, timeout=30)
        t = time.monotonic() - t0
        assert segments_of(d, [g]) == []
        assert t < 1.0, t
        figure(f"crash 5: next program (interpreter start included) removed {len(names)} stale segments "
               f"in {t:.2f} s, left 0; live group and foreign files untouched")
        assert segments_of(d, [lg]) == sorted(live_names)  # a live group is never touched
        assert all(os.path.exists(f) for f in foreign)  # nor another user's files
        live.call("work")
    finally:
        for f in foreign:
            os.unlink(f)
    exit_actor(live)
    wait_until(lambda: not segments_of(d, [lg]), 2, "the live group's daemon to clean after it")


def test_crash5_sigkill_daemon_and_group_cli_gc(env, actors, shm_manager_cli):
    d = env["ARRAYMP_SHM_DIR"]
    g, names, live, lg, live_names, foreign = _crash5_setup(env, actors, d)
    t0 = time.monotonic()
    r = shm_manager_cli("gc", env=env, check_rc=0)
    t = time.monotonic() - t0
    assert t < 1.0, t
    assert segments_of(d, [g]) == []
    for n in names:
        assert f"removed {n}" in r.stdout
    assert f"removed {len(names)} segment(s)" in r.stdout
    assert segments_of(d, [lg]) == sorted(live_names)
    assert all(os.path.exists(f) for f in foreign)
    figure(f"crash 5: `shm-manager gc` removed {len(names)} stale segments in {t:.2f} s (process start "
           "included), left 0")
    live.call("work")
