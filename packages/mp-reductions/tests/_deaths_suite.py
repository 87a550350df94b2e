"""Timeouts that kill and deaths explained (issue 34), bound to a start method by test_deaths_<method>.py:
``Pool(task_timeout=)`` and ``apply_async(timeout=)`` end a stuck task's worker (SIGTERM, then SIGKILL) and fail it
with ``TaskTimeoutError`` while the rest goes on (mp_reductions._pool Note [task timeouts]); ``WorkerLostError``
names the signal and says whether the kernel's OOM killer did it (Note [deaths explained])."""

import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import time
import uuid

import _deaths_targets as T
import mp_reductions as mpr
import numpy as np
import pytest

TIMEOUT = 60  # every wait has one: a hang fails the test instead of the run
LIMIT = 1.0  # the task limit the timing test sets

# The bound: a task timed out within 1 s of its limit. Measured from the task's start as its worker saw it
# (time.monotonic is CLOCK_MONOTONIC, one clock for every process of the machine) to the moment the caller gets the
# error, so a worker's start (a second or more under spawn on a loaded machine) or a task queued behind another
# counts for nothing. What is left is the watchdog's tick (0.05 s), the SIGTERM, the death's detection and
# settlement: tens of milliseconds; the second covers a loaded 2-core machine's scheduling delays.
WITHIN = 1.0


def _wait_for(path: pathlib.Path) -> float:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert time.monotonic() < deadline, "the hanging task never started"
        time.sleep(0.01)
    return float(path.read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class DeathsSuite:
    method = None

    @pytest.fixture
    def ctx(self):
        return multiprocessing.get_context(self.method)

    def test_a_stuck_task_times_out_within_a_second_and_the_rest_completes(self, ctx, strategy, tmp_path):
        path = str(tmp_path / "start")
        held = np.ones(100_000)  # 800 KB: by shared memory, held by the task killed (the leak check counts)
        with mpr.Pool(2, context=ctx, task_timeout=LIMIT) as pool:
            it = pool.imap(T.square_or_hang_args, [(x, path, held) for x in range(12)])
            got = []
            for _ in range(12):
                try:
                    got.append(it.next(TIMEOUT))
                except mpr.TaskTimeoutError as e:
                    ended = time.monotonic()
                    error = e
                    got.append(None)
            started = float(pathlib.Path(path).read_text())
            assert got == [None if x == T.HANG else x * x for x in range(12)]
            # never early; within WITHIN of the limit (see above)
            assert LIMIT <= ended - started < LIMIT + WITHIN, ended - started
            assert isinstance(error, TimeoutError) and error.index == T.HANG and error.kind == "imap"
            assert f"task {T.HANG} of imap (square_or_hang_args) ran past its time limit of 1 s" in str(error)
            assert error.pid is not None and _wait_gone(error.pid)
            assert pickle.loads(pickle.dumps(error)).args == error.args
            # the pool replaced the worker and goes on
            assert pool.map(T.nap, [0, 0, 0]) == [0, 0, 0]

    def test_a_calls_own_timeout_and_get_timeout_keep_their_meanings(self, ctx):
        with mpr.Pool(2, context=ctx) as pool:  # no task_timeout: only the call with one is limited
            slow = pool.apply_async(T.nap, (1.5,))
            with pytest.raises(multiprocessing.TimeoutError):  # the stdlib's: it only stops waiting
                slow.get(0.1)
            stuck = pool.apply_async(T.nap, (60,), timeout=0.5)
            with pytest.raises(mpr.TaskTimeoutError, match=r"task 0 of apply \(nap\(60\)\) ran past its time limit "
                                                            r"of 0\.5 s"):
                stuck.get(TIMEOUT)
            assert slow.get(TIMEOUT) == 1.5  # the unlimited one ran its full time
            with pytest.raises(TimeoutError):  # apply's too
                pool.apply(T.nap, (60,), timeout=0.5)
            assert pool.apply(T.nap, (0,)) == 0

    def test_a_timed_out_chunk_fails_its_items_together(self, ctx, tmp_path):
        path = str(tmp_path / "start")
        with mpr.Pool(2, context=ctx, task_timeout=LIMIT) as pool:
            with pytest.raises(mpr.TaskTimeoutError) as info:
                pool.starmap_async(T.square_or_hang, [(x, path) for x in range(9)], chunksize=3).get(TIMEOUT)
            assert info.value.index == 1 and "(square_or_hang, items 3-5)" in str(info.value)
            assert "chunksize=1 gives each call its own limit" in str(info.value)
            assert pool.starmap(T.square_or_hang, [(x, path) for x in range(3)]) == [0, 1, 4]

    def test_bad_limits_say_what_to_give(self, ctx):
        for bad, error in ((-1, ValueError), (0, ValueError), (float("nan"), ValueError), ("1", TypeError),
                           (True, TypeError)):
            with pytest.raises(error, match="task_timeout must be .*or None for no limit"):
                mpr.Pool(1, context=ctx, task_timeout=bad)
        with mpr.Pool(1, context=ctx, task_timeout=float("inf")) as pool:  # inf: no limit
            with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -2.0"):
                pool.apply_async(T.nap, (0,), timeout=-2)
            assert pool.apply(T.nap, (0,)) == 0

    def test_a_segfault_is_named(self, ctx, capfd):
        with mpr.Pool(2, context=ctx) as pool:
            with pytest.raises(mpr.WorkerLostError) as info:
                pool.apply_async(T.crash, (T.HANG,)).get(TIMEOUT)
            if self.method == "fork":  # the report of the faulthandler it inherited: captured here, not printed
                assert "Fatal Python error: Segmentation fault" in capfd.readouterr().err
            err = info.value
            assert err.signal_name == "SIGSEGV" and err.oom is None and err.task == "crash"
            assert f"worker {err.pid} died with signal SIGSEGV while running task 0 of apply (crash): a crash in " \
                   "native code" in str(err)
            assert str(pickle.loads(pickle.dumps(err))) == str(err)
            assert pool.map(T.crash, range(3)) == [0, 1, 2]

    @pytest.mark.parametrize("version", ["v1", "v2"])
    def test_a_worker_over_its_memory_cgroup_limit_is_reported_killed_by_the_oom_killer(self, version):
        cgroup = _memory_cgroup(version, 300 << 20)
        script = textwrap.dedent(f"""
            import os, sys
            with open({os.path.join(cgroup, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))
            import multiprocessing, mp_reductions as mpr, _deaths_targets as T
            if __name__ == "__main__":
                with mpr.Pool(1, context=multiprocessing.get_context({self.method!r})) as pool:
                    try:
                        pool.apply_async(T.hog).get({TIMEOUT})
                    except mpr.WorkerLostError as e:
                        print(repr((e.signal_name, e.oom, e.rss is not None, str(e))))
                    assert pool.apply(T.nap, (0,)) == 0
        """)
        try:
            run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT * 2,
                                 cwd=os.path.dirname(__file__), env=_env())
        finally:
            _remove_cgroup(cgroup)
        assert run.returncode == 0, run.stderr
        name, oom, rss, message = eval(run.stdout.strip().splitlines()[-1])
        assert (name, oom, rss) == ("SIGKILL", True, True), message
        assert "died with signal SIGKILL while running task 0 of apply (hog): killed by the kernel's OOM killer: the " \
               "memory cgroup counted an OOM kill while it ran (its resident size was " in message
        assert message.endswith("give each task less memory, use fewer processes, or raise the memory limit")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + TIMEOUT
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _env() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}


