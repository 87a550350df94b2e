"""Issue 45 item 1 on one machine: handles only within a shared-memory domain (Note [Same-node transport]). A
worker with another segment directory, on the client's own address, gets bytes and gives the right results; a
worker that claims the client's domain and cannot open its handles fails the task with DaskHandleError, with the
cause, and the pool goes on. (Separate mount namespaces and addresses: ../nodes, run as root.)"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile

import mp_dask
import numpy as np
import pytest
from _targets import claim_domain, f, first_sum, full
from conftest import CLUSTER, wait_until


@pytest.fixture
def other_dir():
    """Another segment directory, for the workers: another domain on the same machine and address."""
    d = tempfile.mkdtemp(prefix="arraymp-dask-other-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def segments_in(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("arraymp_"))


@pytest.fixture
def apart(scratch, other_dir):
    """A context whose LocalCluster's workers (on 127.0.0.1, as the client) use ``other_dir``."""
    ctx = mp_dask.get_context(**CLUSTER, local_directory=scratch, env={"ARRAYMP_SHM_DIR": other_dir})
    try:
        yield ctx
    finally:
        ctx.close()
    wait_until(lambda: not segments_in(other_dir), 10, f"the workers' segments to go: {segments_in(other_dir)}")


def test_a_worker_of_another_shm_dir_gets_bytes(apart, other_dir):
    arrays = [np.full(1 << 20, i, np.float32) for i in range(8)]  # 4 MiB each
    domains = apart.shm_domains()
    assert domains["client"] is not None
    workers = {a: d for a, d in domains.items() if a != "client"}
    assert len(workers) == 2 and all(d is not None and d != domains["client"] for d in workers.values()), domains
    assert all(d.endswith(":" + other_dir) for d in workers.values()), domains
    apart.reset_transfer_counters()
    with apart.Pool(2) as p:
        out = p.map(f, arrays)
    for a, o in zip(arrays, out, strict=True):
        np.testing.assert_array_equal(o, (a + 1) * 2)
    counts = apart.transfer_counters()
    assert counts["handles_sent"] == 0, counts
    assert counts["inband_array_bytes"] == 2 * sum(a.nbytes for a in arrays), counts  # in and out, as bytes
    with apart.ProcessPoolExecutor(2) as ex:
        assert [float(o[0]) for o in ex.map(f, arrays)] == [(i + 1) * 2 for i in range(8)]
    assert apart.transfer_counters()["handles_sent"] == 0


def test_a_handle_that_cannot_be_opened_fails_its_task(apart):
    """The workers claim the client's domain (as a node set up wrong would): the client sends them handles, which
    they cannot open (the handle's directory is not theirs), and they send handles of their own directory back.
    Each failure is the task's, in the caller's future, with its cause; the comms stay up, the pool goes on."""
    apart.client.run(claim_domain, apart.shm_domains()["client"])
    a = np.full(1 << 18, 3, np.float32)  # 1 MiB: a handle
    with apart.Pool(2) as p:
        with pytest.raises(mp_dask.DaskHandleError) as info:
            p.apply(first_sum, (None, a))  # the argument: the worker cannot open it
        text = str(info.value)
        assert text.startswith("worker tcp://127.0.0.1:") and "could not open the shared-memory handles" in text
        assert "SegmentError: the handle names a segment in" in text, text
        assert "same_node=False" in text  # the remedy
        with pytest.raises(mp_dask.DaskHandleError) as info:
            p.apply(full, (1 << 18, 5.0))  # the result: this process cannot open it
        text = str(info.value)
        assert text.startswith(f"process {os.getpid()} could not open"), text
        assert "tcp://127.0.0.1:" in text and "SegmentError" in text, text
        assert p.apply(first_sum, (None, np.ones(4, np.float32))) == 4.0  # small arrays go inline: the pool goes on
    with apart.ProcessPoolExecutor(1) as ex:
        fut = ex.submit(first_sum, None, a)
        with pytest.raises(mp_dask.DaskHandleError):
            fut.result(60)
    err = info.value
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
