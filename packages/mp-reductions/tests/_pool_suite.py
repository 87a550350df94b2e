"""The Pool suite, bound to a start method by test_pool_<method>.py."""

import gc
import itertools
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import pool as mp_pool

import _pool_targets as T
import _views
import mp_reductions as mpr
import numpy as np
import pytest
import shm_manager
from _views import via_shared_memory
from mp_reductions import _stats
from mp_reductions._pool import wire, worker

TIMEOUT = 30


def shm_names(pids) -> set[str]:
    """Our named segments made by the processes ``pids`` (other programs' segments are not counted)."""
    pids = {str(p) for p in pids}
    return {n for n in os.listdir("/dev/shm") if n.startswith("arraymp_") and n.split("_")[3] in pids}


def assert_none_left(pids) -> None:
    """No named segment of ``pids`` left within 5 s (their daemon unlinks as the last count goes)."""
    deadline = time.monotonic() + 5
    while shm_names(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not shm_names(pids)


def memfd_mappings() -> int:
    """Distinct arraymp memfd segments mapped in this process."""
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "/memfd:arraymp" in line})


def wait_for_pid(slots, k=0) -> int:
    deadline = time.monotonic() + TIMEOUT
    while slots[k] == 0:
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.005)
    return int(slots[k])


def assert_prompt(fn, *args):
    """``fn`` returns without hanging (on a lost worker, or on tasks that sleep 60 s): a hang check,
    not a speed one, so the bound is far above any delay of a loaded machine."""
    t0 = time.monotonic()
    result = fn(*args)
    assert time.monotonic() - t0 < 20, f"{fn.__name__} waited for the blocked tasks"
    return result


