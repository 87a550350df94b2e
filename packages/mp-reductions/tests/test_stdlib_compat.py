"""What code written for the stdlib expects of our Queue / SimpleQueue / Pipe: isinstance, the feeder-error hook,
wait() and select(), silent collection; and a bounded Queue whose getters are SIGKILLed.

CPython's own multiprocessing tests run over these objects in the root's stdlib_suite (nox -s stdlib_suite).
"""

import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.queues
import os
import queue
import select
import signal
import warnings

import mp_reductions as mpr
import numpy as np
import pytest


class Unpicklable:
    def __reduce__(self):
        raise AttributeError("not picklable")


def test_isinstance_of_the_stdlib_classes():
    q, jq, sq = mpr.Queue(), mpr.JoinableQueue(), mpr.SimpleQueue()
    a, b = mpr.Pipe()
    assert isinstance(q, multiprocessing.queues.Queue) and isinstance(jq, multiprocessing.queues.Queue)
    assert isinstance(jq, multiprocessing.queues.JoinableQueue)
    assert isinstance(sq, multiprocessing.queues.SimpleQueue)
    assert isinstance(a, multiprocessing.connection.Connection) and isinstance(sq._reader, type(a))
    for chan in (q, jq, sq, a, b):
        chan.close()


def test_put_of_an_unpicklable_object_raises_and_gives_its_slot_back():
    q = mpr.Queue(maxsize=1)
    with pytest.raises(AttributeError, match="not picklable"):
        q.put(Unpicklable())
    q.put_nowait(1)  # the slot the failed put took is free again
    assert q.get(timeout=60) == 1
    q.close()


class StaticHookQueue(mpr.Queue):
    """The stdlib's pattern (bpo-30006): a subclass overrides the hook as a staticmethod."""

    errors = []

    @staticmethod
    def _on_queue_feeder_error(e, obj):
        StaticHookQueue.errors.append((e, obj))


class MethodHookQueue(mpr.JoinableQueue):
    def _on_queue_feeder_error(self, e, obj):
        self.errors.append((e, obj))


@pytest.mark.parametrize("cls", [StaticHookQueue, MethodHookQueue])
def test_a_subclass_feeder_error_hook_is_called_instead_of_the_raise(cls):
    q = cls(maxsize=1)
    q.errors = cls.errors = []
    bad = Unpicklable()
    q.put(bad)  # no raise: the hook gets it and the item is dropped, as with the stdlib's feeder
    [(e, obj)] = q.errors
    assert isinstance(e, AttributeError) and obj is bad
    q.put_nowait(np.arange(3))  # its slot was given back; the queue goes on
    assert q.get(timeout=60).tolist() == [0, 1, 2]
    q.close()


def test_wait_and_select_take_our_connections_and_queue_readers():
    q, sq = mpr.Queue(), mpr.SimpleQueue()
    a, b = mpr.Pipe()
    readers = [a, q._reader, sq._reader]
    assert multiprocessing.connection.wait(readers, timeout=0) == []
    b.send(np.ones(10))
    q.put(np.ones(100_000))
    sq.put(1)
    for ready in (multiprocessing.connection.wait(readers, timeout=60), select.select(readers, [], [], 60)[0]):
        assert set(ready) == set(readers)
    assert a.recv().sum() == 10 and q.get(timeout=60).sum() == 100_000 and sq.get() == 1
    for chan in (q, sq, a, b):
        chan.close()


def test_channels_collected_in_a_cycle_warn_nothing():
    # the stdlib's connections are bare descriptors: the collector closes them silently; ours too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cycle = [mpr.Queue(), mpr.JoinableQueue(), mpr.SimpleQueue(), *mpr.Pipe(), *mpr.Pipe(duplex=False)]
        cycle.append(cycle)
        del cycle
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def get_one(q):
    q.get()


def test_getters_killed_right_after_receiving_leave_no_slot_taken():
    # Each getter is SIGKILLed as soon as its message has left the socket: it
    # is then still copying the 64 MiB pickle out of its spill segment, past
    # the receive and before the message is unpickled. The slot must be free
    # anyway: maxsize such kills once left put() blocked forever.
    ctx = multiprocessing.get_context("fork")
    rounds = 3
    q = mpr.Queue(maxsize=rounds)
    for _ in range(rounds):
        q.put(b"x" * (64 << 20))
        p = ctx.Process(target=get_one, args=(q,))
        p.start()
        while not q.empty() and p.exitcode is None:  # until the getter has taken the message off the socket
            pass
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    assert q.qsize() == 0
    for i in range(rounds):
        q.put_nowait(i)
    with pytest.raises(queue.Full):
        q.put_nowait(rounds)
    assert [q.get(timeout=60) for _ in range(rounds)] == list(range(rounds))
    q.close()


@pytest.mark.parametrize("cls", [mpr.Queue, mpr.JoinableQueue])
def test_close_of_an_unused_queue_only_marks_it_closed_as_the_stdlibs(cls):
    # CPython 3.13.x / 3.14's test_closed_queue_empty_exceptions: the stdlib's close() closes the ends only once a
    # put started the feeder; after that, empty() raises OSError
    for q in (cls(), multiprocessing.get_context().Queue()):
        q.close()
        q.join_thread()
        assert q.empty()
        with pytest.raises(ValueError, match="is closed"):
            q.put(1)
    for q in (cls(), multiprocessing.get_context().Queue()):
        q.put("foo")
        q.close()
        q.join_thread()
        with pytest.raises(OSError, match="is closed"):
            q.empty()
