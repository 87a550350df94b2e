"""arraymp demo: a producer/consumer pipeline and a small pool over real arrays,
through arraymp and through the stdlib (plain pickling), with a throughput table
at the end: GiB/s of array bytes for arrays that are copied, messages per second
for the shared array, which travels as a handle. The default run takes about 10 s on 2 cores; --quick does a
quarter of its work, --full four times as much. Process start-up is not timed. It runs under this Python's
default start method (fork up to 3.13, forkserver from 3.14, or the one set), and says which."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

import arraymp

from ._benchkit import As, Status, plain_pickling


def _consume(q, results, n, plain):
    if plain:
        plain_pickling()
    results.put(None)  # started: the producer's clock starts now
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
    results.get(timeout=600)
    t0 = time.perf_counter()
    for i in range(n):
        a = base if preshared else np.full(shape, i, np.float32)
        q.put(a)
        bar.update()
    total = results.get(timeout=600)
    dt = time.perf_counter() - t0
    p.join()
    expected = 0.0 if preshared else float(sum(2 * i for i in range(n)))
    assert total == expected, f"pipeline lost data: {total} != {expected}"
    return dt


def _task(i):
    return np.full((256, 1024), i, np.float32)  # 1 MiB result


def _pool(ctx, n, bar, plain):
    with ctx.Pool(2, initializer=plain_pickling if plain else None) as pool:
        pool.map(abs, range(2), chunksize=1)  # started
        t0 = time.perf_counter()
        got = 0.0
        for r in pool.imap_unordered(_task, range(n), chunksize=4):
            got += float(r[0, 0])
            bar.update()
        dt = time.perf_counter() - t0
    assert got == sum(range(n)), "pool lost results"
    return dt


BIG = (1024, 2048)  # float32: 8 MiB


def main(scale: float = 1) -> int:
    """Runs the jobs with ``scale`` times the default number of messages (1: about 10 s on 2 cores)."""
    method = multiprocessing.get_start_method()
    ours, stdlib = arraymp.get_context(method), multiprocessing.get_context(method)
    # (name, job, messages through arraymp, messages through the stdlib, MiB per message, unit): the stdlib copies
    # each message of the shared job, so it gets fewer of them; rates are per message either way. A handle moves
    # no array bytes, so the shared job's rate is in messages per second: in GiB/s it would count 8 MiB a handle.
    jobs = [
        ("pipeline, fresh 8 MiB arrays", lambda c, n, b, p: _pipeline(c, n, BIG, False, b, p), 64, 64, 8, "GiB/s"),
        ("pipeline, shared 8 MiB array", lambda c, n, b, p: _pipeline(c, n, BIG, True, b, p), 5000, 64, 8, "msg/s"),
        ("pool, 1 MiB results", lambda c, n, b, p: _pool(c, n, b, p), 256, 256, 1, "GiB/s"),
    ]
    default = multiprocessing.get_all_start_methods()[0]  # (the stdlib lists its default first)
    print("arraymp demo: arrays through processes by shared memory (arraymp) vs pickling (stdlib), start method "
          + (f"{method} (this Python's default)" if method == default else f"{method} (set; this Python's: {default})"))
    status = Status()
    rows = []
    for name, job, n_ours, n_stdlib, mib, unit in jobs:
        rates = {}
        for label, ctx, n in (("arraymp", ours, n_ours), ("stdlib", stdlib, n_stdlib)):
            n = max(4, int(n * scale))
            status.line(f"{name} [{label}]: {n} messages")
            with As(label), status.bar(n) as bar:
                seconds = job(ctx, n, bar, label == "stdlib")
            rates[label] = n * mib / 1024 / seconds if unit == "GiB/s" else n / seconds
        rows.append((name, unit, rates["arraymp"], rates["stdlib"]))
    print(f"\n{'job':30} {'arraymp':>15} {'stdlib':>15} {'speed-up':>9}")
    for name, unit, a, s in rows:
        print(f"{name:30} {_rate(a, unit):>15} {_rate(s, unit):>15} {a / s:8.1f}x")
    print("\nGiB/s: array bytes that reached the other process per second (2^30 bytes a GiB).\n"
          "msg/s: an array already in shared memory travels as a handle of a few hundred bytes, whatever its\n"
          "size, so its rate is messages per second; the stdlib pickles and copies all 8 MiB of each.")
    return 0


def _rate(value: float, unit: str) -> str:
    return f"{value:,.2f} {unit}" if unit == "GiB/s" else f"{value:,.0f} {unit}"
