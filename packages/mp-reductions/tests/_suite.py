"""The cross-process suite, bound to a start method by test_queues_<method>.py."""

import errno
import os
import signal
import socket
import time

import _targets
import mp_reductions as mpr
import numpy as np
import pytest
from _views import via_shared_memory


class QueueSuite:
    method = None

    @pytest.fixture
    def ctx(self):
        import multiprocessing

        return multiprocessing.get_context(self.method)

    def test_shared_array_and_view_filled_by_child(self, ctx, strategy):
        x = mpr.zeros_shared((5, 5), np.float32)
        q, done = mpr.Queue(), mpr.Queue()
        q.put(x)
        q.put(x[:, 1])
        p = ctx.Process(target=_targets.fill_from_queue, args=(q, done, 4))
        p.start()
        assert done.get(timeout=60) == "ok"
        p.join(30)
        assert p.exitcode == 0
        assert (x == 4).all() and (x[:, 1] == 4).all()

    def test_same_shared_array_twice_arrives_over_one_memory(self, ctx, strategy):
        q = mpr.Queue()
        p = ctx.Process(target=_targets.send_twice, args=(q, strategy))
        p.start()
        a, b = q.get(timeout=60), q.get(timeout=60)
        p.join(30)
        assert p.exitcode == 0
        assert a.tolist() == list(range(100))
        a[0] = -1
        assert b[0] == -1  # same memory

    def test_sender_exits_right_after_put_of_1000_arrays(self, ctx, strategy):
        q = mpr.Queue()
        p = ctx.Process(target=_targets.put_many_and_exit, args=(q, 1000, strategy, 10_000))
        p.start()
        got = [q.get(timeout=60) for _ in range(1000)]
        p.join(30)
        assert p.exitcode == 0
        assert [int(a[0]) for a in got] == list(range(1000))
        assert all(via_shared_memory(a) and a.shape == (10_000,) for a in got)

    def test_hogwild_updates_in_place(self, ctx, strategy):
        params = mpr.share_memory({"w": np.zeros(10), "b": np.zeros(4)})
        lock = ctx.Lock()
        ps = [ctx.Process(target=_targets.hogwild, args=(params, i, 50, lock)) for i in range(4)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(60)
        assert [p.exitcode for p in ps] == [0] * 4
        assert (params["w"] == 200).all() and (params["b"] == 50).all()

    def test_pipe_roundtrip_returns_shared_views(self, ctx, strategy):
        a, b = mpr.Pipe()
        p = ctx.Process(target=_targets.roundtrip_pipe, args=(b,))
        p.start()
        x = mpr.zeros_shared((3, 4), np.int16)
        big = np.arange(50_000, dtype=np.float64)
        a.send([x, big, {"small": np.arange(5)}])
        x2, big2, d = a.recv()
        x2[1, 1] = 9
        assert x[1, 1] == 9 and (big2 == big).all() and d["small"].tolist() == [0, 1, 2, 3, 4]
        a.send(None)
        p.join(30)
        assert p.exitcode == 0
        b.close()
        a.close()

    def test_many_shared_arrays_from_child(self, ctx, strategy):
        q = mpr.Queue()
        p = ctx.Process(target=_targets.send_shared_many, args=(q, 300, strategy))
        p.start()
        got = []
        while (a := q.get(timeout=60)) is not None:
            got.append(a)
        p.join(30)
        assert p.exitcode == 0
        assert [a[0] for a in got] == list(range(300))

    def test_process_argument_shares_memory(self, ctx, strategy):
        x = mpr.zeros_shared((1000,), np.int64)
        p = ctx.Process(target=_targets.write_inherited, args=(x,))
        p.start()
        p.join(30)
        assert p.exitcode == 0 and (x == 42).all()

    def test_stdlib_queue_shares_by_name_and_copies_descriptors(self, ctx, strategy):
        # a channel we do not own (Note [channels we do not own]): named segments travel by name, a memfd one as
        # a copy in the pickle (its sender may be gone before the receiver could ask for the descriptor)
        x = mpr.zeros_shared((100,), np.float64)
        x[:] = 1
        q, out = ctx.Queue(), ctx.Queue()
        q.put(x)
        p = ctx.Process(target=_targets.get_and_report, args=(q, out))
        p.start()
        pid, total, shared = out.get(timeout=60)
        p.join(30)
        assert (pid, total, shared) == (p.pid, 100.0, strategy == "file_system")
        q.close()
        out.close()
        q.join_thread()
        out.join_thread()

    @pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
    @pytest.mark.parametrize("n", [16, 100_000, 1 << 20], ids=["small", "large", "8MiB"])
    def test_arrays_as_process_arguments(self, ctx, strategy, shared, n):
        # issue 24: a plain array of 64 KiB or more killed spawn and forkserver children (its temporary segment's
        # descriptor was closed before the launcher passed it)
        a = mpr.empty_shared(n) if shared else np.empty(n)
        a[:] = np.arange(n)
        out = mpr.Queue()
        ps = [ctx.Process(target=_targets.report_and_write, args=(a, a[1:], {"a": a}, out)) for _ in range(2)]
        for p in ps:
            p.start()
        got = [out.get(timeout=60) for _ in ps]
        for p in ps:
            p.join(30)
        assert [p.exitcode for p in ps] == [0, 0]
        total = float(n * (n - 1) // 2)
        assert got == [(total, total, total)] * 2
        # a shared array's writes are seen here; a plain one travelled as a copy (fork: inherited)
        assert a[0] == (-1 if shared else 0)
        out.close()

    @pytest.mark.parametrize("kind", ["Pipe", "Queue"])
    @pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
    @pytest.mark.parametrize("n", [16, 100_000], ids=["small", "large"])
    def test_stdlib_channels_keep_arrays_whose_sender_exited(self, ctx, strategy, kind, shared, n):
        # issue 24: after import arraymp, an array sent on the stdlib's Pipe or Queue by a child that then exited
        # was lost (FileNotFoundError, ConnectionRefusedError): its descriptor was served by the dead sender
        if kind == "Pipe":
            recv_end, send_end = ctx.Pipe(duplex=False)
        else:
            recv_end = send_end = ctx.Queue()
        p = ctx.Process(target=_targets.send_on_stdlib_channel, args=(send_end, kind, strategy, shared, n))
        p.start()
        p.join(0.5)  # the child exits first where the message fits the pipe (always, when it is a handle)
        got = recv_end.recv() if kind == "Pipe" else recv_end.get(timeout=60)
        p.join(30)
        assert p.exitcode == 0
        assert got.tolist() == list(range(n))
        recv_end.close()
        if kind == "Pipe":
            send_end.close()
        else:
            recv_end.join_thread()

    def test_consumer_killed_mid_stream_blocks_no_one(self, ctx, strategy):
        # under file_system, shm_manager's daemon gives back the killed consumer's count
        # (the leak check then finds nothing left)
        q, out = mpr.Queue(), mpr.Queue()
        for _ in range(3):
            q.put(np.ones(100_000))
        p = ctx.Process(target=_targets.get_and_report, args=(q, out, 60))
        p.start()
        out.get(timeout=60)
        os.kill(p.pid, signal.SIGKILL)  # while it holds the array
        p.join(30)
        assert q.get(timeout=10).sum() == 100_000  # the others go on
        assert q.get(timeout=10).sum() == 100_000

    def test_file_system_segment_lives_while_in_flight_then_goes(self, ctx):
        mpr.set_sharing_strategy("file_system")
        try:
            before = set(os.listdir("/dev/shm"))
            q = mpr.Queue()
            q.put(np.arange(100_000.0))
            (name,) = {n for n in os.listdir("/dev/shm") if n.startswith("arraymp_")} - before
            assert os.path.exists(f"/dev/shm/{name}")  # in flight: nobody holds it but the message
            out = mpr.Queue()
            p = ctx.Process(target=_targets.get_and_report, args=(q, out))
            p.start()
            _, total, shared = out.get(timeout=60)
            p.join(30)
            assert total == sum(range(100_000)) and shared
            deadline = time.monotonic() + 5
            while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not os.path.exists(f"/dev/shm/{name}")
        finally:
            mpr.set_sharing_strategy("file_descriptor")

    @pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "Pipe"])
    def test_receiver_short_of_descriptors_keeps_the_message(self, ctx, kind, strategy):
        # 6 arrays of 128 KiB, one segment each: one descriptor each (file_descriptor), or a named file that the
        # receiver must open (file_system: issue 20, the item was lost); the child has 2 descriptors free
        arrays = [mpr.zeros_shared((16384,), np.float64) for _ in range(6)]
        for i, a in enumerate(arrays):
            a[:] = i
        out = mpr.Queue()
        if kind == "Pipe":
            chan, send_end = mpr.Pipe()
            send_end.send(arrays)
        else:
            chan = getattr(mpr, kind)()
            chan.put(arrays)
        p = ctx.Process(target=_targets.receive_short_of_descriptors, args=(kind, chan, out))
        p.start()
        (code, message, limit), got = out.get(timeout=60)
        p.join(30)
        assert p.exitcode == 0
        assert code == errno.EMFILE, message
        assert f"{limit} (RLIMIT_NOFILE)" in message and "ulimit -n" in message, message
        assert got == [(float(i), float(i), True) for i in range(6)], got  # the same message, whole
        assert not (chan.poll(0) if kind == "Pipe" else not chan.empty())  # and only once
        chan.close()
        if kind == "Pipe":
            send_end.close()

    def test_reader_short_of_descriptors_leaves_the_message_to_another(self, ctx):
        arrays = [mpr.zeros_shared((16384,), np.float64) for _ in range(6)]
        for i, a in enumerate(arrays):
            a[:] = i
        q, out = mpr.Queue(), mpr.Queue()
        q.put(arrays)
        p = ctx.Process(target=_targets.receive_short_of_descriptors, args=("Queue", q, out, False))
        p.start()
        (code, message, _), _ = out.get(timeout=60)
        p.join(30)
        assert p.exitcode == 0
        assert code == errno.EMFILE, message
        got = q.get(timeout=10)  # this process, another reader of the same queue, gets it whole
        assert [(a.min(), a.max()) for a in got] == [(i, i) for i in range(6)]
        assert q.empty()

    def test_default_socket_timeout_is_ignored(self, ctx):
        # the stdlib's queues ignore socket.setdefaulttimeout(); so must ours, in the parent and in the child
        socket.setdefaulttimeout(0.5)
        try:
            q, sq, inbox, out = mpr.Queue(), mpr.SimpleQueue(), mpr.Queue(), mpr.Queue()
            a, b = mpr.Pipe()
            p = ctx.Process(target=_targets.wait_under_default_timeout, args=(q, sq, inbox, out))
            p.start()
            inbox.put(b)
            assert out.get(timeout=60) == "waiting"
            for put in (lambda: a.send(np.ones(1000)), lambda: q.put(np.ones(100_000)), lambda: sq.put(np.ones(10))):
                time.sleep(1)  # each receive in the child waits twice the default timeout (not a synchronization)
                put()
            got = out.get(timeout=60)
            assert got == [1000.0, 100_000.0, 10.0], got
            p.join(30)
            assert p.exitcode == 0
            for chan in (q, sq, inbox, out, a, b):
                chan.close()
        finally:
            socket.setdefaulttimeout(None)
