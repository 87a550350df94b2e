"""Issue 16's acceptance test: one script body under a local spawn context and under the Dask context."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import mp_dask
import mp_reductions
import numpy as np
import pytest
from _targets import boom, f, g, init, mapping_of, nap, read_global, stall_once
from conftest import CLUSTER, SHM_DIR, kill, pid_alive, segments, wait_until

ARRAYS = [np.arange(1 << 20, dtype=np.float32) + i for i in range(8)] + \
         [np.arange(256, dtype=np.float32) * i for i in range(8)]  # 8 of 4 MiB, 8 of 1 KiB
PAIRS = list(zip(ARRAYS[:8], ARRAYS[7::-1], strict=True)) + list(zip(ARRAYS[8:], ARRAYS[:7:-1], strict=True))


class SpawnContext:
    """The local contexts' Pool and ProcessPoolExecutor (what arraymp.get_context("spawn") gives), without
    the facade: this package is tested with only what it declares installed."""

    ctx = multiprocessing.get_context("spawn")

    def Pool(self, processes=None, initializer=None, initargs=()):
        return mp_reductions.Pool(processes, initializer, initargs, context=self.ctx)

    def ProcessPoolExecutor(self, max_workers=None, initializer=None, initargs=()):
        # (mp_reductions': the stdlib's would send the arrays inside its pickles, SharingStoppedWarning said)
        return mp_reductions.ProcessPoolExecutor(max_workers, self.ctx, initializer, initargs)


def body(ctx) -> dict:
    """The script, as a user would write it; what it computed."""
    out, got = {}, []
    with ctx.Pool(4, initializer=init, initargs=("set by the initializer",)) as p:
        out["map"] = p.map(f, ARRAYS)
        out["imap"] = list(p.imap(f, ARRAYS))
        out["starmap"] = p.starmap(g, PAIRS)
        out["apply_async"] = p.apply_async(f, (ARRAYS[0],), callback=got.append).get(60)
        out["map_async"] = p.map_async(f, ARRAYS, chunksize=2).get(60)
        out["global"] = p.map(read_global, range(4))
        with pytest.raises(ValueError, match=r"boom on an array of shape \(1048576,\)"):
            p.apply(boom, (ARRAYS[0],))
    assert got and got[0] is out["apply_async"]  # the callback saw the result
    with ctx.ProcessPoolExecutor(2, initializer=init, initargs=("set by the initializer",)) as ex:
        out["executor_map"] = list(ex.map(f, ARRAYS, chunksize=2))
        out["executor_global"] = ex.submit(read_global, 0).result(60)
        with pytest.raises(ValueError, match="boom on an array"):
            ex.submit(boom, ARRAYS[0]).result(60)
    ex = ctx.ProcessPoolExecutor(2)
    naps = [ex.submit(nap, i) for i in range(40)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert any(fut.cancelled() for fut in naps)
    assert all(fut.cancelled() or fut.result() == i for i, fut in enumerate(naps))
    with pytest.raises(RuntimeError):
        ex.submit(nap, 0)
    return out


def check_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y), key
            for u, v in zip(x, y, strict=True):
                assert (u.dtype, u.shape) == (v.dtype, v.shape), key
                np.testing.assert_array_equal(u, v, err_msg=key)
        elif isinstance(x, np.ndarray):
            assert (x.dtype, x.shape) == (y.dtype, y.shape)
            np.testing.assert_array_equal(x, y, err_msg=key)
        else:
            assert x == y, key


@pytest.fixture(scope="module")
def spawn_results():
    return body(SpawnContext())


def test_dask_and_spawn_compute_the_same_with_handles(spawn_results, dask_ctx):
    """Items 1 and 2: the same results; each array >= 1 MiB crossed each boundary as a handle, seen in shared
    memory and writable by the task."""
    assert spawn_results["global"] == ["set by the initializer"] * 4
    check_same(spawn_results, body(dask_ctx))
    dask_ctx.reset_transfer_counters()
    with dask_ctx.Pool(4) as p:
        out = p.map(f, ARRAYS)
        counts = dask_ctx.transfer_counters()
        where = p.map(mapping_of, ARRAYS[:8])
    check_same({"map": out}, {"map": spawn_results["map"]})
    assert counts["handles_sent"] == 16, counts  # 8 arguments out, 8 results back
    assert counts["inband_array_bytes"] < 64 << 10, counts
    for path, writable in where:
        assert path.startswith(os.path.join(SHM_DIR, "arraymp_")), path
        assert writable
    assert all(r.flags.writeable for r in out)


def test_same_node_false_sends_bytes(spawn_results, scratch):
    """Item 3: ``same_node=False``: the same results, no handle."""
    with mp_dask.get_context(**CLUSTER, local_directory=scratch, same_node=False) as ctx:
        ctx.reset_transfer_counters()
        check_same(spawn_results, body(ctx))
        counts = ctx.transfer_counters()
        assert counts["handles_sent"] == 0, counts
        assert counts["inband_array_bytes"] >= 2 * sum(a.nbytes for a in ARRAYS), counts
        with ctx.Pool(2) as p:
            assert all(w for _, w in p.map(mapping_of, ARRAYS[:2]))  # received arrays are writable


def test_serializer_sees_the_recipient(dask_ctx):
    """Item 5, the guard: Dask still hands our serializer the recipient's address. Without it every array
    would silently go as bytes."""
    dask_ctx.reset_transfer_counters()
    with dask_ctx.Pool(2) as p:
        p.map(f, ARRAYS[:2])
    counts = dask_ctx.transfer_counters()
    assert counts["sends"] >= 4 and counts["sends_without_recipient"] == 0, counts
    assert counts["handles_sent"] == 4, counts


def test_nothing_left_after_close(scratch):
    """Item 4: after the pools and ``close()``: no segment (``shm-manager list``), no worker left after 5 s,
    no arraymp file in the scratch directory."""
    ctx = mp_dask.get_context(**CLUSTER, local_directory=scratch)
    try:
        workers = list(ctx.client.run(os.getpid).values())
        with ctx.Pool(2) as p:
            out = p.map(f, ARRAYS)
        with ctx.ProcessPoolExecutor(2) as ex:
            out += list(ex.map(f, ARRAYS))
        del out
    finally:
        ctx.close()
    wait_until(lambda: not any(pid_alive(pid) for pid in workers), 5, "the workers to end")
    wait_until(lambda: not segments(), 10, "every segment to go")
    listed = subprocess.run([sys.executable, "-m", "shm_manager", "list", "--json"], capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, ARRAYMP_SHM_DIR=SHM_DIR))
    assert listed.returncode == 0, listed.stderr
    assert "arraymp_" not in listed.stdout, listed.stdout
    left = [os.path.join(r, n) for r, _, names in os.walk(scratch) for n in names if "arraymp" in n]
    assert not left, left


def test_worker_killed_mid_task(scratch, tmp_path):
    """Item 4: SIGKILL of the worker running a task: the task is sent again (its argument was lost with the
    worker), the pool works on, and no segment is left (the killed worker's hold is given back by the group's
    daemon)."""
    marker = str(tmp_path / "running")
    with mp_dask.get_context(**CLUSTER, local_directory=scratch) as ctx, ctx.Pool(2) as p:
        result = p.apply_async(stall_once, (ARRAYS[0], marker))
        wait_until(lambda: os.path.exists(marker), 60, "the task to start")
        with open(marker) as fh:
            pid = int(fh.read())
        kill(pid)
        assert result.get(60) == float(np.sum(ARRAYS[0]))  # sent again, argument and all
        works_on = p.map(f, ARRAYS[:2])
        assert works_on[0].shape == ARRAYS[0].shape  # the pool works on
        del works_on
        wait_until(lambda: not segments(), 10, "the killed worker's segments to go, the cluster still up")
