"""An unshared array that every task of one Pool call takes is copied into shared memory once for the call, and
each task still gets its own array (_reductions Note [inputs once per call])."""

from __future__ import annotations

import functools
import gc
import itertools
import multiprocessing
import os
import weakref

import _pool_targets as T
import mp_reductions as mpr
import numpy as np
import pytest
from mp_reductions import _channel, _shared

BIG = 1 << 20  # float64 items: 8 MiB


def _files(packet) -> set:
    return {(st.st_dev, st.st_ino) for st in (os.fstat(fd) for fd in packet.fds if fd >= 0)}


def test_the_second_message_of_a_call_names_one_shared_copy():
    big, table = np.arange(BIG, dtype=np.float64), {}
    packets = [_channel.Packet((T.write_own_input, (big, i)), inputs=table) for i in range(4)]
    try:
        entry = table[id(big)]
        assert entry[0]() is big and entry[1] is not None and _shared.segment_of(entry[1]) is not None
        np.testing.assert_array_equal(entry[1], big)
        st = os.fstat(_shared.segment_of(entry[1])[0].fd)
        shared = (st.st_dev, st.st_ino)
        # the first message carries its own copy; the others all name the one shared copy, and nothing else
        assert shared not in _files(packets[0]) and len(_files(packets[0])) == 1
        assert all(_files(p) == {shared} for p in packets[1:])
    finally:
        for p in packets:
            p.discard()


def test_an_array_that_dies_leaves_the_table_and_its_id_is_new_again():
    table = {}
    for i in range(50):  # arrays made and dropped one by one, as an imap over a generator sends them
        a = np.full(BIG // 8, float(i))
        _channel.Packet((T.write_own_input, (a, i)), inputs=table).discard()
        del a
        gc.collect()
    assert len(table) == 0  # nothing kept alive, no stale entry to match a reused id


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_tasks_of_one_call_never_see_each_others_writes(method):
    big = np.zeros(BIG, np.float64)
    big[-1] = 7.0
    with mpr.Pool(2, context=multiprocessing.get_context(method)) as pool:
        got = pool.starmap(T.write_own_input, zip(itertools.repeat(big), range(16)), chunksize=1)
        # the first task had the message's copy, the others the call's shared copy, each privately
        assert got == [(0.0, True, 7.0)] * 16
        ro = big.copy()
        ro.flags.writeable = False
        assert pool.starmap(T.first_and_flag, zip(itertools.repeat(ro), range(6)), chunksize=1) == [(0.0, False)] * 6
        assert pool._cache.inputs == {}  # the calls' tables went with their results
    pool.join()
    assert big[0] == 0.0  # the caller's array: untouched


def test_a_call_keeps_its_inputs_weakly():
    big = np.zeros(BIG, np.float64)
    ref = weakref.ref(big)
    with mpr.Pool(2) as pool:
        pool.starmap(T.write_own_input, [(big, 0), (big, 1), (big, 2)], chunksize=1)
        del big
        gc.collect()
        assert ref() is None
    pool.join()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_each_map_call_copies_its_input_once_the_executor_s_too(method):
    # issue 43 item 4: map, starmap, imap and the executor's map of 16 tasks that all take one unshared array: the
    # caller copies it into shared memory twice (the first task's message, then the call's shared copy that every
    # later message names), whatever the number of tasks; arraymp.stats() counts each copy once
    big = np.ones(BIG, np.float64)
    ctx = multiprocessing.get_context(method)
    with mpr.Pool(2, context=ctx) as pool, mpr.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        calls = {
            "starmap": lambda: pool.starmap(T.write_own_input, [(big, i) for i in range(16)], chunksize=1),
            "map": lambda: pool.map(functools.partial(T.write_own_input, big), range(16), chunksize=1),
            "imap": lambda: list(pool.imap(functools.partial(T.write_own_input, big), range(16))),
            "executor map": lambda: list(ex.map(T.write_own_input, [big] * 16, range(16))),
        }
        for name, call in calls.items():
            with mpr.stats() as s:
                got = call()
            assert got == [(1.0, True, 1.0)] * 16, name  # each task its own writable copy
            counts = s.as_dict()
            assert (counts["arrays_copied"], counts["bytes_copied"]) == (2, 2 * big.nbytes), (name, counts)
            assert counts["handles_sent"] >= 14, (name, counts)
        # submit in a loop is not one call: each takes a copy of its own
        with mpr.stats() as s:
            futures = [ex.submit(T.write_own_input, big, i) for i in range(3)]
            assert [f.result() for f in futures] == [(1.0, True, 1.0)] * 3
        assert s.as_dict()["arrays_copied"] == 3
    assert big[0] == 1.0
