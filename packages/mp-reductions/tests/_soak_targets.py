"""The soak run (test_soak.py): ``python _soak_targets.py STRATEGY SECONDS METHOD`` prints its figures as JSON.

This process is the parent, never killed; everything else is, at random (its children started by METHOD: under
fork they inherit the parent's arrays and counts, _shared Note [fork])::

    producer ─q1─▶ stage A (re-sends what it got) ─q2─▶ stage B (sends a new array) ─q3─▶ sink
        └───────────────── every receiver reports (role, seq, ok) on `reports` ─────────────▶ parent
    parent: Pool(2) calls (map, imap_unordered, apply_async) over array tasks, in a thread

Every array carries its sequence number in element 0 and travels with the CRC-32 of its bytes; every
receiver checks both. Killed pipeline processes are restarted; what a killed process held is lost (counted, with
what is queued at the end, as not arrived), never wrong. Every call is timed: the pool's calls here, the
stages' puts there.
"""

import contextlib
import gc
import json
import multiprocessing
import os
import queue
import random
import signal
import sys
import threading
import time
import zlib

import mp_reductions as mpr
import numpy as np
import shm_manager

CALL_LIMIT = 20.0  # seconds: a call that takes longer counts as hung
SIZES = (100, 5_000, 20_000, 100_000)  # float64 elements: inline (< 64 KiB) and by shared memory
AHEAD = 64  # the producer stays at most this many messages ahead of the sink


def make(seq: int, rng: random.Random):
    arr = np.random.default_rng(seq).random(rng.choice(SIZES))
    arr[0] = seq
    return seq, arr, zlib.crc32(arr.tobytes())


def check(msg) -> bool:
    seq, arr, crc = msg
    return bool(arr[0] == seq) and zlib.crc32(arr.tobytes()) == crc


def _setup(strategy, group):
    shm_manager.join_group(group)
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)


def producer(strategy, group, out, sunk, start):
    _setup(strategy, group)
    rng = random.Random(os.getpid())
    seq = int(start[0])
    while True:
        while seq - sunk[0] > AHEAD:
            time.sleep(0.001)
        out.put(make(seq, rng))
        seq += 1
        start[0] = seq  # a restarted producer goes on from here


def stage(strategy, group, role, inq, out, reports, slowest):
    _setup(strategy, group)
    while True:
        msg = inq.get()
        ok = check(msg)
        reports.put((role, msg[0], ok))
        if role == "A":
            nxt = msg  # the received array itself, re-sent
        else:
            seq, arr, _ = msg
            new = arr.copy()
            new[1:] *= 2
            nxt = (seq, new, zlib.crc32(new.tobytes()))
        t0 = time.monotonic()
        out.put(nxt)
        slowest[0] = max(slowest[0], time.monotonic() - t0)


def sink(strategy, group, inq, reports, sunk):
    _setup(strategy, group)
    while True:
        msg = inq.get()
        reports.put(("sink", msg[0], check(msg)))
        sunk[0] = max(sunk[0], msg[0])


def pool_init(strategy):
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)


def pool_task(msg):
    """Check the argument, answer with a new array of the same sequence number."""
    seq, arr, _ = msg
    ok = check(msg)
    new = arr[::-1].copy()
    new[0] = seq
    return ok, (seq, new, zlib.crc32(new.tobytes()))


def ours(group: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("arraymp_") and n.split("_")[2] == group]