class PoolSuite:
    method = None

    @pytest.fixture
    def ctx(self):
        return multiprocessing.get_context(self.method)

    @pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
    def test_arrays_as_initargs(self, ctx, strategy, shared):
        # issue 24: a plain array of 64 KiB or more in initargs crashed every spawn / forkserver worker, and the
        # pool respawned them forever
        a = mpr.empty_shared(1_000_000) if shared else np.empty(1_000_000)
        a[:] = np.arange(1_000_000)
        with mpr.Pool(2, initializer=T.keep, initargs=(a, np.arange(10)), context=ctx) as pool:
            assert pool.map(T.kept_sum, range(4)) == [float(a.sum()) + 45] * 4

    @pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
    @pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
    def test_workers_ended_as_they_start_leave_no_segment_of_their_initargs(self, ctx, strategy, shared):
        # core Note [launch counts]: a spawn / forkserver worker terminated before it unpickled its initargs left
        # their launch copy (a plain array) or their in-flight count (a shared one) until the group ended
        a = mpr.empty_shared(1_000_000) if shared else np.ones(1_000_000)
        for _ in range(3):
            pool = mpr.Pool(2, initializer=T.keep, initargs=(a,), context=ctx)
            pids = {os.getpid(), *(p.pid for p in pool._pool)}
            pool.terminate()  # at once: the workers are still starting
            pool.join()
            if not shared:
                assert_none_left(pids)
        if shared:  # and the shared one goes with its last holder
            seg = _views.segment_under(a)
            path = os.path.join(seg.dir, seg.name)
            del a, seg, pool  # (its processes keep their arguments, as the stdlib's)
            gc.collect()
            deadline = time.monotonic() + 5
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not os.path.exists(path)

    @pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
    def test_the_counts_kept_for_a_launch_go_back_as_its_worker_is_reaped(self, ctx, strategy):
        # core Note [launch counts]: the pool holds them for each live spawn / forkserver worker, and gives a killed
        # one's back as it reaps it, not when the pool ends; its replacement gets counts of its own
        a = np.ones(1_000_000)  # 8 MB: a launch copy of its own in each spawn / forkserver worker
        with mpr.Pool(2, initializer=T.keep, initargs=(a,), context=ctx) as pool:
            assert pool.map(T.kept_sum, range(4)) == [1_000_000.0] * 4
            live = {p.pid for p in pool._pool}
            kept = set(pool._core.launch_counts)
            assert kept == (set() if self.method == "fork" else live)
            victim = pool._pool[0].pid
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + TIMEOUT
            while victim in pool._core.launch_counts or len(pool._pool) < 2 or victim in {p.pid for p in pool._pool}:
                assert time.monotonic() < deadline, "the killed worker was never reaped and replaced"
                time.sleep(0.02)
            assert pool.map(T.kept_sum, range(4)) == [1_000_000.0] * 4
            pids = {os.getpid(), victim, *(p.pid for p in pool._pool)}
            if self.method != "fork":
                assert set(pool._core.launch_counts) == {p.pid for p in pool._pool}
        pool.join()
        assert not pool._core.launch_counts
        assert_none_left(pids)

    def test_a_large_heap_kept_by_tasks_costs_little_collection_time(self, ctx):
        # a worker's full collections (the module docstring) are spaced by their length: a heap of 300,000 objects
        # a task keeps alive took ~10 ms to collect, every 0.1 s (a tenth of the worker's time). The rule is
        # checked, not a share of time (a loaded machine stretches collections, not the tasks' spin): each one
        # starts at least min(cap, max(GC_INTERVAL, GC_SHARE x the last one's length)) after the last one ended.
        cap = 0.4  # GC_MAX_INTERVAL in the worker, so that 1.5 s of tasks see several collections
        with mpr.Pool(1, context=ctx) as pool:
            pool.apply(T.keep_a_large_heap, (300_000, cap))
            pool.map(T.spin, [0.01] * 150, chunksize=1)
            log = pool.apply(T.gc_log)
        pool.join()
        assert len(log) >= 3, log
        for (began, ended), (next_began, _) in itertools.pairwise(log):
            due = min(cap, max(worker.GC_INTERVAL, worker.GC_SHARE * (ended - began)))
            assert next_began - ended >= due, (log, due)
        assert any(worker.GC_SHARE * (ended - began) > worker.GC_INTERVAL for began, ended in log), log

    def test_workers_that_die_before_running_anything_stop_the_pool(self, ctx):
        # issue 24: an initializer that raises (or initargs a worker cannot unpickle) made the stdlib's Pool, and
        # ours, respawn crashing workers forever; now every task fails with WorkerStartError, the cause attached
        pool = mpr.Pool(2, initializer=T.fail, initargs=(7,), context=ctx)
        try:
            with pytest.raises(mpr.WorkerStartError, match="died before they could run a task") as info:
                pool.map_async(T.square, range(10)).get(TIMEOUT)  # (the stdlib's Pool: a TimeoutError)
            assert isinstance(info.value.__cause__, ValueError) and "bad 7" in str(info.value.__cause__)
            with pytest.raises(mpr.WorkerStartError):
                pool.apply_async(T.square, (1,)).get(TIMEOUT)
            with pytest.raises(mpr.WorkerStartError):
                pool.imap_unordered(T.square, range(3)).next(TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while pool._pool and time.monotonic() < deadline:  # every dead worker reaped, none replaced
                time.sleep(0.01)
            assert not pool._pool
            with pytest.raises(mpr.WorkerStartError):  # not the stdlib's ZeroDivisionError (a chunksize by 0 workers)
                pool.map(T.square, range(10))
            assert pickle_roundtrip(info.value).failures == info.value.failures >= 2
            pool.close()
            pool.join()
        finally:
            pool.terminate()

    def test_a_chunk_of_results_that_fits_only_one_by_one_arrives(self, ctx, mount_tmpfs, monkeypatch):
        # issue 24: a chunk's results went into one segment: 3 results of 3 MiB failed on an 8 MiB shm where each
        # fits. Copies that do not fit travel in the pickle, as the stdlib sends them.
        monkeypatch.setenv("ARRAYMP_SHM_DIR", str(mount_tmpfs("8m")))
        with mpr.Pool(1, initializer=T.share_results, initargs=("file_system",), context=ctx) as pool:
            got = pool.map(T.three_mib, range(3), chunksize=3)
        assert [(float(a[0]), float(a[-1]), a.nbytes) for a in got] == [(i, i, 3 << 20) for i in range(3)]

    def test_a_result_that_cannot_be_sent_says_why_first(self, ctx):
        # issue 24: MaybeEncodingError put its reason after the value's repr: a screenful of arrays
        with mpr.Pool(1, context=ctx) as pool:
            with pytest.raises(mp_pool.MaybeEncodingError) as info:
                pool.apply_async(T.arrays_and_a_lock, (ctx.get_start_method(),)).get(TIMEOUT)
        message = str(info.value)
        assert "Lock objects should only be shared between processes through inheritance" in message, message
        assert len(message) < 2000, message  # (the values' repr alone ran to 160 kB)

    def test_every_call_equals_a_serial_run(self, ctx):
        xs = list(range(40))
        with mpr.Pool(2, context=ctx) as pool:
            assert pool.map(T.square, xs) == [T.square(x) for x in xs]
            assert pool.map(T.square, xs, chunksize=7) == [T.square(x) for x in xs]
            assert pool.starmap(T.add, zip(xs, xs, strict=True)) == [T.add(x, x) for x in xs]
            assert list(pool.imap(T.square, xs)) == [T.square(x) for x in xs]
            assert list(pool.imap(T.square, xs, chunksize=3)) == [T.square(x) for x in xs]
            assert sorted(pool.imap_unordered(T.square, xs)) == [T.square(x) for x in xs]
            assert sorted(pool.imap_unordered(T.square, xs, chunksize=4)) == [T.square(x) for x in xs]
            assert pool.apply(T.add, (2, 3)) == 5
            got = []
            r = pool.map_async(T.square, xs, callback=got.append)
            assert r.get(TIMEOUT) == [T.square(x) for x in xs]
            assert pool.starmap_async(T.add, [(1, 2), (3, 4)]).get(TIMEOUT) == [3, 7]
            assert pool.apply_async(T.square, (9,)).get(TIMEOUT) == 81
            arrays = [np.full(50_000, i, np.float64) for i in range(6)]
            doubled = pool.map(T.double, arrays)
            assert all((d == 2 * a).all() and via_shared_memory(d) for d, a in zip(doubled, arrays, strict=True))
            bigs = list(pool.imap(T.big, range(4)))
            assert [float(b[0, 0]) for b in bigs] == [0, 1, 2, 3] and all(via_shared_memory(b) for b in bigs)
            with pytest.raises(ValueError, match="bad 3"):
                pool.apply(T.fail, (3,))
            errors = []
            pool.map_async(T.fail, [1], error_callback=errors.append).wait(TIMEOUT)
            assert isinstance(errors[0], ValueError)
        assert got == [[T.square(x) for x in xs]]
        pool.join()

    def test_a_closed_pool_joins_when_its_last_result_is_set(self, ctx):
        # the cache wakes the worker handler when it empties only once the pool is closed: a pool closed while
        # a task runs, or before its last result was set, must still join once that result is set
        for when in ("running", "done"):
            pool = mpr.Pool(2, context=ctx)
            nap = pool.apply_async(T.nap, (0.3 if when == "running" else 0,))
            if when == "done":
                nap.wait(TIMEOUT)
            pool.close()
            joiner = threading.Thread(target=pool.join, daemon=True)
            joiner.start()
            joiner.join(20)
            if joiner.is_alive():
                pool.terminate()
                pytest.fail(f"the pool closed with its last task {when} never joined")
            assert nap.get(0) == (0.3 if when == "running" else 0)

    def test_apply_results_wait_as_the_stdlibs(self, ctx):
        # an apply_async result's Event is a _Done (a lock held until set): ready / successful / wait / get with
        # and without timeouts, several threads waiting, callbacks run before waiters return, errors, as the stdlib's
        with mpr.Pool(2, context=ctx) as pool:
            got = []
            r = pool.apply_async(T.nap, (1.0,), callback=got.append)
            assert isinstance(r, mp_pool.ApplyResult) and not r.ready()
            with pytest.raises(ValueError, match="not ready"):
                r.successful()
            assert r.wait(0.05) is None and not r.ready()
            with pytest.raises(multiprocessing.TimeoutError):
                r.get(0)
            with pytest.raises(multiprocessing.TimeoutError):
                r.get(-1)
            seen = []
            waiters = [threading.Thread(target=lambda: seen.append((r.get(TIMEOUT), list(got)))) for _ in range(4)]
            waiters += [threading.Thread(target=lambda: seen.append((r.wait(TIMEOUT), r.ready()))) for _ in range(4)]
            for t in waiters:
                t.start()
            for t in waiters:
                t.join(TIMEOUT)
            assert sorted(seen, key=repr) == [(1.0, [1.0])] * 4 + [(None, True)] * 4
            assert r.ready() and r.successful() and r.get(0) == r.get() == 1.0 and got == [1.0]
            bad = pool.apply_async(T.fail, (5,), error_callback=got.append)
            with pytest.raises(ValueError, match="bad 5"):
                bad.get(TIMEOUT)
            assert bad.ready() and not bad.successful() and isinstance(got[-1], ValueError)
            assert pool.apply(T.square, (7,)) == 49

    def test_calls_do_not_wake_the_worker_handler(self, ctx, monkeypatch):
        # the stdlib's cache wakes it each time it empties (the end of every call): ~150 us of the parent's CPU,
        # on the GIL while the call returns and the next starts
        from mp_reductions._pool.core import Core

        wakes = []
        drain = Core.drain_notifier

        def counted(core):
            wakes.append(1)
            return drain(core)

        monkeypatch.setattr(Core, "drain_notifier", counted)  # once per wake of the worker handler
        with mpr.Pool(2, context=ctx) as pool:
            pool.map(T.square, range(10))
            before = len(wakes)
            for _ in range(20):
                assert pool.map(T.square, range(10)) == [x * x for x in range(10)]
                assert pool.apply_async(T.square, (3,)).get(TIMEOUT) == 9
            assert len(wakes) - before < 5, f"the worker handler woke {len(wakes) - before} times in 40 calls"
            pool.close()
            assert_prompt(pool.join)

    def test_initializer_and_maxtasksperchild(self, ctx):
        with mpr.Pool(2, initializer=T.set_value, initargs=("hello",), maxtasksperchild=2, context=ctx) as pool:
            assert pool.map(T.get_value, range(6), chunksize=1) == ["hello"] * 6
            pids = pool.map(T.getpid, range(12), chunksize=1)
            assert len(set(pids)) >= 6  # each worker ran at most 2 tasks
            assert pool.map(T.square, range(10)) == [x * x for x in range(10)]
            pool.close()
            pool.join()

    def test_an_initializer_pickle_cannot_send_by_name_goes_by_value(self, ctx):
        # _byvalue Note [by value]: a spawn or forkserver worker unpickles its initializer and initargs; a closure,
        # and a lambda among its arguments, go by value (the stdlib's worker fails to find them)
        k = 5

        def init(f):
            T.set_value(f(k))

        with mpr.Pool(2, initializer=init, initargs=(lambda x: x * 3,), maxtasksperchild=1, context=ctx) as pool:
            assert pool.map(T.get_value, range(4), chunksize=1) == [15] * 4  # retired workers' replacements too

    def test_workers_are_daemonic_unless_daemon_false(self, ctx):
        for daemon in (True, False):
            with mpr.Pool(1, context=ctx, daemon=daemon) as pool:
                assert pool.apply(T.child_exitcode) == (None if daemon else 0)  # a daemon may start no process

    def test_sigkill_of_a_busy_worker_fails_its_task_only(self, ctx):
        slots = mpr.zeros_shared((1,), np.int64)
        pool = mpr.Pool(2, context=ctx)
        blocked = pool.apply_async(T.pid_then_sleep, (slots, 0, 60))
        pid = wait_for_pid(slots)
        queued = pool.map_async(T.square, range(20), chunksize=1)  # some wait in the inqueue
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(mpr.WorkerLostError) as info:
            blocked.get(5)
        err = info.value
        assert err.pid == pid and err.signal_name == "SIGKILL" and err.kind == "apply" and err.index == 0
        assert f"worker {pid} died with signal SIGKILL while running task 0 of apply" in str(err)
        assert pickle_roundtrip(err).pid == pid
        assert queued.get(TIMEOUT) == [x * x for x in range(20)]  # never started: not lost
        assert pool.map(T.square, range(10)) == [x * x for x in range(10)]  # replaced; still serving
        assert pid not in pool.map(T.getpid, range(8), chunksize=1)
        pool.close()
        assert_prompt(pool.join)

    def test_lost_chunk_fails_the_whole_map_and_imap_at_its_position(self, ctx):
        slots = mpr.zeros_shared((1,), np.int64)
        with mpr.Pool(2, context=ctx) as pool:
            whole = pool.starmap_async(T.square_or_block, [(x, slots) for x in range(8)], chunksize=1)
            os.kill(wait_for_pid(slots), signal.SIGKILL)
            with pytest.raises(mpr.WorkerLostError, match="task 3 of map"):
                whole.get(5)

            slots[0] = 0
            it = pool.imap(T.square_or_block_pair, [(x, slots) for x in range(6)])
            assert [next(it) for _ in range(3)] == [0, 1, 4]
            os.kill(wait_for_pid(slots), signal.SIGKILL)
            with pytest.raises(mpr.WorkerLostError, match="task 3 of imap"):
                it.next(5)
            assert [it.next(TIMEOUT) for _ in range(2)] == [16, 25]

            slots[0] = 0
            blocked = pool.apply_async(T.pid_then_sleep, (slots, 0, 60))
            wait_for_pid(slots)
            assert_prompt(pool.terminate)
            assert not blocked.ready()  # terminate() leaves unfinished results pending, as the stdlib does

    def test_a_task_queued_behind_a_long_one_runs_on_an_idle_worker(self, ctx):
        # each worker's queue holds its next task too (Note [lost tasks]); one stuck behind a 60 s task is
        # taken back for the worker that has nothing left, as the stdlib's shared inqueue would have it run
        slots = mpr.zeros_shared((1,), np.int64)
        with mpr.Pool(2, context=ctx) as pool:
            blocked = pool.apply_async(T.pid_then_sleep, (slots, 0, 60))
            wait_for_pid(slots)
            for n in (1, 2, 7):
                assert assert_prompt(pool.map, T.square, range(n), 1) == [x * x for x in range(n)]
            assert not blocked.ready()

    def test_several_tasks_queued_behind_a_long_one_run_on_an_idle_worker(self, ctx):
        # a worker's queue holds up to DEPTH - 1 messages behind the one it runs: each is taken back, the first
        # still queued first, for the worker that has nothing left (ms tasks go one per message)
        slots = mpr.zeros_shared((1,), np.int64)
        with mpr.Pool(2, context=ctx) as pool:
            blocked = pool.apply_async(T.pid_then_sleep, (slots, 0, 60))
            wait_for_pid(slots)
            k = [w.pid if w else None for w in pool._core.slots.workers].index(int(slots[0]))
            naps = pool.map_async(T.nap, [0.05] * 12, chunksize=1)
            deadline = time.monotonic() + 10
            while len(pool._core.slots.sent[k]) < wire.DEPTH:
                assert time.monotonic() < deadline, "the blocked worker's queue never filled"
                time.sleep(0.001)
            assert assert_prompt(naps.get, TIMEOUT) == [0.05] * 12
            assert not blocked.ready()

    def test_a_task_sent_to_an_idle_worker_runs_there(self, ctx):
        # slots._send_ready: a task goes to the first of the idle slots, and the call that sent it does not take it
        # back for the other idle one before its worker woke (it did for 493 of 500 calls: a round trip each)
        with mpr.Pool(2, context=ctx) as pool:
            assert sorted(pool.map(T.getpid, range(8), chunksize=1))  # both workers up
            deadline = time.monotonic() + 10
            while len(pool._core.slots.started) < 2:
                assert time.monotonic() < deadline, "the workers never said they started"
                time.sleep(0.01)
            first = pool._core.slots.workers[0].pid
            ran = [pool.apply(T.getpid) for _ in range(200)]
            assert ran.count(first) >= 150, f"{200 - ran.count(first)} of 200 calls moved to the other worker"

    def test_messages_sent_to_a_worker_that_takes_none_run_on_an_idle_one(self, ctx):
        # Note [lost tasks]: a worker that has taken none of its messages yet (one still starting on a loaded
        # machine; here one stopped) holds them while the other finishes its own: each is taken back for the idle
        # one, which would otherwise wait for no result that could move them later
        with mpr.Pool(2, context=ctx) as pool:
            assert sorted(pool.map(T.getpid, range(8), chunksize=1))  # both workers up
            stopped = pool._pool[1].pid
            os.kill(stopped, signal.SIGSTOP)
            try:
                rs = [pool.apply_async(T.getpid) for _ in range(8)]  # sent in turn to each slot
                assert {assert_prompt(r.get, TIMEOUT) for r in rs} == {pool._pool[0].pid}
            finally:
                os.kill(stopped, signal.SIGCONT)

    def test_a_call_alone_is_never_batched_behind_a_slow_task(self, ctx):
        # Note [batches]: apply_async(alone=True) sends each task in a message of its own, also when many are ready
        # at once and the pool batches short ones; a slow one holds no other behind it
        with mpr.Pool(2, context=ctx) as pool:
            pool.map(T.square, range(3000), chunksize=1)  # short tasks: the pool batches now
            assert pool._core.slots.n > 1
            done: list[float] = []
            before = _stats.counts[_stats.MESSAGES_SENT]
            rs = [pool.apply_async(T.nap, (3.0 if i == 5 else 0.0,), callback=done.append, alone=True)
                  for i in range(200)]
            assert [r.get(TIMEOUT) for r in rs] == [3.0 if i == 5 else 0.0 for i in range(200)]
            assert _stats.counts[_stats.MESSAGES_SENT] - before >= 200, "tasks sent alone were batched"
            assert done[-1] == 3.0, "a short task finished after the slow one"

    def test_sigkill_of_an_idle_worker_loses_nothing(self, ctx):
        with mpr.Pool(2, context=ctx) as pool:
            pids = {p.pid for p in pool._pool}
            victim = pids.pop()
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while victim in {p.pid for p in pool._pool} or len(pool._pool) < 2:
                assert time.monotonic() < deadline, "the idle worker was not replaced"
                time.sleep(0.01)
            assert pool.map(T.square, range(50), chunksize=1) == [x * x for x in range(50)]
            assert victim not in pool.map(T.getpid, range(8), chunksize=1)
            pool.close()
            assert_prompt(pool.join)

    def test_short_tasks_travel_in_batches_long_ones_alone(self, ctx):
        # Note [batches]: tasks a worker runs in microseconds go several to a message; tasks of 20 ms, one each
        # the batch size follows the workers' reports, which a loaded machine makes noisy (a task preempted for
        # milliseconds reads as long), so the short tasks are judged by the messages the whole map took
        def messages(call, *args):
            before = _stats.counts[_stats.MESSAGES_SENT]
            got = call(*args)
            return got, _stats.counts[_stats.MESSAGES_SENT] - before

        with mpr.Pool(2, context=ctx) as pool:
            got, sent = messages(pool.map, T.square, range(3000), 1)
            assert got == [x * x for x in range(3000)]
            assert sent < 1500, f"3000 short tasks took {sent} messages"
            assert pool.map(T.nap, [0.02] * 10, chunksize=1) == [0.02] * 10
            assert pool._core.slots.n == 1, "20 ms tasks were batched"
            got, sent = messages(lambda: sorted(pool.imap_unordered(T.square, range(3000))))
            assert got == [x * x for x in range(3000)]
            assert sent < 1500, f"3000 short tasks took {sent} messages"

    def test_results_either_side_of_the_short_limit(self, ctx):
        # results whose pickle fits a short frame go on the short socket, others on the outqueue: all arrive,
        # each to its own task, whatever the mix
        sizes = [n for n in range(wire.SHORT_MAX - 148, wire.SHORT_MAX + 52, 7)] * 3
        with mpr.Pool(2, context=ctx) as pool:
            got = pool.map(T.sized, sizes, chunksize=1)
            assert got == [(n, b"x" * n) for n in sizes]
            rs = [pool.apply_async(T.sized, (n,)) for n in sizes]
            assert [r.get(TIMEOUT) for r in rs] == [(n, b"x" * n) for n in sizes]

    def test_a_killed_workers_unstarted_batch_runs_elsewhere(self, ctx, tmp_path):
        # a worker killed in the middle of a batch fails the task it ran; the rest of its batch, never started,
        # runs on the other worker or the replacement (Note [batches]), exactly once
        def followers(pool, i):
            with pool._core.slots.lock:  # the tasks queued after task i in its message
                for sent in pool._core.slots.sent:
                    for tasks, _, _ in sent:
                        ids = [t[1] for t in tasks]
                        if i in ids:
                            return len(ids) - ids.index(i) - 1
            return 0

        exercised = 0
        for attempt in range(5):
            path = str(tmp_path / f"pid{attempt}")
            with mpr.Pool(2, context=ctx) as pool:
                pool.map(T.square, range(3000), chunksize=1)  # short tasks: batches of many
                it = pool.imap(T.slow_square_or_block, [(x, path, 500) for x in range(2000)])
                deadline = time.monotonic() + TIMEOUT
                while not os.path.exists(path):
                    assert time.monotonic() < deadline, "task 500 never started"
                    time.sleep(0.005)
                victim = int(open(path).read())
                exercised += followers(pool, 500) > 0
                os.kill(victim, signal.SIGKILL)
                got, lost = [], []
                for _ in range(2000):
                    try:
                        got.append(it.next(TIMEOUT))
                    except mpr.WorkerLostError as e:
                        lost.append(e)
                assert len(lost) == 1 and lost[0].pid == victim and lost[0].index == 500
                assert got == [x * x for x in range(2000) if x != 500]
            if exercised:
                break
        assert exercised, "task 500 was never followed by others in its batch"

    def test_every_call_ends_under_random_sigkills(self, ctx):
        """Workers killed anywhere (between taking a task and saying so, too), several in one call, fail at most
        the tasks they took, and every call ends: issue 12 defect 6, where 4 of 73 calls never did, and issue 41,
        where a second death in one call hung it."""
        rng = random.Random(12)
        with mpr.Pool(3, context=ctx) as pool:
            for _ in range(12):
                it = pool.imap_unordered(T.square, range(200))
                got, lost, killed = [], [], set()
                kill_at = sorted(rng.sample(range(10, 190), rng.randrange(2, 5)))  # 2 to 4 kills in this call
                deadline = time.monotonic() + 30  # a hang check, far above any delay of a loaded machine
                while True:
                    try:
                        got.append(it.next(max(0.0, deadline - time.monotonic())))
                    except StopIteration:
                        break
                    except mpr.WorkerLostError as e:
                        lost.append(e)
                    except multiprocessing.TimeoutError:
                        pytest.fail(f"a call never ended: {len(got)} results, {len(lost)} lost of 200")
                    while kill_at and len(got) + len(lost) >= kill_at[0]:
                        live = [p.pid for p in pool._pool if p.exitcode is None and p.pid not in killed]
                        if not live:  # the victims' replacements not started yet: try at the next result
                            break
                        victim = rng.choice(live)
                        try:
                            os.kill(victim, signal.SIGKILL)
                            killed.add(victim)
                        except ProcessLookupError:  # reaped by the pool meanwhile: kill another
                            continue
                        kill_at.pop(0)
                assert len(got) + len(lost) == 200 and len(lost) <= len(killed)
                assert all(e.pid in killed and e.signal_name == "SIGKILL" for e in lost), (killed, lost)
                assert set(got) <= {x * x for x in range(200)} and len(set(got)) == len(got)
            pool.close()
            assert_prompt(pool.join)

    def test_a_pool_left_by_an_exception_closes_its_channels(self, ctx):
        """terminate() closes the pool's sockets, so a traceback that holds the pool (pytest's, a logger's)
        holds no more than the workers' own process pipes, as the stdlib's Pool does (CI failure: 14 per pool)."""
        before = len(os.listdir("/proc/self/fd"))
        held = []
        for _ in range(3):
            try:
                with mpr.Pool(2, context=ctx) as pool:
                    assert pool.map(T.square, range(10)) == [x * x for x in range(10)]
                    raise KeyError("out")
            except KeyError as e:
                held.append(e)  # its traceback holds the pool
        assert len(os.listdir("/proc/self/fd")) - before <= 3 * 2 * 2, "more than 2 per worker left open"
        held.clear()

    def test_sigkill_while_unpickling_the_arguments_fails_the_task(self, ctx, tmp_path):
        path = tmp_path / "pid"  # the argument's rebuild writes the worker's pid there, then sleeps
        with mpr.Pool(1, context=ctx) as pool:
            r = pool.apply_async(T.identity, (T.SlowToUnpickle(str(path), 10),))
            deadline = time.monotonic() + TIMEOUT
            while not path.exists():
                assert time.monotonic() < deadline, "the task's arguments were never unpickled"
                time.sleep(0.005)
            pid = int(path.read_text())
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(mpr.WorkerLostError) as info:
                r.get(TIMEOUT)
            err = info.value
            assert err.pid == pid and err.signal_name == "SIGKILL" and err.kind == "apply" and err.index == 0
            assert pool.apply(T.square, (3,)) == 9
            assert pid not in {p.pid for p in pool._pool}

    def test_an_argument_that_fails_to_unpickle_is_the_tasks_error(self, ctx):
        with mpr.Pool(1, context=ctx) as pool:
            pids = [p.pid for p in pool._pool]
            r = pool.apply_async(T.identity, (T.FailsToUnpickle("cannot rebuild 7"),))
            with pytest.raises(ValueError, match="^cannot rebuild 7$") as info:
                r.get(TIMEOUT)
            assert "_rebuild_raising" in str(info.value.__cause__)  # the worker's traceback, as for a task's error
            with pytest.raises(ValueError, match="^cannot rebuild 2$"):
                pool.map(T.identity, [1, T.FailsToUnpickle("cannot rebuild 2"), 3], chunksize=1)
            assert pool.map(T.square, range(10)) == [x * x for x in range(10)]
            assert [p.pid for p in pool._pool] == pids  # the worker went on

    def test_terminate_gives_back_the_queued_tasks_segments(self, ctx):
        old = mpr.get_sharing_strategy()
        mpr.set_sharing_strategy("file_system")
        try:
            # The worker never takes a task (its initializer sleeps): one task waits in its queue, the
            # task handler holds the next one, pickled, waiting for room.
            with mpr.Pool(1, initializer=time.sleep, initargs=(60,), context=ctx) as pool:
                pids = {os.getpid(), *(p.pid for p in pool._pool)}
                arrays = [np.full(50_000, i, np.float64) for i in range(10)]  # 400 KB: one named segment each
                queued = pool.map_async(T.double, arrays, chunksize=1)
                deadline = time.monotonic() + TIMEOUT
                while len(shm_names(pids)) < 2:
                    assert time.monotonic() < deadline, "the tasks were never put"
                    time.sleep(0.005)
                pool.terminate()  # the tasks' in-flight counts must be given back
            assert not queued.ready()
            assert_none_left(pids)
        finally:
            mpr.set_sharing_strategy(old)

    @pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
    @pytest.mark.parametrize("shared", [False, True], ids=["copied", "shared"])
    def test_a_worker_killed_before_it_maps_its_task_leaves_no_segment(self, ctx, strategy, shared):
        # issue 35 (9): the in-flight count of a named segment, which a worker takes over as it unpickles its
        # task, stayed until the group ended when the worker died first; the parent keeps it now, until the
        # task is done with (_message Note [kept counts]), and a replacement that gets the array maps it
        with mpr.Pool(1, context=ctx) as pool:
            pids = {os.getpid(), pool._pool[0].pid}
            a = mpr.empty_shared(100_000) if shared else np.empty(100_000)  # 800 KB: a named segment
            a[:] = 7
            with pytest.raises(mpr.WorkerLostError):
                pool.apply_async(T.first_sum, (T.DiesWhenUnpickled(), a)).get(TIMEOUT)
            assert pool.apply_async(T.first_sum, (None, a)).get(TIMEOUT) == 700_000
            pids |= {p.pid for p in pool._pool}
            del a
        pool.join()
        assert_none_left(pids)

    @pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
    def test_a_worker_killed_after_its_results_count_before_its_send_leaves_no_segment(self, ctx, strategy):
        # issue 35 (8): a worker killed between a result's in-flight count and its send left the count up until
        # the group ended; now the daemon adds it when told or taken, and gives back what the pool never took
        # once the pool has read all the dead worker sent (_message Note [results told])
        with mpr.Pool(1, context=ctx) as pool:
            pids = {os.getpid(), pool._pool[0].pid}
            for _ in range(3):
                with pytest.raises(mpr.WorkerLostError):
                    pool.apply_async(T.shared_then_dies, (100_000,)).get(TIMEOUT)  # 800 KB: a named segment
                pids |= {p.pid for p in pool._pool}
                assert_none_left(pids)  # the pool goes on: its worker's death settled, nothing kept
            assert pool.apply_async(T.first_sum, (None, np.full(10, 3.0))).get(TIMEOUT) == 30.0  # it works on
            pids |= {p.pid for p in pool._pool}
        pool.join()
        assert_none_left(pids)

    @pytest.mark.parametrize("strategy", ["file_system"], indirect=True)
    def test_tasks_queued_for_a_killed_worker_keep_arrays_the_caller_dropped(self, ctx, strategy):
        # Note [kept counts]: the parent's count of each queued task's segment is up until its task is done with,
        # so the replacement that runs it maps it, although the caller dropped the array as it submitted it
        with mpr.Pool(1, context=ctx) as pool:
            pids = {os.getpid(), pool._pool[0].pid}
            dying = pool.apply_async(T.die_after, (0.3,))
            queued = []
            for i in range(3):
                a = mpr.empty_shared(100_000)
                a[:] = i
                queued.append(pool.apply_async(T.first_sum, (None, a)))
                del a
            with pytest.raises(mpr.WorkerLostError):
                dying.get(TIMEOUT)
            assert [r.get(TIMEOUT) for r in queued] == [0.0, 100_000.0, 200_000.0]
            pids |= {p.pid for p in pool._pool}
        pool.join()
        assert_none_left(pids)

    @pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
    def test_many_results_one_segment_per_message_none_after(self, ctx, strategy_name):
        n = 500
        old = mpr.get_sharing_strategy()
        mpr.set_sharing_strategy(strategy_name)
        try:
            base_maps = memfd_mappings()
            pool = mpr.Pool(2, initializer=T.share_results, initargs=(strategy_name,), context=ctx)
            pids = {os.getpid(), *(p.pid for p in pool._pool)}

            def count():
                return len(shm_names(pids)) if strategy_name == "file_system" else memfd_mappings() - base_maps

            results, peak = [], 0
            for r in pool.imap_unordered(T.five_arrays, range(n)):
                results.append(r)
                if len(results) % 50 == 0:
                    peak = max(peak, count())
            pool.close()
            pool.join()
            assert sorted(float(r[0][0, 0]) for r in results) == list(range(n))
            assert all(via_shared_memory(a) for r in results for a in r)
            alive = count()
            assert alive == n, f"{alive} segments for {n} result messages of 5 arrays each"
            if strategy_name == "file_system":  # the workers' segments are the parent's group's, not theirs
                assert {name.split("_")[2] for name in shm_names(pids)} == {shm_manager.group()}
            assert peak <= n
            del results, r
            deadline = time.monotonic() + 5
            while count() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert count() == 0
        finally:
            mpr.set_sharing_strategy(old)

    @pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
    def test_parent_short_of_descriptors_delays_results_and_kills_no_handler(self, tmp_path, strategy):
        """Issue 12 defect 4: a result the parent cannot receive (no descriptor free) is received once one is;
        the result handler used to die of it, leaving map_async pending and terminate() raising. Issue 20: a
        result in named segments (file_system) was the task's error instead, the result lost."""
        self._run_script(tmp_path, SHORT_OF_DESCRIPTORS_SCRIPT, strategy)

    def _run_script(self, tmp_path, text, *args) -> str:
        script = tmp_path / "script.py"
        script.write_text(text)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(T.__file__), *sys.path])}
        out = subprocess.run([sys.executable, str(script), self.method, *args], capture_output=True, text=True,
                             timeout=TIMEOUT * 4, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def test_nothing_left_after_the_process_exits_holding_results(self, tmp_path):
        pids = [int(p) for p in self._run_script(tmp_path, HOLD_SCRIPT).split()]
        assert len(pids) == 3
        deadline = time.monotonic() + 5
        while shm_names(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not shm_names(pids)


SHORT_OF_DESCRIPTORS_SCRIPT = """
import logging, os, resource, sys, threading
import itertools
import multiprocessing
import mp_reductions as mpr
import _pool_targets as T

class Seen(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records, self.event = [], threading.Event()

    def emit(self, record):
        self.records.append(record)
        self.event.set()

if __name__ == "__main__":
    mpr.init_reductions()
    seen = Seen()
    logging.getLogger("mp_reductions.pool").addHandler(seen)
    pool = mpr.Pool(1, initializer=T.share_results, initargs=(sys.argv[2],),
                    context=multiprocessing.get_context(sys.argv[1]))
    assert pool.apply(T.square, (3,)) == 9  # the worker is up
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), limit[1]))  # none free
    r = pool.map_async(T.five_arrays, range(4), chunksize=1)  # each result carries a descriptor, or names a file
    seen.event.wait(30)  # the result handler says it could not receive
    resource.setrlimit(resource.RLIMIT_NOFILE, limit)
    results = r.get(60)
    assert [float(x[0][0, 0]) for x in results] == [0, 1, 2, 3]
    assert pool._core.threads["result handler"].is_alive()
    assert len(seen.records) == 1, [rec.getMessage() for rec in seen.records]  # logged once
    assert "RLIMIT_NOFILE" in str(seen.records[0].exc_info[1])
    del results
    pool.terminate()
    print("ok")
"""


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


HOLD_SCRIPT = """
import os, sys
import itertools
import multiprocessing
import mp_reductions as mpr
import _pool_targets as T

if __name__ == "__main__":
    mpr.init_reductions()
    mpr.set_sharing_strategy("file_system")
    pool = mpr.Pool(2, initializer=T.share_results, initargs=("file_system",),
                    context=multiprocessing.get_context(sys.argv[1]))
    pids = [os.getpid(), *(p.pid for p in pool._pool)]
    results = list(pool.imap_unordered(T.five_arrays, range(200)))
    assert len(os.listdir("/dev/shm")) >= 200
    pool.close()
    pool.join()
    print(*pids)
    # exits holding every result
"""
