"""Value semantics on every channel, bound to a start method by test_values_<method>.py (issue 42, items 1 and 2):
what a plain numpy program sees with the stdlib, it sees with mp_reductions: a result or a received copy is the
receiver's own (what one process writes never reaches another, however often it is forwarded: _shared Note [own
arrays]); memory shared on purpose stays shared everywhere; every array arrives in the memory order pickle gives it
(_arrays Note [copies keep their order])."""

import pickle

import _values_targets as T
import mp_reductions as mpr
import numpy as np
import pytest
from _views import via_shared_memory

TIMEOUT = 60


def stdlib_layout(a: np.ndarray):
    return T.layout(pickle.loads(pickle.dumps(a)))


class ValuesSuite:
    method: str

    @pytest.fixture
    def ctx(self):
        import multiprocessing

        return multiprocessing.get_context(self.method)

    # -- a result handed on keeps the caller's value (item 1) ------------------------------------------------
    def test_a_pool_result_handed_to_later_tasks_keeps_its_value(self, ctx, strategy):
        with mpr.Pool(2, context=ctx) as pool:
            r = pool.apply(T.fresh, (4,))
            # it moved with no copy, yet it is the caller's own: not shared, as the stdlib's result is not
            assert (r == 4).all() and not mpr.is_shared(r)
            if strategy == "file_descriptor":
                assert via_shared_memory(r)
            assert pool.apply(T.add_in_place, (r,)) == 104.0
            assert pool.map(T.add_in_place, [r, r]) == [104.0, 104.0]
            assert pool.starmap(T.add_in_place, [(r, 1.0)]) == [5.0]
            assert list(pool.imap(T.add_in_place, [r])) == [104.0]
            assert list(pool.imap_unordered(T.add_in_place, [r], chunksize=1)) == [104.0]
            back = pool.apply(T.identity, (r,))  # a round trip is a copy too
            back += 1
            assert (r == 4).all() and (back == 5).all()

    def test_a_result_sent_on_a_queue_or_pipe_keeps_its_value(self, ctx, strategy):
        with mpr.Pool(1, context=ctx) as pool:
            r = pool.apply(T.fresh, (4,))
        q, out = mpr.Queue(ctx=ctx), mpr.SimpleQueue(ctx=ctx)
        p = ctx.Process(target=T.get_write_report, args=(q, out))
        p.start()
        q.put(r)
        assert out.get() == 104.0
        p.join(TIMEOUT)
        assert p.exitcode == 0 and (r == 4).all()
        a, b = mpr.Pipe()
        a.send(r)
        got = b.recv()
        got += 1
        assert (r == 4).all() and (got == 5).all() and not mpr.is_shared(got)
        a.close()
        b.close()

    def test_a_copy_forwarded_twice_is_each_receivers_own(self, ctx, strategy):
        # A -> B -> C: C's write never reaches B, B's later write never reaches C (the stdlib: a pickle each hop)
        x = np.full(T.N, 1.0)
        q1, q2, out = mpr.Queue(ctx=ctx), mpr.Queue(ctx=ctx), mpr.Queue(ctx=ctx)
        written, rewritten = ctx.Event(), ctx.Event()
        b = ctx.Process(target=T.forward, args=(q1, q2, written, rewritten, out))
        c = ctx.Process(target=T.receive_and_write, args=(q2, written, rewritten, out))
        b.start()
        c.start()
        q1.put(x)
        x += 10.0  # the sender's write after the send reaches no one
        got = dict(out.get(timeout=TIMEOUT) for _ in range(2))
        for p in (b, c):
            p.join(TIMEOUT)
            assert p.exitcode == 0
        assert got == {"B": 1.0, "C": 101.0}

    def test_an_executor_result_handed_on_keeps_its_value(self, ctx, strategy):
        with mpr.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            r = ex.submit(T.fresh, 4).result(TIMEOUT)
            assert ex.submit(T.add_in_place, r).result(TIMEOUT) == 104.0
            assert list(ex.map(T.add_in_place, [r])) == [104.0]
        assert (r == 4).all()

    # -- memory shared on purpose stays shared -----------------------------------------------------------------
    def test_shared_on_purpose_stays_shared_however_often_forwarded(self, ctx, strategy):
        s = mpr.zeros_shared(T.N)
        with mpr.Pool(2, context=ctx) as pool:
            back = pool.apply(T.identity, (s,))  # received from a shared array: shared
            assert mpr.is_shared(back)
            pool.apply(T.add_in_place, (back,))
            assert s[0] == 100.0 and back[0] == 100.0
            again = pool.apply(T.identity, (back,))
            pool.apply(T.add_in_place, (again, 1.0))
            assert s[0] == 101.0

    # -- memory order (item 2) -----------------------------------------------------------------------------------
    def test_fortran_arrays_arrive_in_fortran_order_on_every_channel(self, ctx, strategy):
        f = np.asfortranarray(np.arange(600 * 500, dtype=np.float64).reshape(600, 500))  # 2.4 MB: copied
        small = np.asfortranarray(np.arange(60 * 50, dtype=np.float64).reshape(60, 50))  # inline
        strided = np.arange(600 * 1000, dtype=np.float64).reshape(600, 1000)[:, ::2]  # neither: C, as pickle
        for a in (f, small, strided, mpr.share_memory(f.copy(order="F"))):
            want = stdlib_layout(a)
            q, sq = mpr.Queue(ctx=ctx), mpr.SimpleQueue(ctx=ctx)
            q.put(a)
            assert T.layout(q.get(timeout=TIMEOUT)) == want
            q.put([a])
            assert T.layout(q.get(timeout=TIMEOUT)[0]) == want
            sq.put(a)
            assert T.layout(sq.get()) == want
            q.close()
            sq.close()
            parent, child = mpr.Pipe()
            p = ctx.Process(target=T.pipe_layout, args=(child,))
            p.start()
            parent.send(a)
            assert parent.recv() == want
            parent.send([a])
            assert parent.recv() == want
            p.join(TIMEOUT)
            parent.close()
            child.close()
        with mpr.Pool(1, context=ctx) as pool:
            assert pool.apply(T.layout, (f,)) == stdlib_layout(f)  # an argument
            assert pool.map(T.layout, [f, small]) == [stdlib_layout(f), stdlib_layout(small)]
            moved, kept = pool.apply(T.fresh_fortran, (1,)), pool.apply(T.kept_fortran, (1,))  # results
            assert T.layout(moved) == stdlib_layout(T.fresh_fortran(1))
            assert T.layout(kept) == stdlib_layout(T.kept_fortran(1))
            assert T.layout(pool.apply(T.identity, (f,))) == stdlib_layout(f)  # there and back
