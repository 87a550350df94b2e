"""Several faults in one call (issue 41), bound to a start method by test_faults_<method>.py: two or more worker
deaths, or two or more tasks past their limit, in one map / map_async / starmap / imap / imap_unordered, in one
batch of apply_async, and in the executor's map and submit. Every call returns or raises, nothing hangs, the pool
goes on, and close/join end promptly. Also: a task whose own SIGTERM handler raises or ignores the pool's SIGTERM
still fails with TaskTimeoutError alone (watchdog Note [task timeouts], clock Note [task clock]), and a helper
thread that fails breaks the pool loudly (core Note [helper threads])."""

import concurrent.futures
import logging
import multiprocessing
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import _pool_targets as T
import mp_reductions as mpr
import pytest
from mp_reductions._pool import core as core_module
from mp_reductions._pool.handlers import ResultHandler
from mp_reductions._pool.watchdog import Watchdog

TIMEOUT = 60  # a hang check: far above any delay of a loaded machine
ENDS = 10  # seconds close/join (and shutdown) may take once the work is done: the 5, doubled for CI's load
N = 12
SQUARES = [x * x for x in range(N)]


def ends_promptly(fn, *args):
    """``fn(*args)`` returns within ENDS seconds (a hang check, run in a thread so that a hang fails the test)."""
    done = threading.Event()
    error = []

    def run():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            error.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(ENDS), f"{getattr(fn, '__qualname__', fn)} did not return within {ENDS} s"
    if error:
        raise error[0]


def drain(iterator):
    """Every item of a pool iterator as (value, None) or (None, error), each within TIMEOUT."""
    out = []
    while True:
        try:
            out.append((iterator.next(TIMEOUT), None))
        except StopIteration:
            return out
        except multiprocessing.TimeoutError:
            pytest.fail(f"an item never came: {len(out)} of {N}")
        except Exception as e:
            out.append((None, e))


