"""Pool start-up: arraymp's Pool against the stdlib's, in one run, under each start method, as a script sees it.

Each sample is a fresh interpreter running this file as a script (so spawn children import it again, and the fork
server preloads it, as they do a user's program) that imports numpy and, at its top as a user's program does,
``arraymp`` or ``multiprocessing`` as ``mp`` (``$POOL_STARTUP_SIDE``, which its children inherit), then times
``Pool(2)`` -> ``map`` of one tiny task per worker -> ``close`` -> ``join``. The import of the modules in the parent
is not timed; what the workers import is. Samples alternate between the two sides; medians in milliseconds, and
arraymp's over the stdlib's.

    python benchmarks/pool_startup.py [--repeat 7] [--methods fork,spawn,forkserver]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np  # noqa: F401 - a user's program imports numpy: so do its workers under spawn

if os.environ.get("POOL_STARTUP_SIDE") == "arraymp":
    import arraymp as mp
else:
    import multiprocessing as mp

WORKERS = 2


def _child(method: str) -> None:
    ctx = mp.get_context(method)
    t0 = time.perf_counter()
    with ctx.Pool(WORKERS) as pool:
        pool.map(abs, range(WORKERS), chunksize=1)
        pool.close()
        pool.join()
    print(time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--methods", default="fork,spawn,forkserver")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return 0
    print(f"Pool({WORKERS}) start, a task each, close, join (ms, median of {args.repeat}); ratio = arraymp / stdlib")
    print("| start method | stdlib | arraymp | ratio |\n|---|---|---|---|")
    for method in args.methods.split(","):
        times = {"stdlib": [], "arraymp": []}
        for _ in range(args.repeat):
            for side, got in times.items():
                out = subprocess.run([sys.executable, __file__, "--child", method], check=True, capture_output=True,
                                     text=True, timeout=300, env={**os.environ, "POOL_STARTUP_SIDE": side}).stdout
                got.append(float(out) * 1000)
        s, a = statistics.median(times["stdlib"]), statistics.median(times["arraymp"])
        print(f"| {method} | {s:.0f} | {a:.0f} | {a / s:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
