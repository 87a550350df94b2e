"""Issue 35, scenario 6: the raised open-files limit is arraymp's alone (mp_reductions _nofile Note [open-files
limit]). As a normal user (soft 1024 under a larger hard limit): importing arraymp changes nothing; a process whose
shared arrays need more descriptors raises its own soft limit, and every program it execs (subprocess, os.system,
os.exec*, os.posix_spawn, a spawn child) still gets 1024; a limit the user set (lowered before import, or changed
with resource.setrlimit after) is kept."""

import resource
import subprocess
import sys

import pytest

PROBE = """
import multiprocessing, os, resource, subprocess, sys
import numpy as np
import arraymp as mp

def soft():
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

def child_soft():
    return int(subprocess.run(["sh", "-c", "ulimit -Sn"], capture_output=True, text=True).stdout)

def spawned(q):
    q.put(soft())

def main():
    seen = {"import": (soft(), child_soft())}
    if sys.argv[1] == "setrlimit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (2000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = [mp.empty_shared(1 << 15) for _ in range(600)]  # past a quarter of 1024 descriptors
    seen["held"] = (soft(), child_soft())
    r, w = os.pipe()
    pid = os.posix_spawn("/bin/sh", ["sh", "-c", "ulimit -Sn"], os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)])
    os.waitpid(pid, 0)
    os.close(w)
    seen["posix_spawn"] = int(os.read(r, 64))
    seen["system"] = os.system("exit $(( $(ulimit -Sn) / 1024 ))") >> 8  # 1 for 1024
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=spawned, args=(q,))
    p.start()
    seen["spawn"] = q.get(timeout=60)
    p.join()
    assert all(a.shape == (1 << 15,) for a in held)
    print(repr(seen), flush=True)
    os.execv("/bin/sh", ["sh", "-c", "echo exec $(ulimit -Sn)"])


if __name__ == "__main__":
    main()
"""


def run(tmp_path, case, soft):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the hard open-files limit here is {hard}: too low to see a raise")
    script = tmp_path / "probe.py"  # a file: the spawn child imports its __main__
    script.write_text(PROBE)
    r = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    return eval(lines[0]), lines[1], hard


def test_a_normal_users_children_keep_1024_while_arraymp_raises_its_own(tmp_path):
    seen, exec_line, hard = run(tmp_path, "default", 1024)
    assert seen["import"] == (1024, 1024)  # importing changes nothing
    raised, child = seen["held"]
    assert raised > 1024 and child == 1024
    assert seen["posix_spawn"] == 1024 and seen["system"] == 1 and seen["spawn"] == 1024
    assert exec_line == "exec 1024"


@pytest.mark.parametrize("soft", [256, 512])
def test_a_limit_lowered_before_import_is_kept(tmp_path, soft):
    seen, exec_line, _ = run(tmp_path, "default", soft)
    assert seen["import"] == seen["held"] == (soft, soft)
    assert seen["posix_spawn"] == seen["spawn"] == soft and exec_line == f"exec {soft}"


def test_a_limit_set_after_import_is_kept(tmp_path):
    seen, exec_line, _ = run(tmp_path, "setrlimit", 1024)
    assert seen["held"] == (2000, 2000) and seen["spawn"] == 2000 and exec_line == "exec 2000"
