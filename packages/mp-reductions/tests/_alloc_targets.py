"""Functions run in other processes by test_shared_alloc (importable under spawn and forkserver)."""

import os
import time

import mp_reductions as mpr
import numpy as np

N = (1 << 20) // 4 + 1024  # float32 elements: just over the shared handler's 1 MiB threshold
KEPT = {}


def result_kept(i):
    """A fresh result, kept here too: a write to what the parent received shows whether it was copied."""
    KEPT[i] = a = np.full(N, i, np.float32)
    return a


def kept_value(i):
    a = KEPT[i]
    return float(a[0]) if (a == a[0]).all() else None


def hold_then_sleep(slots, seconds):
    """Hold handler memory (kept, and sent as a result before), publish our pid, block."""
    KEPT["held"] = np.ones(4 * N, np.float32)
    slots[0] = os.getpid()
    time.sleep(seconds)


def fork_child_allocates(holder, go, out, n):
    """In a fork child: wait, drop the inherited arrays in ``holder`` (the last reference here), then make ``n``
    arrays under the handler; report who made the segment each lies in, and how many read wrong."""
    assert go.wait(30)
    holder.clear()
    creators, wrong = set(), 0
    with mpr.shared_allocation():
        for _ in range(n):
            a = np.full(N, 9, np.float32)
            creators.add(segment_creator(a))
            wrong += int((a != 9).any())
            del a
    out.put((os.getpid(), sorted(creators), wrong))


def segment_creator(a):
    from mp_reductions import _shared

    found = _shared.segment_of(a)
    return None if found is None else found[0].creator_pid


def double_in_place(q, done):
    mpr.init_reductions()
    a = q.get(timeout=30)
    a *= 2
    del a
    done.put("ok")
