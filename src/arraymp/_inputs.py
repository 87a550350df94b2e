"""One big input given to every task of one call: a plain array against one the caller shared first.

``python -m arraymp bench --inputs`` (``--sizes``: the input's size, 1 GiB by default): 16 tasks on 2 workers
each take the same array and read one element of it, through

  Pool.starmap    pool.starmap(f, [(a, i) for i in range(16)], chunksize=1)
  Pool.map        pool.map(partial(f, a), range(16), chunksize=1)
  Pool.imap       list(pool.imap(partial(f, a), range(16)))
  executor.map    list(executor.map(f, [a] * 16, range(16)))

once with ``a`` a plain array and once with ``a = arraymp.share_memory(...)`` (made before the timed call). A
plain array is copied into shared memory once per call, whatever the number of tasks (_reductions Note [inputs
once per call]: the first task's message carries a copy of its own, and one shared copy serves every later
task); each task then makes its own copy in its worker, as the stdlib's unpickling gives each task its own array
(a task that writes its input never changes another's). A shared array travels as a handle: nothing is copied,
and every task sees the caller's memory. Printed per row: seconds (median of ``--repeat``), the caller's copies
into shared memory (``arraymp.stats()``), and the peak of the machine's shared memory (``Shmem`` of
/proc/meminfo, sampled every 2 ms: what else runs on the machine shows too) above its level before the call (once
the segments earlier calls kept for reuse went back: ``ARRAYMP_RECYCLE_IDLE``), in inputs' worth: the caller's
copies, and each running task's own copy (born in shared memory in a Pool worker, _alloc Note [moving results]).
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time

import numpy as np

from ._benchkit import human, meminfo

TASKS = 16


def first(a, i: int) -> float:
    """A task: one element of the input (it runs in a worker, so it lives in an importable module)."""
    return float(a[i])


CALLS = {
    "Pool.starmap": lambda pool, ex, a: pool.starmap(first, [(a, i) for i in range(TASKS)], chunksize=1),
    "Pool.map": lambda pool, ex, a: pool.map(functools.partial(first, a), range(TASKS), chunksize=1),
    "Pool.imap": lambda pool, ex, a: list(pool.imap(functools.partial(first, a), range(TASKS))),
    "executor.map": lambda pool, ex, a: list(ex.map(first, [a] * TASKS, range(TASKS))),
}


def measure(call, pool, ex, a) -> tuple[float, int, int, int]:
    """(seconds, arrays the caller copied into shared memory, their bytes, peak Shmem above the start) of one call."""
    import mp_reductions

    # the segments earlier calls kept for reuse go back first (README: ARRAYMP_RECYCLE_IDLE)
    time.sleep(1.5 * float(os.environ.get("ARRAYMP_RECYCLE_IDLE", "1.0")) + 0.2)
    base = meminfo("Shmem")
    high, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            high[0] = max(high[0], meminfo("Shmem"))
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        with mp_reductions.stats() as s:
            t0 = time.perf_counter()
            call(pool, ex, a)
            seconds = time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
    counts = s.as_dict()
    return seconds, counts["arrays_copied"], counts["bytes_copied"], high[0] - base


def main(nbytes: int = 1 << 30, repeat: int = 3, workers: int = 2) -> int:
    import arraymp

    print(f"one {human(nbytes)} input given to each of {TASKS} tasks of one call, {workers} workers, start method "
          f"{arraymp.get_start_method()}; median of {repeat}; peak: the machine's shared memory above its level "
          "before the call, in inputs' worth")
    print("| call | plain: s | copies by the caller | peak | shared first: s | copies by the caller | peak |")
    print("|---|---|---|---|---|---|---|")
    plain = np.ones(nbytes // 8)
    shared = arraymp.share_memory(plain)
    with arraymp.Pool(workers) as pool, arraymp.ProcessPoolExecutor(workers) as ex:
        pool.map(abs, range(workers)), list(ex.map(abs, range(workers)))  # workers started
        for name, call in CALLS.items():
            cells = []
            for a in (plain, shared):
                runs = [measure(call, pool, ex, a) for _ in range(repeat)]
                seconds = statistics.median(r[0] for r in runs)
                copies, copied = runs[-1][1], runs[-1][2]
                peak = statistics.median(r[3] for r in runs) / nbytes
                cells.append(f"{seconds:.2f} | {copies} ({human(copied) if copied else '0 B'}) | {peak:.1f}x")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0
