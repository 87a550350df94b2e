"""What value semantics cost a forwarding pipeline (issue 42 item 1): a result handed on is its receiver's own, so
it travels on as a copy (mp_reductions _shared Note [own arrays]), as the stdlib's pickle sends it.

Two systems, each in a fresh process per start method: ``stdlib`` (multiprocessing's Pool and Queue) and
``arraymp``. Workloads, 2 workers:

- ``stage2``: ``pool.map(total, results)`` over the results of ``pool.map(make, range(n))`` (``--items`` results of
  ``--mib`` MiB each): the results forwarded to a second stage, timed alone (median of ``--repeat``);
- ``relay``: the same arrays through a relay process (``Queue`` in, ``Queue`` out) and back: each array forwarded
  twice by the relay and the parent.

Printed: seconds per workload and arraymp's time over the stdlib's.

    python benchmarks/forwarding.py [--methods fork,spawn,forkserver] [--items 16] [--mib 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np


def make(i, mib):
    return np.full((mib << 20) // 8, float(i))


def total(a):
    return float(a[0] + a[-1])


def relay(inq, outq, n):
    for _ in range(n):
        outq.put(inq.get())


def run_one(system: str, method: str, items: int, mib: int, repeat: int) -> dict:
    import functools

    mp = __import__("multiprocessing" if system == "stdlib" else "arraymp")
    ctx = mp.get_context(method)
    out = {}
    with ctx.Pool(2) as pool:
        results = pool.map(functools.partial(make, mib=mib), range(items))
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            got = pool.map(total, results, chunksize=1)
            times.append(time.perf_counter() - t0)
            assert got == [2.0 * i for i in range(items)], "wrong results"
        out["stage2"] = statistics.median(times)
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=relay, args=(inq, outq, items * repeat))
    p.start()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for r in results:
            inq.put(r)
        back = [outq.get() for _ in results]
        times.append(time.perf_counter() - t0)
        assert [float(b[0]) for b in back] == list(map(float, range(items))), "wrong results"
        del back
    p.join()
    out["relay"] = statistics.median(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="fork,spawn,forkserver")
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.items, args.mib, args.repeat)))
        return 0
    print(f"{args.items} arrays of {args.mib} MiB, 2 workers, median of {args.repeat}: stage2 = a second map over "
          "the first map's results; relay = through a relay process and back")
    print(f"{'method':>10} {'workload':>8} {'stdlib s':>9} {'arraymp s':>9} {'ratio':>6}")
    for method in args.methods.split(","):
        rows = {}
        for system in ("stdlib", "arraymp"):
            r = subprocess.run([sys.executable, __file__, "--one", system, method, "--items", str(args.items),
                                "--mib", str(args.mib), "--repeat", str(args.repeat)],
                               capture_output=True, text=True, timeout=900)
            if r.returncode:
                sys.stderr.write(r.stderr)
                return 1
            rows[system] = json.loads(r.stdout)
        for workload in ("stage2", "relay"):
            s, a = rows["stdlib"][workload], rows["arraymp"][workload]
            print(f"{method:>10} {workload:>8} {s:9.3f} {a:9.3f} {a / s:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
