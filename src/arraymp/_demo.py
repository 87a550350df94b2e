"""``python -m arraymp demo``: a producer/consumer pipeline and a small pool over
real arrays, through arraymp and through the stdlib (plain pickling), with a
throughput table at the end."""

from __future__ import annotations

import multiprocessing
import sys
import time

import numpy as np

import arraymp

from ._bench import _as, _plain_pickling


def _consume(q, results, n, plain):
    if plain:
        _plain_pickling()
    total = 0.0
    for _ in range(n):
        a = q.get()
        total += float(a[0, 0]) + float(a[-1, -1])
        del a
    results.put(total)


def _pipeline(ctx, n, shape, preshared, bar, plain):
    q, results = ctx.Queue(maxsize=8), ctx.Queue()
    p = ctx.Process(target=_consume, args=(q, results, n, plain))
    p.start()
    base = arraymp.zeros_shared(shape, np.float32) if preshared else np.zeros(shape, np.float32)
    t0 = time.perf_counter()
    for i in range(n):
        a = base if preshared else np.full(shape, i, np.float32)
        q.put(a)
        bar.step()
    total = results.get(timeout=600)
    dt = time.perf_counter() - t0
    p.join()
    expected = 0.0 if preshared else float(sum(2 * i for i in range(n)))
    assert total == expected, f"pipeline lost data: {total} != {expected}"
    return dt


def _task(i):
    return np.full((256, 1024), i, np.float32)  # 1 MiB result


def _pool(ctx, n, bar, plain):
    t0 = time.perf_counter()
    with ctx.Pool(2, initializer=_plain_pickling if plain else None) as pool:
        got = 0.0
        for r in pool.imap_unordered(_task, range(n), chunksize=4):
            got += float(r[0, 0])
            bar.step()
    dt = time.perf_counter() - t0
    assert got == sum(range(n)), "pool lost results"
    return dt


class _Bar:
    def __init__(self, total):
        self.total, self.done = total, 0

    def step(self):
        self.done += 1
        if self.done % 8 == 0 or self.done == self.total:
            filled = 40 * self.done // self.total
            sys.stderr.write(f"\r  [{'#' * filled}{'.' * (40 - filled)}] {100 * self.done // self.total:3d}%")
            sys.stderr.flush()


def main(quick: bool = False) -> int:
    scale = 4 if quick else 1
    big, n_big, n_shared, n_pool = (1024, 2048), 64 // scale, 2000 // scale, 256 // scale  # 8 MiB arrays
    ours, stdlib = arraymp.get_context("spawn"), multiprocessing.get_context("spawn")
    jobs = [
        ("pipeline, fresh 8 MiB arrays", lambda c, b, p: _pipeline(c, n_big, big, False, b, p), n_big,
         n_big * 8 / 1024),
        ("pipeline, shared 8 MiB array", lambda c, b, p: _pipeline(c, n_shared, big, True, b, p), n_shared,
         n_shared * 8 / 1024),
        ("pool, 1 MiB results", lambda c, b, p: _pool(c, n_pool, b, p), n_pool, n_pool / 1024),
    ]
    print("arraymp demo: arrays through processes by shared memory (arraymp) vs pickling (stdlib)")
    rows = []
    for name, job, steps, gib in jobs:
        times = {}
        for label, ctx in (("arraymp", ours), ("stdlib", stdlib)):
            sys.stderr.write(f"{name} [{label}]\n")
            with _as(label):
                times[label] = job(ctx, _Bar(steps), label == "stdlib")
            sys.stderr.write("\n")
        rows.append((name, gib / times["arraymp"], gib / times["stdlib"]))
    print(f"\n{'job':34} {'arraymp GiB/s':>14} {'stdlib GiB/s':>13} {'speed-up':>9}")
    for name, a, s in rows:
        print(f"{name:34} {a:14.2f} {s:13.2f} {a / s:8.1f}x")
    return 0
