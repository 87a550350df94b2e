"""Channels under the process's own settings: socket.setdefaulttimeout(), closing and garbage collection.

The receiver short of descriptors and the children under a default timeout are in _suite.py (each start method).
"""

import gc
import os
import socket
import threading
import warnings

import mp_reductions as mpr
import numpy as np
import pytest


def open_inodes():
    """The inodes of what this process's descriptors (/proc/self/fd) refer to."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except FileNotFoundError:  # the one listing the directory
            pass
    return inodes


def test_default_socket_timeout_is_ignored_by_blocking_receives():
    socket.setdefaulttimeout(0.5)
    try:
        q, jq, sq = mpr.Queue(), mpr.JoinableQueue(), mpr.SimpleQueue()
        a, b = mpr.Pipe()
        late = threading.Timer(2.0, lambda: (q.put(np.ones(100_000)), jq.put(np.ones(10)), sq.put(np.ones(1000)),
                                             b.send(np.ones(100))))
        late.start()  # every receive below waits 2 s, 4 times the default timeout
        assert [float(q.get().sum()), float(jq.get(timeout=60).sum()), float(sq.get().sum()),
                float(a.recv().sum())] == [100_000.0, 10.0, 1000.0, 100.0]
        late.join()
        jq.task_done()
        for chan in (q, jq, sq, a, b):
            chan.close()
    finally:
        socket.setdefaulttimeout(None)


@pytest.mark.parametrize("cls", [mpr.Queue, mpr.JoinableQueue])
@pytest.mark.parametrize("feeder", [False, True], ids=["direct", "feeder"])
def test_close_and_join_thread_close_the_sockets(cls, feeder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = cls()
        sockets = {os.fstat(s.fileno()).st_ino for s in (q._reader, q._writer)}
        assert sockets <= open_inodes()
        n = 5000 if feeder else 3  # 5000 messages overflow the socket: put hands the rest to the feeder thread
        for i in range(n):
            q.put(i)
        assert (q._thread is not None) == feeder
        assert [q.get(timeout=60) for _ in range(n)] == list(range(n))
        q.close()
        q.join_thread()
        assert not sockets & open_inodes()  # this process's two ends, at once
        with pytest.raises(ValueError, match="is closed"):
            q.get(timeout=1)
        del q
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_dropped_queue_closes_its_sockets():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = mpr.Queue()
        q.put(np.ones(100_000))
        q.get(timeout=60)
        del q
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