class Run:
    def __init__(self, strategy: str, seconds: float, method: str):
        self.strategy, self.seconds = strategy, seconds
        self.ctx = multiprocessing.get_context(method)
        self.group = shm_manager.group()
        self.rng = random.Random(os.getpid())
        self.figures = dict(strategy=strategy, method=method, kills=0, arrays_checked=0, wrong=0, calls=0, hung_calls=0,
                            longest_call=0.0, lost_tasks=0, not_arrived=0, produced=0, restarts=0)
        self.pids: set[int] = {os.getpid()}
        self.lock = threading.Lock()

    def wrong(self, where: str, seq: int) -> None:
        """An array that arrived with other values than sent (lock held): counted, the first few named."""
        self.figures["wrong"] += 1
        if self.figures["wrong"] <= 5:
            self.figures.setdefault("wrong_at", []).append(f"{where}, sequence number {seq}")

    # -- the pool, in a thread of this process
    def call(self, pool, seq: int) -> int:
        kind = self.rng.choice(["map", "imap_unordered", "apply_async"])
        n = self.rng.randrange(1, 40)
        args = [make(seq + k, self.rng) for k in range(n)]
        t0, lost, got = time.monotonic(), 0, []
        try:
            if kind == "map":
                got = pool.map_async(pool_task, args, chunksize=self.rng.choice([1, 4])).get(CALL_LIMIT)
            elif kind == "apply_async":
                got = [pool.apply_async(pool_task, (args[0],)).get(CALL_LIMIT)]
                n = 1
            else:
                it = pool.imap_unordered(pool_task, args)
                for _ in range(n):
                    try:
                        got.append(it.next(max(0.0, CALL_LIMIT - (time.monotonic() - t0))))
                    except mpr.WorkerLostError:
                        lost += 1
        except mpr.WorkerLostError:
            lost = n
        except multiprocessing.TimeoutError:
            with self.lock:
                self.figures["hung_calls"] += 1
        took = time.monotonic() - t0
        with self.lock:
            f = self.figures
            f["calls"] += 1
            f["longest_call"] = max(f["longest_call"], took)
            f["lost_tasks"] += lost
            f["arrays_checked"] += 2 * len(got)
            for ok, res in got:
                if not ok:
                    self.wrong(f"{kind} argument", res[0])
                if not check(res):
                    self.wrong(f"{kind} result (its element 0: {res[1][0]})", res[0])
        return seq + n

    def pool_loop(self, pool, stop: threading.Event) -> None:
        seq = 10**9  # apart from the pipeline's
        while not stop.is_set():
            seq = self.call(pool, seq)

    # -- the pipeline, restarted as it is killed
    def start(self, name, target, args):
        p = self.ctx.Process(target=target, args=(self.strategy, self.group, *args), name=name, daemon=True)
        p.start()
        self.pids.add(p.pid)
        return p

    def run(self) -> dict:
        mpr.init_reductions()
        mpr.set_sharing_strategy(self.strategy)
        q1, q2, q3, reports = mpr.Queue(), mpr.Queue(), mpr.Queue(), mpr.Queue()
        sunk, start = mpr.zeros_shared((1,), np.int64), mpr.zeros_shared((1,), np.int64)
        slowest = mpr.zeros_shared((1,), np.float64)
        specs = {
            "producer": (producer, (q1, sunk, start)),
            "stage A": (stage, ("A", q1, q2, reports, slowest)),
            "stage B": (stage, ("B", q2, q3, reports, slowest)),
            "sink": (sink, (q3, reports, sunk)),
        }
        procs = {name: self.start(name, *spec) for name, spec in specs.items()}
        pool = mpr.Pool(2, initializer=pool_init, initargs=(self.strategy,), context=self.ctx)
        stop = threading.Event()
        caller = threading.Thread(target=self.pool_loop, args=(pool, stop))
        caller.start()
        seen_at_sink: set[int] = set()

        def take_reports(wait: float) -> None:
            deadline = time.monotonic() + wait
            while True:
                try:
                    role, seq, ok = reports.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    return
                with self.lock:
                    self.figures["arrays_checked"] += 1
                    if not ok:
                        self.wrong(role, seq)
                if role == "sink":
                    seen_at_sink.add(seq)

        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            take_reports(self.rng.uniform(0.2, 1.0))
            self.pids.update(p.pid for p in pool._pool)
            victims = [p.pid for p in procs.values() if p.exitcode is None]
            victims += [p.pid for p in pool._pool if p.exitcode is None]
            try:
                os.kill(self.rng.choice(victims), signal.SIGKILL)
                self.figures["kills"] += 1
            except (IndexError, ProcessLookupError):
                pass
            for name, p in procs.items():
                if p.exitcode is not None:
                    p.join()
                    procs[name] = self.start(name, *specs[name])
                    self.figures["restarts"] += 1

        stop.set()
        caller.join(CALL_LIMIT * 3)
        assert not caller.is_alive(), "a pool call never returned"
        self.pids.update(p.pid for p in pool._pool)
        pool.close()
        t0 = time.monotonic()
        pool.join()
        self.figures["longest_call"] = max(self.figures["longest_call"], time.monotonic() - t0)
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.join(CALL_LIMIT)
        take_reports(0.5)
        f = self.figures
        f["produced"] = int(start[0])
        f["not_arrived"] = f["produced"] - len(seen_at_sink)  # lost with a killed process, or queued at the end
        for q in (q1, q2, q3):  # gives back what the messages still queued hold
            with contextlib.suppress(queue.Empty):
                while True:
                    q.get(timeout=0.5)
        f["slowest_put"] = float(slowest[0])
        for q in (q1, q2, q3, reports):
            q.close()
        del sunk, start, slowest
        gc.collect()
        deadline = time.monotonic() + 3
        while ours(self.group) and time.monotonic() < deadline:
            time.sleep(0.05)
        f["segments_before_exit"] = len(ours(self.group))  # messages lost in flight: given back at the group's end
        f["group"], f["pids"] = self.group, sorted(self.pids)
        return f


if __name__ == "__main__":
    print(json.dumps(Run(sys.argv[1], float(sys.argv[2]), sys.argv[3]).run()))