def _own_cgroup(version: str) -> tuple[str, str] | None:
    """(mount point, this process's path under it) of the memory hierarchy of ``version``, or None."""
    with open("/proc/self/cgroup") as f:
        groups = [line.rstrip("\n").split(":", 2) for line in f]
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        fstype, point, options = fields[fields.index("-") + 1], fields[4], fields[-1].split(",")
        if version == "v1" and fstype == "cgroup" and "memory" in options:
            path = next((p for _, names, p in groups if "memory" in names.split(",")), None)
            return (point, path.strip("/")) if path is not None else None
        if version == "v2" and fstype == "cgroup2":
            path = next((p for hid, names, p in groups if hid == "0" and not names), None)
            return (point, path.strip("/")) if path is not None else None
    return None


def _memory_cgroup(version: str, limit: int) -> str:
    """A new child of this process's memory cgroup (``version``) limited to ``limit`` bytes, swap off; skips with
    the reason where the machine has none or it cannot be made."""
    own = _own_cgroup(version)
    if own is None:
        pytest.skip(f"no cgroup {version} hierarchy with the memory controller is mounted here")
    point, path = own
    parent = os.path.join(point, path)
    if version == "v2":
        try:
            controllers = pathlib.Path(parent, "cgroup.controllers").read_text().split()
        except OSError as e:
            pytest.skip(f"cgroup v2: {e}")
        if "memory" not in controllers:
            pytest.skip("cgroup v2 is mounted here without the memory controller (it is on cgroup v1)")
        try:
            pathlib.Path(parent, "cgroup.subtree_control").write_text("+memory")
        except OSError as e:
            pytest.skip(f"cgroup v2: cannot enable the memory controller for a child of {parent}: {e}")
    cgroup = os.path.join(parent, f"arraymp-deaths-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(cgroup)
        if version == "v1":
            pathlib.Path(cgroup, "memory.limit_in_bytes").write_text(str(limit))
            if os.path.exists(os.path.join(cgroup, "memory.memsw.limit_in_bytes")):
                pathlib.Path(cgroup, "memory.memsw.limit_in_bytes").write_text(str(limit))
        else:
            pathlib.Path(cgroup, "memory.max").write_text(str(limit))
            if os.path.exists(os.path.join(cgroup, "memory.swap.max")):
                pathlib.Path(cgroup, "memory.swap.max").write_text("0")
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
