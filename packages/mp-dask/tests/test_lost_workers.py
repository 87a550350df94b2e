"""A worker killed mid-map (Note [Lost workers] in _tasks.py): its tasks are sent again, or, past Dask's
``allowed-failures``, fail with WorkerLostError naming the worker; no segment outlives ``terminate()`` and
the arguments by more than 3 s."""

from __future__ import annotations

import os
import pickle

import dask
import mp_dask
import mp_reductions
import numpy as np
import pytest
from _targets import DiesWhenUnpickled, f, first_sum, result_then_death, stall_first
from conftest import CLUSTER, kill, pid_alive, segments, started, wait_until


def arrays() -> list[np.ndarray]:
    return [np.full(1 << 18, i, np.float32) for i in range(16)]  # 1 MiB each: they travel as handles


def test_tasks_of_a_killed_worker_are_sent_again(scratch, tmp_path):
    marker = str(tmp_path / "running")
    args = arrays()
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        p = ctx.Pool(2)
        result = p.starmap_async(stall_first, [(a, marker) for a in args], chunksize=1)
        pid = started(marker)
        kill(pid)
        assert result.get(60) == [float(a.sum()) for a in args]  # the lost ones ran again elsewhere
        assert not pid_alive(pid)
        out = p.map(f, args[:4])  # the pool works on
        np.testing.assert_array_equal(out[3], (args[3] + 1) * 2)
        p.terminate()
        del args, result, out
        # they go with the pool, not with the cluster; the bound is a hang check for a loaded machine
        wait_until(lambda: not segments(), 10, f"segments to go after terminate(): {segments()}")


def test_past_allowed_failures_the_task_fails_naming_the_worker(scratch, tmp_path):
    marker = str(tmp_path / "running")
    args = arrays()
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        where = {pid: address for address, pid in ctx.client.run(os.getpid).items()}
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # the pool's; the scheduler's is 3
            p = ctx.Pool(2)
        result = p.starmap_async(stall_first, [(a, marker) for a in args], chunksize=1)
        pid = started(marker)
        kill(pid)
        with pytest.raises(mp_reductions.WorkerLostError) as info:
            result.get(60)
        err = info.value
        assert isinstance(err, mp_dask.DaskWorkerLostError)
        assert (err.address, err.pid, err.kind) == (where[pid], pid, "map"), str(err)
        assert f"worker {where[pid]} (pid {pid})" in str(err) and "of map" in str(err)
        assert err.exitcode == -9 and "died with signal SIGKILL" in str(err), str(err)  # as its nanny told
        assert str(pickle.loads(pickle.dumps(err))) == str(err)
        out = p.map(f, args[:4])  # the pool works on
        np.testing.assert_array_equal(out[3], (args[3] + 1) * 2)
        p.terminate()
        del args, result, out, err, info
        wait_until(lambda: not segments(), 3, f"segments to go after terminate(): {segments()}")


def test_a_worker_killed_before_it_maps_its_argument_leaves_no_segment(scratch):
    # issue 35 (9): a task's argument carried the in-flight counts of its segments, which its worker takes over as
    # it unpickles it; a worker killed first left them until the program's group ended. The pool keeps them now
    # until the task is done with (mp_reductions' Note [kept counts]). Dask's worker unpickles what is scattered
    # to it as it arrives: its death fails the scatter, and so the call.
    a = np.full(1 << 18, 3, np.float32)  # 1 MiB: a handle
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        p = ctx.Pool(2)
        with pytest.raises(Exception, match="closed"):  # (distributed's CommClosedError)
            p.apply_async(first_sum, (DiesWhenUnpickled(), a)).get(60)
        assert p.apply(first_sum, (None, a)) == float(a.sum())  # the pool works on
        p.terminate()
        del a
        wait_until(lambda: not segments(), 3, f"segments to go after terminate(): {segments()}")


@pytest.mark.parametrize("front", ["Pool", "ProcessPoolExecutor"])
def test_a_worker_killed_as_it_sends_a_result_leaves_no_segment(scratch, tmp_path, front):
    # issue 42 (7): a worker killed after it counted its result's handle and before the result went kept that
    # segment until the program's group ended (a LocalCluster's workers are of the program's group: until the
    # program exited). Its results are told to the daemon as sent to the client now, and the pool, done with its
    # dead worker, has them given back (Note [Counts over Dask] in _transport.py).
    a = np.full(1 << 18, 3, np.float32)  # 1 MiB: its result a handle too
    marker = str(tmp_path / "die-once")
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        if front == "Pool":
            with ctx.Pool(2) as p:
                out, said = p.apply(result_then_death, (a, marker))  # sent again, to the restarted worker
        else:
            with ctx.ProcessPoolExecutor(2) as ex:
                out, said = ex.submit(result_then_death, a, marker).result(60)
        assert os.path.exists(marker) and said == "sent"  # the first send killed its worker
        np.testing.assert_array_equal(out, a * 2)
        del out, a
        # the pool is done with it: gone, the cluster still up (on main: until the program exits)
        wait_until(lambda: not segments(), 3, f"segments to go after the pool closed: {segments()}")
