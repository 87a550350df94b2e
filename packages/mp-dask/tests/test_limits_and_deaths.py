"""Time limits that end the worker (Note [Dask task timeouts]) and deaths told by the nanny (Note [Dask deaths
explained]): the Dask context's Pool and executor, as mp_reductions.Pool's."""

from __future__ import annotations

import pickle
import time

import dask
import mp_dask
import mp_reductions
import numpy as np
import pytest
from _targets import crash, f, pid_then_sleep
from conftest import CLUSTER, pid_alive, segments, started, wait_until
from mp_dask import _deaths


def test_a_task_past_the_pools_limit_fails_and_the_others_complete(scratch, tmp_path):
    marker = str(tmp_path / "long")
    args = [np.full(1 << 18, i, np.float32) for i in range(6)]  # 1 MiB: handles
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        p = ctx.Pool(2, task_timeout=2)
        with mp_reductions.stats() as counted:
            t0 = time.monotonic()
            long = p.apply_async(pid_then_sleep, (args[0], 60, marker))
            pid = started(marker)
            short = [p.apply_async(pid_then_sleep, (a, 0.1)) for a in args[1:]]
            with pytest.raises(mp_reductions.TaskTimeoutError) as info:
                long.get(60)
        assert counted.task_timeouts == 1
        assert time.monotonic() - t0 < 30, "the long task was not ended at its limit"  # (a hang check)
        err = info.value
        assert isinstance(err, TimeoutError)
        assert (err.limit, err.index, err.kind, err.pid) == (2, 0, "apply", pid), str(err)
        assert "ran past its time limit of 2 s" in str(err) and f"worker {pid}" in str(err)
        assert str(pickle.loads(pickle.dumps(err))) == str(err)
        assert [r.get(60) for r in short] == [float(a.sum()) for a in args[1:]]  # lost beside it: sent again
        wait_until(lambda: not pid_alive(pid), 10, f"the ended worker {pid} to be gone")
        assert p.apply(pid_then_sleep, (args[1], 0.1)) == float(args[1].sum())  # the pool goes on
        p.terminate()
        del args, long, short, err, info
        wait_until(lambda: not segments(), 10, f"segments to go after terminate(): {segments()}")


def test_a_calls_own_limit_on_the_executor_and_none_without_one(scratch, tmp_path):
    marker = str(tmp_path / "long")
    a = np.full(1 << 18, 2, np.float32)
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        with ctx.ProcessPoolExecutor(2) as ex:
            slow = ex.submit(pid_then_sleep, a, 2.5)  # no limit: it runs to its end
            long = ex.submit(pid_then_sleep, a, 60, marker, task_timeout=1)
            pid = started(marker)
            err = long.exception(60)
            assert isinstance(err, mp_reductions.TaskTimeoutError), repr(err)
            assert (err.limit, err.kind, err.pid) == (1, "submit", pid)
            assert slow.result(60) == float(a.sum())
            assert ex.submit(pid_then_sleep, a, 0).result(60) == float(a.sum())
        del a, err
        wait_until(lambda: not segments(), 10, f"segments to go after shutdown: {segments()}")


def test_a_bad_limit_says_what_is_taken(scratch):
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        with pytest.raises(ValueError, match="positive number of seconds"):
            ctx.Pool(2, task_timeout=-1)
        with pytest.raises(TypeError, match="number of seconds or None"):
            ctx.ProcessPoolExecutor(2, task_timeout="1")
        p = ctx.Pool(2)
        with pytest.raises(ValueError, match="positive number of seconds"):
            p.apply_async(f, (np.ones(3),), timeout=0)
        p.terminate()


def test_a_worker_that_crashed_is_told_by_its_nanny(scratch):
    a = np.full(1 << 18, 3, np.float32)
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx:
        ctx.Pool(2).terminate()  # a pool before: the nannies are told once, however many pools (idempotent)
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # the pool's: no second try
            p = ctx.Pool(2)
        with pytest.raises(mp_dask.DaskWorkerLostError) as info:
            p.apply(crash, (a,))
        err = info.value
        told = [msg for _, msg in ctx.client.get_events(_deaths.TOPIC) if msg["address"] == err.address]
        assert len(told) == 1 and told[0]["exitcode"] == -11, told
        assert err.exitcode == -11 and err.signal_name == "SIGSEGV", str(err)
        assert "died with signal SIGSEGV" in str(err) and "a crash in native code" in str(err), str(err)
        assert str(pickle.loads(pickle.dumps(err))) == str(err)
        assert p.apply(pid_then_sleep, (a, 0)) == float(a.sum())
        p.terminate()
        del a, err, info
        wait_until(lambda: not segments(), 10, f"segments to go after terminate(): {segments()}")
