"""Issue 42, item 4: every program an arraymp process execs gets the open-files limit it had before arraymp raised
its own (_nofile Note [exec under the old limit]), also while it holds descriptors past that limit. As a normal user
(soft 1024 under a larger hard limit; the nonroot nox session runs it unprivileged): a process holding 1,500
shared arrays (descriptors past 1024) starts a C child that fills an ``fd_set`` up to its soft limit (it aborts
with "bit out of range" past 1024) by every exec path, and Python children read theirs; then again with 300."""

import resource
import shutil
import subprocess
import sys
import textwrap

import pytest

SOFT = 1024

FDSET_C = r"""
#include <stdio.h>
#include <sys/resource.h>
#include <sys/select.h>
int main(void) {
    struct rlimit r;
    fd_set s;
    getrlimit(RLIMIT_NOFILE, &r);
    FD_ZERO(&s);
    for (long fd = 0; fd < (long)r.rlim_cur; fd++)
        FD_SET(fd, &s);  /* _FORTIFY_SOURCE: aborts past FD_SETSIZE */
    printf("%ld\n", (long)r.rlim_cur);
    return 0;
}
"""

PROBE = textwrap.dedent("""
    import gc, multiprocessing, os, resource, subprocess, sys, tempfile, time
    import mp_reductions as mpr
    from mp_reductions import _nofile

    FDSET = sys.argv[1]

    def soft():
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def report(q):
        q.put(str(soft()))

    def written(start):
        # what a child started by start(path) wrote to path (its soft limit), or how it ended
        with tempfile.NamedTemporaryFile("r") as f:
            status = start(f.name)
            return f.read().strip() or f"ended with {status}"

    def waited(pid):
        return os.waitpid(pid, 0)[1]

    def forked(path, execute):
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(path, os.O_WRONLY)
                os.dup2(fd, 1)
                execute()
            finally:
                os._exit(127)
        return waited(pid)

    def to(path):
        return [(os.POSIX_SPAWN_OPEN, 1, path, os.O_WRONLY, 0)]

    def children():
        seen = {}
        for name, kw in [("subprocess", {}), ("subprocess close_fds=False", {"close_fds": False})]:
            r = subprocess.run([FDSET], capture_output=True, text=True, **kw)
            seen[name] = r.stdout.strip() or f"ended with {r.returncode}"
        r = subprocess.run(FDSET, shell=True, capture_output=True, text=True)
        seen["subprocess shell=True"] = r.stdout.strip() or f"ended with {r.returncode}"
        seen["os.system"] = written(lambda p: os.system(f"{FDSET} > {p}"))
        seen["os.posix_spawn"] = written(lambda p: waited(os.posix_spawn(FDSET, [FDSET], os.environ,
                                                                         file_actions=to(p))))
        seen["os.posix_spawnp"] = written(lambda p: waited(os.posix_spawnp(os.path.basename(FDSET), [FDSET],
                                                                           os.environ, file_actions=to(p))))
        seen["fork, os.execv"] = written(lambda p: forked(p, lambda: os.execv(FDSET, [FDSET])))
        seen["fork, os.execvpe"] = written(lambda p: forked(p, lambda: os.execvpe(os.path.basename(FDSET), [FDSET],
                                                                                 dict(os.environ))))
        seen["os.spawnv"] = written(lambda p: os.spawnv(os.P_WAIT, "/bin/sh", ["sh", "-c", f"{FDSET} > {p}"]))
        for method in ("spawn", "forkserver"):
            ctx = multiprocessing.get_context(method)
            q = ctx.SimpleQueue()
            p = ctx.Process(target=report, args=(q,))
            p.start()
            seen[f"multiprocessing {method}"] = q.get()
            p.join()
        return seen

    if __name__ == "__main__":
        os.environ["PATH"] = os.path.dirname(FDSET) + os.pathsep + os.environ["PATH"]
        mpr.init_reductions()
        held = [mpr.empty_shared(1 << 15) for _ in range(1500)]  # a segment and a descriptor each
        highest = max(map(int, os.listdir("/proc/self/fd")))
        print(repr(("held", soft(), highest, children())), flush=True)
        # a receive refused a descriptor right after a child's start (the limit was lowered for it) tries again;
        # later, at the hard limit already, it gives up
        subprocess.run(["true"])
        again = _nofile.raise_for_budget()
        time.sleep(1.5)
        print(repr(("retry", again, _nofile.raise_for_budget())), flush=True)
        del held[300:]
        gc.collect()
        print(repr(("after", soft(), None, children())), flush=True)
        os.execv(FDSET, [FDSET])  # this process itself
""")


@pytest.fixture
def fdset(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the FD_SET child")
    src, exe = tmp_path / "fdset.c", tmp_path / "fdset"
    src.write_text(FDSET_C)
    subprocess.run([gcc, "-O2", "-D_FORTIFY_SOURCE=2", "-o", str(exe), str(src)], check=True, capture_output=True)
    return str(exe)


def test_every_exec_path_gives_the_old_limit_while_descriptors_past_it_are_open(tmp_path, fdset):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the hard open-files limit here is {hard}: too low to hold descriptors past {SOFT}")
    script = tmp_path / "probe.py"  # a file: spawn and forkserver children import its __main__
    script.write_text(PROBE)
    r = subprocess.run([sys.executable, str(script), fdset], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard)))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    held, retry, after, exec_line = r.stdout.splitlines()
    assert eval(retry) == ("retry", True, False)
    for when, own, highest, seen in map(eval, (held, after)):
        assert own > SOFT, f"{when}: the limit was never raised ({own}): nothing was tested"
        if highest is not None:
            assert highest > SOFT, f"the probe held no descriptor past {SOFT} (highest {highest})"
        wrong = {path: got for path, got in seen.items() if got != str(SOFT)}
        assert not wrong, f"{when} ({own} soft here): children started with another limit, or aborted: {wrong}"
    assert exec_line == str(SOFT), r.stderr[-3000:]