class FaultsSuite:
    method = None

    @pytest.fixture
    def ctx(self):
        return multiprocessing.get_context(self.method)

    def _closes(self, pool):
        assert pool.map(T.square, range(N)) == SQUARES  # it goes on
        pool.close()
        ends_promptly(pool.join)

    @pytest.mark.parametrize("chunksize", [1, 2])
    @pytest.mark.parametrize("call", ["map", "map_async", "starmap"])
    def test_several_deaths_in_one_map(self, ctx, call, chunksize):
        with mpr.Pool(3, context=ctx) as pool:
            errors = []
            if call == "map":
                with pytest.raises(mpr.WorkerLostError) as info:
                    pool.map(T.dies_on_victims, range(N), chunksize=chunksize)
                assert info.value.signal_name == "SIGKILL"
                assert info.value.index in {x // chunksize for x in T.VICTIMS}
            elif call == "starmap":
                with pytest.raises(mpr.WorkerLostError):
                    pool.starmap(T.dies_on_victims_star, [(x, 0) for x in range(N)], chunksize=chunksize)
            else:
                r = pool.map_async(T.dies_on_victims, range(N), chunksize=chunksize, error_callback=errors.append)
                with pytest.raises(mpr.WorkerLostError):
                    r.get(TIMEOUT)
                assert len(errors) == 1 and not r.successful()
            self._closes(pool)

    @pytest.mark.parametrize("call", ["imap", "imap_unordered"])
    def test_several_deaths_in_one_imap(self, ctx, call):
        with mpr.Pool(3, context=ctx) as pool:
            got = drain(getattr(pool, call)(T.dies_on_victims, range(N)))
            lost = [e for _, e in got if e is not None]
            assert len(got) == N and len(lost) == len(T.VICTIMS)
            assert all(isinstance(e, mpr.WorkerLostError) and e.signal_name == "SIGKILL" for e in lost)
            assert sorted(e.index for e in lost) == list(T.VICTIMS)  # each victim's own task, no other
            values = [v for v, e in got if e is None]
            assert sorted(values) == [x * x for x in range(N) if x not in T.VICTIMS]
            if call == "imap":  # in order
                assert [e is not None for _, e in got] == [x in T.VICTIMS for x in range(N)]
            self._closes(pool)

    def test_several_deaths_among_apply_asyncs(self, ctx):
        with mpr.Pool(3, context=ctx) as pool:
            results = [pool.apply_async(T.dies_on_victims, (x,)) for x in range(N)]
            for x, r in enumerate(results):
                if x in T.VICTIMS:
                    with pytest.raises(mpr.WorkerLostError, match="task 0 of apply"):
                        r.get(TIMEOUT)
                else:
                    assert r.get(TIMEOUT) == x * x
            self._closes(pool)

    @pytest.mark.parametrize("call", ["map", "starmap", "imap", "imap_unordered", "apply_async"])
    def test_several_timeouts_in_one_call(self, ctx, call):
        with mpr.Pool(2, context=ctx, task_timeout=0.5) as pool:
            if call in ("map", "starmap"):
                with pytest.raises(mpr.TaskTimeoutError) as info:
                    if call == "map":
                        pool.map(T.hangs_on_victims, range(N), chunksize=1)
                    else:
                        pool.starmap(T.hangs_on_victims, [(x,) for x in range(N)], chunksize=1)
                assert info.value.index in T.VICTIMS
            else:
                if call == "apply_async":
                    results = [pool.apply_async(T.hangs_on_victims, (x,)) for x in range(N)]
                    got = []
                    for r in results:
                        try:
                            got.append((r.get(TIMEOUT), None))
                        except mpr.TaskTimeoutError as e:
                            got.append((None, e))
                else:
                    got = drain(getattr(pool, call)(T.hangs_on_victims, range(N)))
                timed = [e for _, e in got if e is not None]
                assert len(got) == N and len(timed) == len(T.VICTIMS)
                assert all(isinstance(e, mpr.TaskTimeoutError) for e in timed), timed
                assert sorted(v for v, e in got if e is None) == [x * x for x in range(N) if x not in T.VICTIMS]
            self._closes(pool)

    def test_deaths_and_timeouts_together(self, ctx):
        with mpr.Pool(3, context=ctx, task_timeout=0.5) as pool:
            dying = pool.imap_unordered(T.dies_on_victims, range(N))
            hanging = [pool.apply_async(T.hangs_on_victims, (x,)) for x in T.VICTIMS]
            assert sum(e is not None for _, e in drain(dying)) == len(T.VICTIMS)
            for r in hanging:
                with pytest.raises(mpr.TaskTimeoutError):
                    r.get(TIMEOUT)
            self._closes(pool)

    def test_executor_map_and_submit_with_several_deaths(self, ctx):
        ex = mpr.ProcessPoolExecutor(3, mp_context=ctx)
        with pytest.raises(BrokenProcessPool):
            list(ex.map(T.dies_on_victims, range(N), timeout=TIMEOUT))
        ends_promptly(ex.shutdown)
        ex = mpr.ProcessPoolExecutor(3, mp_context=ctx)
        futures = [ex.submit(T.dies_on_victims, x) for x in range(N)]
        done, not_done = concurrent.futures.wait(futures, TIMEOUT)
        assert not not_done
        for x, f in enumerate(futures):
            if x in T.VICTIMS:  # (a call the breakage failed before it ran fails too)
                assert isinstance(f.exception(), BrokenProcessPool)
            else:
                assert f.exception() is None and f.result() == x * x or isinstance(f.exception(), BrokenProcessPool)
        with pytest.raises(BrokenProcessPool):
            ex.submit(T.square, 2)
        ends_promptly(ex.shutdown)

    def test_executor_map_and_submit_with_several_timeouts(self, ctx):
        with mpr.ProcessPoolExecutor(2, mp_context=ctx, task_timeout=0.5) as ex:
            with pytest.raises(mpr.TaskTimeoutError):
                list(ex.map(T.hangs_on_victims, range(N), timeout=TIMEOUT))
            futures = [ex.submit(T.hangs_on_victims, x) for x in range(N)]
            for x, f in enumerate(futures):
                if x in T.VICTIMS:
                    assert isinstance(f.exception(TIMEOUT), mpr.TaskTimeoutError)
                else:
                    assert f.result(TIMEOUT) == x * x
            assert ex.submit(T.square, 3).result(TIMEOUT) == 9  # not broken
            ends_promptly(ex.shutdown)

    @pytest.mark.parametrize("ignore", [False, True], ids=["raises", "ignores"])
    def test_a_tasks_own_sigterm_handler_still_times_out_alone(self, ctx, ignore):
        # the task's handler raised (or ignored the signal): its worker took the next task, and the SIGKILL meant
        # for the first killed that one, "blamed" on the OOM killer or an outsider
        for pool_or_executor in ("pool", "executor"):
            if pool_or_executor == "pool":
                pool = mpr.Pool(1, context=ctx, task_timeout=0.5)
                stuck = pool.apply_async(T.graceful_nap, (60, ignore))
                nexts = [pool.apply_async(T.nap, (0.6,)) for _ in range(3)]
                get = lambda r: r.get(TIMEOUT)  # noqa: E731
            else:
                pool = mpr.ProcessPoolExecutor(1, mp_context=ctx, task_timeout=0.5)
                stuck = pool.submit(T.graceful_nap, 60, ignore)
                nexts = [pool.submit(T.nap, 0.6) for _ in range(3)]
                get = lambda f: f.result(TIMEOUT)  # noqa: E731
            with pytest.raises(mpr.TaskTimeoutError) as info:
                get(stuck)
            assert "graceful_nap" in str(info.value)
            for r in nexts:  # each runs 0.6 s, past the limit too: each one times out alone, none is lost
                with pytest.raises(mpr.TaskTimeoutError) as info:
                    get(r)
                assert "nap(0.6)" in str(info.value), str(info.value)
                assert "OOM" not in str(info.value) and "outside" not in str(info.value)
            if pool_or_executor == "pool":
                assert pool.apply_async(T.square, (3,)).get(TIMEOUT) == 9
                pool.close()
                ends_promptly(pool.join)
            else:
                assert pool.submit(T.square, 3).result(TIMEOUT) == 9
                ends_promptly(pool.shutdown)


class Broke(RuntimeError):
    pass


class HelperThreadsSuite:
    """A helper thread that fails breaks the pool loudly: every pending result fails with PoolBrokenError (the
    failure its cause), new work is refused with it, the failure is logged, and close/join/terminate end."""

    method = None

    @pytest.fixture
    def ctx(self):
        return multiprocessing.get_context(self.method)

    @pytest.fixture
    def logged(self):
        records = []
        handler = logging.Handler(logging.CRITICAL)
        handler.emit = records.append
        log = logging.getLogger("mp_reductions.pool")
        log.addHandler(handler)
        yield records
        log.removeHandler(handler)

    def _check_broken(self, pool, pending, logged, thread):
        for r in pending:
            with pytest.raises(mpr.PoolBrokenError, match=f"the pool's {thread} thread failed") as info:
                r.get(TIMEOUT)
            assert isinstance(info.value.__cause__, Broke)
        with pytest.raises(mpr.PoolBrokenError) as info:
            pool.apply_async(T.square, (2,))
        assert isinstance(info.value.__cause__, Broke)
        assert any(thread in r.getMessage() and r.exc_info and r.exc_info[0] is Broke for r in logged), logged
        pool.close()
        ends_promptly(pool.join)
        ends_promptly(pool.terminate)

    def test_the_result_handler(self, ctx, monkeypatch, logged):
        calls = []

        def deliver(self, *args):
            calls.append(1)
            if len(calls) == 3:
                raise Broke("injected into the result handler")
            return original(self, *args)

        original = ResultHandler.deliver
        monkeypatch.setattr(ResultHandler, "deliver", deliver)
        pool = mpr.Pool(2, context=ctx)
        pending = [pool.map_async(T.nap, [0.05] * 8, chunksize=1), pool.apply_async(T.nap, (1,))]
        self._check_broken(pool, pending, logged, "result handler")

    def test_the_task_handler(self, ctx, monkeypatch, logged):
        def handle_tasks(core):
            core.taskqueue.get()  # the first call's tasks, never sent
            raise Broke("injected into the task handler")

        monkeypatch.setattr(core_module, "handle_tasks", handle_tasks)
        pool = mpr.Pool(2, context=ctx)
        self._check_broken(pool, [pool.map_async(T.square, range(4))], logged, "task handler")

    def test_the_worker_handler(self, ctx, monkeypatch, logged):
        def death(self, w):
            raise Broke("injected into the worker handler")

        monkeypatch.setattr(Watchdog, "death", death)
        pool = mpr.Pool(2, context=ctx)
        pending = [pool.apply_async(T.die), pool.apply_async(T.nap, (30,))]  # a death: the worker handler records it
        self._check_broken(pool, pending, logged, "worker handler")

    def test_the_watchdog(self, ctx, monkeypatch, logged):
        def time_out(self, now_ns):
            raise Broke("injected into the watchdog")

        monkeypatch.setattr(Watchdog, "_time_out", time_out)
        pool = mpr.Pool(2, context=ctx, task_timeout=5)
        self._check_broken(pool, [pool.apply_async(T.nap, (30,))], logged, "watchdog")

    def test_the_executors_closer(self, ctx, monkeypatch, logged):
        def join(self):
            raise Broke("injected into the closer")

        ex = mpr.ProcessPoolExecutor(2, mp_context=ctx)
        assert ex.submit(T.square, 3).result(TIMEOUT) == 9
        workers = list(ex._processes.values())
        monkeypatch.setattr(core_module.Core, "join", join)
        ends_promptly(ex.shutdown)  # the closer failed: logged, the pool torn down all the same, shutdown ends
        assert any("closer" in r.getMessage() and r.exc_info[0] is Broke for r in logged), logged
        deadline = time.monotonic() + ENDS
        while any(w.is_alive() for w in workers):
            assert time.monotonic() < deadline, "the workers outlived a failed closer"
            time.sleep(0.02)
        with pytest.raises(RuntimeError):
            ex.submit(T.square, 2)
