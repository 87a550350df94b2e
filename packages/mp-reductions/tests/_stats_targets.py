"""The known sequence of sends whose counts test_stats checks, and the child that sends it (importable under spawn
and forkserver)."""

import mp_reductions as mpr
import numpy as np
from mp_reductions import _stats

SMALL = 10  # float64s: 80 bytes, inside the pickle
BIG = 1 << 17  # float64s: 1 MiB, copied once into shared memory
# what sending the sequence counts in the sender (segments: the shared array's and the copies', made or reused)
SENT = {"messages_sent": 6, "handles_sent": 1, "arrays_copied": 2, "bytes_copied": 2 * 8 * BIG,
        "arrays_inline": 3, "bytes_inline": 3 * 8 * SMALL, "fallbacks": 0, "fallback_bytes": 0,
        "worker_deaths": 0, "task_timeouts": 0, "buffers_copied": 0, "buffer_bytes_copied": 0}


def send_sequence(q) -> np.ndarray:
    """Put 3 small arrays, 2 big ones and 1 shared one; returns the shared one (keep it until received)."""
    shared = mpr.empty_shared(BIG)  # 1 MiB: a segment of its own, sent as a handle
    shared[:] = 7.0
    for i in range(3):
        q.put(np.full(SMALL, float(i)))
    for i in range(2):
        q.put(np.full(BIG, float(i)))
    q.put(shared)
    return shared


def check_sequence(q, timeout=60) -> None:
    got = [q.get(timeout=timeout) if hasattr(q, "join_thread") else q.get() for _ in range(6)]
    for i in range(3):
        assert got[i].shape == (SMALL,) and (got[i] == i).all()
    for i in range(2):
        assert got[3 + i].shape == (BIG,) and (got[3 + i] == i).all()
    assert (got[5] == 7.0).all() and mpr.is_shared(got[5])


def counters(d: dict) -> dict:
    """The counts of ``d`` (a Stats.as_dict()), without the gauges."""
    return {k: d[k] for k in _stats.FIELDS}


def child_sends(q, out, cmd, strategy):
    """Send the sequence, report (counts at start, counts after), then wait for the parent's word to exit."""
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    before = counters(mpr.stats().as_dict())
    shared = send_sequence(q)
    q.close()
    q.join_thread()  # every message in the socket: counted as sent
    out.put((before, counters(mpr.stats().as_dict())))
    cmd.get()  # the parent reads this process's page meanwhile (stats PID)
    del shared
