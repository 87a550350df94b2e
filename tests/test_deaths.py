"""Timeouts and deaths (issue 34) where the Pool is not the user's API: ``ProcessPoolExecutor(task_timeout=)`` fails
the call and goes on, a crash breaks the executor with a ``BrokenProcessPool`` that says how the worker died, and
``mp.spawn``'s ``ProcessExitedException`` says whether the kernel's OOM killer sent a SIGKILL (mp_spawn _errors
Note [OOM kills]), under every start method."""

import concurrent.futures
import ctypes
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import uuid

import _work
import pytest

import arraymp as mp

METHODS = ["spawn", "forkserver", "fork"]
TIMEOUT = 60


def echo(*args, **kwargs):  # run by the workers, found in this module
    return args, kwargs


def crash():
    ctypes.string_at(0)  # SIGSEGV


@pytest.mark.parametrize("method", METHODS)
def test_an_executor_call_past_its_limit_fails_alone(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method), task_timeout=1.0) as ex:
        stuck = ex.submit(_work.nap, 60)
        quick = [ex.submit(_work.double, i) for i in range(6)]
        with pytest.raises(mp.TaskTimeoutError, match=r"task 0 of submit \(nap\(60\)\) ran past its time limit of 1 s"):
            stuck.result(TIMEOUT)
        assert [f.result(TIMEOUT) for f in quick] == [0, 2, 4, 6, 8, 10]
        # a call's own limit; `timeout` stays the function's keyword, as with the stdlib's executor
        with pytest.raises(TimeoutError, match="time limit of 0.5 s"):
            ex.submit(_work.nap, 60, task_timeout=0.5).result(TIMEOUT)
        assert ex.submit(echo, 1, timeout=5).result(TIMEOUT) == ((1,), {"timeout": 5})
        assert ex.submit(_work.double, 21).result(TIMEOUT) == 42  # not broken
    with pytest.raises(ValueError, match="task_timeout must be a positive number of seconds"):
        mp.ProcessPoolExecutor(1, task_timeout=-1)


@pytest.mark.parametrize("method", METHODS)
def test_a_crash_breaks_the_executor_and_says_how(method):
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool) as info:
            ex.submit(crash).result(TIMEOUT)
    cause = info.value.__cause__
    assert isinstance(cause, mp.WorkerLostError) and cause.signal_name == "SIGSEGV"
    assert str(info.value) == ("A process in the process pool was terminated abruptly while the future was running or "
                               f"pending. The first: {cause.death()}")
    assert f"worker {cause.pid} died with signal SIGSEGV while running task 0 of submit (crash): a crash in native " \
           "code" in str(info.value)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("method", METHODS)
def test_spawn_says_which_sigkill_was_the_oom_killers(method, version, tmp_path):
    cgroup = _memory_cgroup(version, 300 << 20)
    script = tmp_path / "oom.py"  # a file: spawn and forkserver children import their functions from it
    script.write_text(textwrap.dedent(f"""
        import os, signal, time
        import arraymp as mp

        def hog(i):
            held = []
            while True:
                held.append(bytearray(8 << 20))
                time.sleep(0.01)

        def killed(i):
            os.kill(os.getpid(), signal.SIGKILL)

        if __name__ == "__main__":
            with open({os.path.join(cgroup, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))  # the children start in it too
            for fn in (hog, killed):
                try:
                    mp.spawn(fn, nprocs=1, start_method={method!r})
                except mp.ProcessExitedException as e:
                    print(repr(str(e)))
    """))
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT * 2)
    finally:
        _remove_cgroup(cgroup)
    assert run.returncode == 0, run.stderr
    oom, outside = (eval(line) for line in run.stdout.strip().splitlines()[-2:])
    assert oom == ("process 0 terminated with signal SIGKILL (killed by the kernel's OOM killer: the memory cgroup "
                   "counted an OOM kill while it ran; use fewer processes or less memory per process, or raise the "
                   "memory limit)")
    assert outside == ("process 0 terminated with signal SIGKILL (sent from outside, e.g. `kill -9` or a job "
                       "scheduler: the memory cgroup counted no OOM kill)")


def _memory_cgroup(version: str, limit: int) -> str:
    """A new child of this process's memory cgroup (``version``) limited to ``limit`` bytes, swap off; skips with
    the reason where the machine has none or it cannot be made. (mp-reductions' _deaths_suite has its twin: the
    packages are tested alone.)"""
    groups = [line.split(":", 2) for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines()]
    for fields in (line.split() for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()):
        fstype, point = fields[fields.index("-") + 1], fields[4]
        if version == "v1" and fstype == "cgroup" and "memory" in fields[-1].split(","):
            path = next(p for _, names, p in groups if "memory" in names.split(","))
            break
        if version == "v2" and fstype == "cgroup2":
            path = next(p for hid, names, p in groups if hid == "0" and not names)
            break
    else:
        pytest.skip(f"no cgroup {version} hierarchy with the memory controller is mounted here")
    parent = os.path.join(point, path.strip("/"))
    if version == "v2":
        try:
            if "memory" not in pathlib.Path(parent, "cgroup.controllers").read_text().split():
                pytest.skip("cgroup v2 is mounted here without the memory controller (it is on cgroup v1)")
            pathlib.Path(parent, "cgroup.subtree_control").write_text("+memory")
        except OSError as e:
            pytest.skip(f"cgroup v2: cannot enable the memory controller for a child of {parent}: {e}")
    cgroup = os.path.join(parent, f"arraymp-deaths-{uuid.uuid4().hex[:8]}")
    files = {"v1": [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)],
             "v2": [("memory.max", limit), ("memory.swap.max", 0)]}[version]
    try:
        os.mkdir(cgroup)
        for name, value in files:
            if name == files[0][0] or os.path.exists(os.path.join(cgroup, name)):
                pathlib.Path(cgroup, name).write_text(str(value))
    except OSError as e:
        _remove_cgroup(cgroup)
        pytest.skip(f"cannot make a memory cgroup ({version}) here: {e}")
    return cgroup


def _remove_cgroup(cgroup: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while os.path.isdir(cgroup):
        try:
            os.rmdir(cgroup)
        except OSError:  # its processes are still exiting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
