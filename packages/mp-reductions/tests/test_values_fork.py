import _values_targets as T
import mp_reductions as mpr
from _values_suite import TIMEOUT, ValuesSuite


class TestValuesFork(ValuesSuite):
    method = "fork"

    def test_a_fork_child_gets_received_arrays_copy_on_write(self, ctx, strategy):
        # what a process received (a moved result, a copy) is its own memory: a fork child writes its own copy
        with mpr.Pool(1, context=ctx) as pool:
            r = pool.apply(T.fresh, (4,))
        q = mpr.Queue(ctx=ctx)
        q.put(T.fresh(7))
        c = q.get(timeout=TIMEOUT)
        out = ctx.SimpleQueue()
        for a in (r, c):
            p = ctx.Process(target=T.fork_child_writes, args=(a, out))
            p.start()
            assert out.get() == float(a[0]) + 100.0
            p.join(TIMEOUT)
            assert p.exitcode == 0
        assert (r == 4).all() and (c == 7).all()
        # still sent as copies afterwards, by the parent and by a child of its own
        with mpr.Pool(1, context=ctx) as pool:
            assert pool.apply(T.add_in_place, (r,)) == 104.0 and (r == 4).all()

    def test_a_fork_child_shares_what_was_shared_on_purpose(self, ctx, strategy):
        s = mpr.zeros_shared(T.N)
        out = ctx.SimpleQueue()
        p = ctx.Process(target=T.fork_child_writes, args=(s, out))
        p.start()
        assert out.get() == 100.0
        p.join(TIMEOUT)
        assert s[0] == 100.0
