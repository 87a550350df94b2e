"""Per-task cost of arraymp's Pool, executor and Queue against the stdlib's, in one run, under fork, spawn and
forkserver: the same as ``python -m arraymp bench --overhead`` (see ``arraymp._overhead`` for the workloads).

    python benchmarks/pool_overhead.py [--n 5000] [--repeat 3] [--methods fork,spawn,forkserver]
"""

from __future__ import annotations

import argparse

from arraymp._overhead import METHODS, main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="tiny tasks per workload")
    ap.add_argument("--repeat", type=int, default=3, help="repeats per workload; medians are printed")
    ap.add_argument("--methods", default=",".join(METHODS), help="start methods, comma-separated")
    args = ap.parse_args()
    raise SystemExit(main(n=args.n, repeat=args.repeat, methods=args.methods.split(",")))
