"""The cross-process suite, bound to a start method by test_queues_<method>.py."""

import os
import signal
import time

import _targets
import mp_reductions as mpr
import numpy as np
import pytest


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
        assert all(mpr.is_shared(a) and a.shape == (10_000,) for a in got)

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

    def test_stdlib_queue_shares_too(self, ctx, strategy):
        x = mpr.zeros_shared((100,), np.float64)
        x[:] = 1
        q, out = ctx.Queue(), ctx.Queue()
        q.put(x)
        p = ctx.Process(target=_targets.get_and_report, args=(q, out))
        p.start()
        pid, total, shared = out.get(timeout=60)
        p.join(30)
        assert (pid, total, shared) == (p.pid, 100.0, True)
        q.close()
        out.close()
        q.join_thread()
        out.join_thread()

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
