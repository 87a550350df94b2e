"""Results born in shared memory (issue 22): the stdlib Pool against arraymp's with shared allocation off and on.

Three systems, each in a fresh process per start method: ``stdlib`` (the
stdlib Pool, plain pickling), ``off`` (arraymp's ``Pool(shared_results=False)``:
a result is copied once into a recycled segment), ``on`` (arraymp's Pool as it
comes, ``shared_results=True``: a result is born in a segment and travels as a
handle). Workloads, 2 workers by default:

- ``big``: ``pool.map(f, range(8))``, each result a 128 MiB float32 array;
- ``many``: ``pool.map(f, range(200))``, each result a 4 MiB float32 array;
  both timed on a fresh pool's first map (``cold``) and as the median of
  ``--repeat`` maps after it (``warm``), every result checked and dropped;
- ``peak``: one 1 GiB result, ``pool.apply``: the highest sum of the
  proportional set sizes (PSS: shared pages counted once) of the parent and
  its workers over the call, sampled every 5 ms, minus the same sum before it;
- ``rss`` (fork only): each worker's private resident memory (RssAnon) after
  ``--tasks // 10`` and after ``--tasks`` tasks of ``imap_unordered`` returning
  2 MiB arrays the parent drops at once (growth = end / early), and the shared
  memory a worker maps at the end (RssShmem: its recycling pool, bounded by
  _recycle.POOL_MAX and KEEP_BYTES, sized by the results in flight);
- ``small`` (fork only): ``pool.map`` of ``--tasks // 2`` tasks returning 8 KB
  arrays (median of ``--repeat``), and in the parent ``np.ones(128) + 1`` under
  the handler against numpy's default (arrays under 1 MiB go to numpy's own
  allocator).

Targets: big warm on/off <= 0.6, many warm on/stdlib <= 0.2, peak on <= 1.1 GiB,
rss growth ~1, small on/off ~1.

    python benchmarks/shared_results.py [--methods fork,spawn,forkserver] [--workers 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import timeit

import numpy as np

MiB = 1 << 20


# ---------------------------------------------------------------- in workers
def result(i, nbytes):
    return np.full(nbytes // 4, i, np.float32)


def big(i):
    return result(i, 128 * MiB)


def many(i):
    return result(i, 4 * MiB)


def gib(i):
    return result(i, 1024 * MiB)


def two_mib(i):
    return result(i, 2 * MiB)


def small(i):
    return np.full(2048, i, np.float32)


# ---------------------------------------------------------------- measuring
def workers(pool) -> list[int]:
    """The pool's worker pids (forkserver's are not children of this process)."""
    return [p.pid for p in pool._pool]


def pss(pids) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return total


def rss(pid: int) -> tuple[int, int]:
    """(private, shared) resident bytes of ``pid``: RssAnon, and RssShmem (the segments it maps)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) << 10, int(fields["RssShmem"].split()[0]) << 10


def timed_maps(pool, func, n, repeat) -> tuple[float, float]:
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        out = pool.map(func, range(n))
        times.append(time.perf_counter() - t0)
        assert [float(r[0]) for r in out] == [float(r[-1]) for r in out] == list(range(n)), "wrong results"
        del out
        gc.collect()
    return times[0], statistics.median(times[1:])


def peak(pool) -> float:
    """GiB over baseline at the peak of one 1 GiB result (PSS of the parent and its workers)."""
    gc.collect()
    time.sleep(0.3)
    pids = [os.getpid(), *workers(pool)]
    base, top, done = pss(pids), [0], threading.Event()

    def sample():
        while not done.is_set():
            top[0] = max(top[0], pss(pids))
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    r = pool.apply(gib, (7,))
    top[0] = max(top[0], pss(pids))
    done.set()
    t.join()
    assert r[0] == r[-1] == 7
    return (top[0] - base) / (1 << 30)


