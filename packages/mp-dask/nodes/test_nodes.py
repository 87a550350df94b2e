"""Issue 45 item 2: Pool and executor maps on separate nodes (see conftest.py): handles within the client's
shared memory, bytes across nodes and to the worker that shares the client's address but not its /dev/shm,
results identical to plain Dask's; a worker node lost mid-map; nothing left in any /dev/shm."""

from __future__ import annotations

import collections
import os

import dask
import mp_dask
import numpy as np
import pytest
from _work import doubled, stall_on, where_doubled
from conftest import REMOTE, WAIT, WHY_NOT, wait_until

ARRAYS = [np.full(1 << 20, i, np.float32) for i in range(12)]  # 4 MiB each: handles where handles may go
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
    # plain Dask's client.map(f, arrays), as users write it, puts the arrays in its graph and says so
    pytest.mark.filterwarnings("ignore:Sending large graph:UserWarning"),
]


def test_each_node_publishes_its_own_domain(cluster):
    domains, workers = cluster.published(), cluster.workers()
    client = domains["client"]
    assert domains[workers["local"]] == client, domains
    theirs = [domains[workers[name]] for name in REMOTE]
    assert client not in theirs and len(set(theirs)) == len(theirs), domains
    boot, dev = client.split(":")[:2]
    assert all(d.split(":")[0] == boot and d.split(":")[1] != dev for d in theirs), domains  # a tmpfs each
    # the case: the same address as the client and its worker, and not the same memory
    assert workers["hostnet"].startswith("tcp://127.0.0.1:") and workers["local"].startswith("tcp://127.0.0.1:")
    assert workers["b"].startswith("tcp://127.0.0.3:")


@pytest.mark.parametrize("front", ["Pool", "ProcessPoolExecutor"])
def test_handles_within_a_node_bytes_across(cluster, front):
    ctx = cluster.ctx
    ctx.reset_transfer_counters()
    if front == "Pool":
        with ctx.Pool(3) as p:
            out = p.map(where_doubled, ARRAYS, chunksize=1)
    else:
        with ctx.ProcessPoolExecutor(3) as ex:
            out = list(ex.map(where_doubled, ARRAYS))
    total, mine = ctx.transfer_counters(), mp_dask.transfer_counters()
    theirs = ctx.client.run(mp_dask.transfer_counters)  # each worker's, by address
    plain = ctx.client.gather(ctx.client.map(doubled, ARRAYS, pure=False))  # plain Dask, on the same cluster
    for (_, got), want in zip(out, plain, strict=True):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        np.testing.assert_array_equal(got, want)
    ran = collections.Counter(name for name, _ in out)
    assert set(ran) == {"local", *REMOTE}, ran  # arguments scattered round-robin: every node ran some
    size, workers = ARRAYS[0].nbytes, cluster.workers()
    across = sum(ran[name] for name in REMOTE)
    assert (mine["handles_sent"], mine["inband_array_bytes"]) == (ran["local"], across * size), (mine, ran)
    assert mine["sends_without_recipient"] == 0, mine
    # the context's sum: each argument and each result, a handle within the client's memory, bytes across
    assert (total["handles_sent"], total["inband_array_bytes"]) == (2 * ran["local"], 2 * across * size), total
    local = theirs[workers["local"]]
    assert (local["handles_sent"], local["inband_array_bytes"]) == (ran["local"], 0), local
    for name in REMOTE:
        counts = theirs[workers[name]]
        assert (counts["handles_sent"], counts["inband_array_bytes"]) == (0, ran[name] * size), (name, counts)


def _stalled(marker: str) -> int:
    wait_until(lambda: os.path.exists(marker), WAIT, f"a task to stall and write {marker}")
    with open(marker) as fh:
        return int(fh.read())


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_node_lost_mid_map_its_tasks_run_elsewhere(cluster, tmp_path, where):
    """Every process of the node's Dask (nanny, worker) killed at once, with a task of the map running there and
    others' arguments held there: those tasks run again on the other nodes, the results are plain Dask's."""
    name = f"lost-{where}"
    node = cluster.add(name, "127.0.0.4" if where == "remote" else "127.0.0.1", local=where == "local")
    marker = str(tmp_path / "stalled")
    with cluster.ctx.Pool(4) as p:
        result = p.starmap_async(stall_on, [(a, name, marker) for a in ARRAYS], chunksize=1)
        pid = _stalled(marker)
        killed = node.kill()
        assert pid in killed
        out = result.get(WAIT)
        plain = cluster.ctx.client.gather(cluster.ctx.client.map(doubled, ARRAYS, pure=False))
        for got, want in zip(out, plain, strict=True):
            np.testing.assert_array_equal(got, want)
        assert name not in cluster.workers()
        np.testing.assert_array_equal(p.map(doubled, ARRAYS[:3])[2], ARRAYS[2] * 2)  # the pool goes on
    del out, result


def test_past_allowed_failures_a_lost_node_fails_the_map_naming_its_worker(cluster, tmp_path):
    name = "lost-strict"
    cluster.add(name, "127.0.0.5")
    address = cluster.workers()[name]
    marker = str(tmp_path / "stalled")
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # the pool's
        p = cluster.ctx.Pool(4)
    try:
        result = p.starmap_async(stall_on, [(a, name, marker) for a in ARRAYS], chunksize=1)
        pid = _stalled(marker)
        cluster.nodes[name].kill()
        with pytest.raises(mp_dask.DaskWorkerLostError) as info:
            result.get(WAIT)
        err = info.value
        assert err.address == address and f"worker {address}" in str(err), str(err)
        assert err.pid == pid, str(err)
        np.testing.assert_array_equal(p.map(doubled, ARRAYS[:3])[2], ARRAYS[2] * 2)  # the pool goes on
    finally:
        p.terminate()
    del result, info, err
