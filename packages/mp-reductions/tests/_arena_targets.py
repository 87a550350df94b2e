"""Child-process targets of test_arenas.py (importable under spawn and forkserver)."""

import resource

import mp_reductions as mpr
import numpy as np


def produce_small(q, n, strategy):
    """Make, send and drop ``n`` 16-element arrays, one at a time (issue 12, defect 1)."""
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    for i in range(n):
        a = mpr.zeros_shared((16,), np.int64)
        a[:] = i
        q.put(a)
        del a
    q.put(None)


def hold_until_told(q, ready, release):
    """Keep the array received on ``q``; report what it reads once told to let it go."""
    mpr.init_reductions()
    a = q.get()
    ready.put(int(a.sum()))
    release.get(timeout=60)
    ready.put(int(a.sum()))
    del a
    ready.put("dropped")


def create_under_limit(strategy, limit, n, size, out):
    """Keep ``n`` arrays of ``size`` bytes alive under RLIMIT_NOFILE ``limit``, then send the oldest."""
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    live = []
    for i in range(n):
        a = mpr.empty_shared(size, np.uint8)
        a[:] = i % 251
        live.append(a)
    q = mpr.SimpleQueue()
    q.put(live[0])
    back = q.get()
    back[0] = 200
    out.put((len(live), bool(np.shares_memory(back, live[0])), int(live[0][0])))
