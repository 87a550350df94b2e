"""Note [kept counts] outside our channels, as mp-dask uses it: a pickle made under ``keep_counts`` leaves its
in-flight counts with the sender (in ``held``), a receiver that unpickles it under ``counts_kept`` takes counts of
its own, and ``give_back_counts`` gives the sender's back: nothing depends on whether the receiver ever unpickled it
(a worker killed first left the count until the group ended)."""

import multiprocessing
import os
import time
from multiprocessing.reduction import ForkingPickler

import _targets as T
import mp_reductions as mpr
import pytest
import shm_core


@pytest.fixture
def file_system():
    old = mpr.get_sharing_strategy()
    mpr.set_sharing_strategy("file_system")
    yield
    mpr.set_sharing_strategy(old)


def refcount(seg) -> int:
    return seg.fetch_add(shm_core.REFCOUNT_OFFSET, 0)


@pytest.mark.parametrize("received", [True, False], ids=["unpickled", "never-unpickled"])
def test_the_sender_keeps_its_counts_until_it_gives_them_back(file_system, received):
    a = mpr.empty_shared(100_000)
    a[:] = 2
    held = []
    with mpr.keep_counts(held):
        data = bytes(ForkingPickler.dumps(a))
    assert len(held) == 1
    seg = held[0]
    path = os.path.join(seg.dir, seg.name)
    assert refcount(seg) == 2  # this process's, and the message's, kept here
    if received:  # a receiver that unpickles it, then exits: its count was its own, and went with it
        ctx = multiprocessing.get_context("spawn")
        q = ctx.SimpleQueue()
        p = ctx.Process(target=T.load_counts_kept, args=(data, q))
        p.start()
        assert q.get() == 200_000.0
        p.join(30)
        deadline = time.monotonic() + 10
        while refcount(seg) != 2 and time.monotonic() < deadline:  # (its daemon gives its count back)
            time.sleep(0.02)
        assert refcount(seg) == 2
    mpr.give_back_counts(held)
    assert held == [] and refcount(seg) == 1
    mpr.give_back_counts(held)  # (nothing more)
    assert refcount(seg) == 1
    del a, seg
    deadline = time.monotonic() + 5
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(path)
