"""`shm-manager` (and `python -m shm_manager`): list, gc, stats, help, exit codes."""

import json
import os
import resource
import subprocess
import sys

import shm_core
from conftest import kill, pid_alive, segments_of, wait_until


def _dead_and_live(env, actors):
    """A live group (helper holding its lock) and a dead one whose daemon died with it."""
    live = actors(env)
    lg = live.call("group")["group"]
    live_names = live.call("create", n=2)["names"]
    dead = actors(env)
    dg = dead.call("group")["group"]
    dead_names = dead.call("create", n=2, size=10000)["names"]
    daemon = dead.call("daemon_pid")["pid"]
    kill(dead.pid, daemon)
    wait_until(lambda: not pid_alive(dead.pid) and not pid_alive(daemon), 5, "the dead group to die")
    return live, lg, live_names, dg, dead_names


def _foreign(d):
    out = []
    for uid_in_name in (65534, os.getuid()) if os.geteuid() == 0 else ():  # a normal user cannot plant them
        path = os.path.join(d, f"arraymp_{uid_in_name}_gother_1_{os.urandom(8).hex()}")
        with open(path, "wb") as f:
            f.write(b"ARRAYMP\0" + bytes(56))
        os.chown(path, 65534, 65534)
        out.append(path)
    # a dead-looking lock for the foreign group, to tempt gc
    rdir = os.path.join(d, f".arraymp-{os.getuid()}")
    open(os.path.join(rdir, "gother.lock"), "w").close()
    return out


def test_help_explains_the_safe_way_to_clean_up(shm_manager_cli):
    r = shm_manager_cli("--help", check_rc=0)
    assert "safe way to clean up" in r.stdout and "provably dead" in r.stdout
    r = shm_manager_cli("gc", "--help", check_rc=0)
    assert "--dry-run" in r.stdout and "safe way" in r.stdout
    r = subprocess.run([sys.executable, "-m", "shm_manager", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "list" in r.stdout


def test_exit_codes(shm_manager_cli, env):
    assert shm_manager_cli(env=env).returncode == 2  # no command
    assert shm_manager_cli("frobnicate", env=env).returncode == 2
    assert shm_manager_cli("gc", "--bogus", env=env).returncode == 2
    r = shm_manager_cli("--dir", "/nonexistent/arraymp", "list", env=env)
    assert r.returncode == 1 and "error" in r.stderr
    assert shm_manager_cli("list", env=env).returncode == 0
    assert shm_manager_cli("gc", env=env).returncode == 0


def test_list_stats_gc_never_touch_live_groups_or_other_users(env, actors, shm_manager_cli):
    d = env["ARRAYMP_SHM_DIR"]
    live, lg, live_names, dg, dead_names = _dead_and_live(env, actors)
    foreign = _foreign(d)
    try:
        segs = json.loads(shm_manager_cli("list", "--json", env=env, check_rc=0).stdout)
        by_name = {s["name"]: s for s in segs}
        assert set(by_name) == set(live_names + dead_names)  # foreign files are not ours
        for n in live_names:
            assert by_name[n]["state"] == "alive" and by_name[n]["pid"] == live.pid
            assert by_name[n]["refcount"] == 1 and by_name[n]["size"] == 4096
        for n in dead_names:
            s = by_name[n]
            assert s["state"] == "dead" and s["group"] == dg and s["bytes"] == 10000 + shm_core.HEADER_SIZE
            assert s["creator_pid"] == s["pid"] and s["age"] >= 0
        human = shm_manager_cli("list", env=env, check_rc=0).stdout
        assert "shm-manager gc" in human and dead_names[0] in human

        st = json.loads(shm_manager_cli("stats", "--json", env=env, check_rc=0).stdout)
        assert st["our_segments"] == 4 and st["groups_alive"] == 1 and st["groups_dead"] == 1
        assert st["reclaimable_bytes"] == 2 * (10000 + shm_core.HEADER_SIZE)
        assert st["ulimit_nofile_soft"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert st["size"] >= st["used"] and st["free"] > 0
        assert "ulimit -n" in shm_manager_cli("stats", env=env, check_rc=0).stdout

        dry = json.loads(shm_manager_cli("gc", "--dry-run", "--json", env=env, check_rc=0).stdout)
        assert sorted(r["name"] for r in dry["removed"]) == sorted(dead_names) and dry["dry_run"]
        assert segments_of(d, [dg]) == sorted(dead_names)  # dry run removes nothing
        out = shm_manager_cli("gc", "--dry-run", env=env, check_rc=0).stdout
        assert "would remove" in out and "dry run" in out

        out = shm_manager_cli("gc", env=env, check_rc=0).stdout
        assert f"removed {dead_names[0]}" in out and f"freed {2 * (10000 + 64):,} bytes" in out
        assert segments_of(d, [dg]) == []
        assert segments_of(d, [lg]) == sorted(live_names)
        assert all(os.path.exists(f) for f in foreign)
        assert not os.path.exists(os.path.join(d, f".arraymp-{os.getuid()}", dg + ".lock"))
        assert "removed 0 segment(s)" in shm_manager_cli("gc", env=env, check_rc=0).stdout
        live.call("work")  # the live group did not notice
    finally:
        for f in foreign:
            os.unlink(f)


def test_unknown_group_left_alone_unless_orphans(env, shm_manager_cli):
    d = env["ARRAYMP_SHM_DIR"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # made without shm-manager: group = pid, no lock file
    name = f"arraymp_{os.getuid()}_{gone.pid}_{gone.pid}_{os.urandom(8).hex()}"
    shm_core.create(100, name=name, dir=d).close()
    segs = json.loads(shm_manager_cli("list", "--json", env=env, check_rc=0).stdout)
    assert [s["state"] for s in segs] == ["unknown"]
    shm_manager_cli("gc", env=env, check_rc=0)
    assert os.path.exists(os.path.join(d, name))
    out = shm_manager_cli("gc", "--orphans", env=env, check_rc=0).stdout
    assert f"removed {name}" in out and not os.path.exists(os.path.join(d, name))