def worker_growth(pool, tasks) -> tuple[float, float]:
    """The largest growth of a worker's private memory from task ``tasks // 10`` to the last, and the most shared
    memory (MiB) a worker maps at the end (its recycling pool: it follows the results in flight, not the count)."""
    pids = workers(pool)
    early = None
    for k, r in enumerate(pool.imap_unordered(two_mib, range(tasks), chunksize=1), 1):
        del r
        if k == tasks // 10:
            early = {pid: rss(pid) for pid in pids}
    end = {pid: rss(pid) for pid in pids}
    return (max(end[pid][0] / early[pid][0] for pid in pids if pid in early and pid in end),
            max(shared for _, shared in end.values()) / MiB)


def small_alloc(system) -> float:
    """Seconds per ``np.ones(128) + 1`` in the parent (under the handler for 'on')."""
    if system != "on":
        return min(timeit.repeat("np.ones(128) + 1", globals={"np": np}, number=20000, repeat=5)) / 20000
    import arraymp

    with arraymp.shared_allocation():
        return min(timeit.repeat("np.ones(128) + 1", globals={"np": np}, number=20000, repeat=5)) / 20000


def run_one(system: str, method: str, workers: int, repeat: int, tasks: int) -> dict:
    if system == "stdlib":
        import multiprocessing

        ctx, init = multiprocessing.get_context(method), {}
    else:
        import arraymp

        ctx = arraymp.get_context(method)
        init = {"shared_results": system == "on"}
    out = {"system": system, "method": method}
    with ctx.Pool(workers, **init) as pool:
        out["big"] = timed_maps(pool, big, 8, repeat)
    with ctx.Pool(workers, **init) as pool:
        out["many"] = timed_maps(pool, many, 200, repeat)
    with ctx.Pool(workers, **init) as pool:
        out["peak"] = peak(pool)
    if method == "fork":
        with ctx.Pool(workers, **init) as pool:
            out["rss"] = worker_growth(pool, tasks)
        with ctx.Pool(workers, **init) as pool:
            out["small"] = timed_maps(pool, small, tasks // 2, repeat)[1]
        out["alloc"] = small_alloc(system)
    return out


# ---------------------------------------------------------------- the table
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="fork,spawn,forkserver")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.workers, args.repeat, args.tasks)))
        return 0

    print(f"{args.workers} workers; big: map over 8 x 128 MiB results, many: 200 x 4 MiB; cold = first map of a "
          f"fresh pool, warm = median of {args.repeat} after it; peak: GiB over baseline for one 1 GiB result")
    for method in args.methods.split(","):
        rows = {}
        for system in ("stdlib", "off", "on"):
            sys.stderr.write(f"{method} {system} ...\n")
            cmd = [sys.executable, __file__, "--one", system, method, "--workers", str(args.workers),
                   "--repeat", str(args.repeat), "--tasks", str(args.tasks)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                print(f"{method} {system}: FAILED: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}")
                continue
            rows[system] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"\nstart method {method}")
        print(f"{'system':8} {'big cold':>9} {'big warm':>9} {'many cold':>10} {'many warm':>10} {'peak GiB':>9}"
              + (f" {'rss growth':>10} {'pool MiB':>8} {'small map':>10} {'alloc us':>9}" if method == "fork" else ""))
        for system, r in rows.items():
            line = (f"{system:8} {r['big'][0]:9.3f} {r['big'][1]:9.3f} {r['many'][0]:10.3f} {r['many'][1]:10.3f} "
                    f"{r['peak']:9.2f}")
            if method == "fork":
                line += f" {r['rss'][0]:10.2f} {r['rss'][1]:8.0f} {r['small']:10.3f} {r['alloc'] * 1e6:9.2f}"
            print(line)
        if {"stdlib", "off", "on"} <= rows.keys():
            on, off, std = rows["on"], rows["off"], rows["stdlib"]
            print(f"ratios: big on/off cold {on['big'][0] / off['big'][0]:.2f} warm {on['big'][1] / off['big'][1]:.2f}"
                  f" (target <= 0.6); many on/stdlib cold {on['many'][0] / std['many'][0]:.2f} warm "
                  f"{on['many'][1] / std['many'][1]:.2f} (target <= 0.2); peak on {on['peak']:.2f} GiB (target <= 1.1)"
                  + (f"; small map on/off {on['small'] / off['small']:.2f}, alloc on/off "
                     f"{on['alloc'] / off['alloc']:.2f}" if method == "fork" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
