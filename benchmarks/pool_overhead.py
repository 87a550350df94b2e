"""Per-task overhead of arraymp's Pool against the stdlib's, in one run: tasks that carry no arrays.

arraymp's Pool gives each worker its own task queue and has it say which task it took
(``_pool.py`` Note [lost tasks]), so that a killed worker's tasks fail instead of hanging;
this measures what that costs where it shows most, tasks that do nothing:

- ``map``: ``pool.map(abs, range(N))``, default chunks;
- ``imap``: ``list(pool.imap(abs, range(N // 20)))``, one task per item;
- ``apply_async``: ``N // 20`` calls of ``apply_async(abs, (i,))``, then every ``get()``.

Each system runs each workload ``--repeat`` times in one pool (started outside the timing);
the median is reported with its ratio to the stdlib's (< 1: arraymp is faster).

    python benchmarks/pool_overhead.py [--n 100000] [--method fork] [--workers 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def workloads(n: int):
    return {
        "map": lambda pool: pool.map(abs, range(n)),
        "imap": lambda pool: list(pool.imap(abs, range(n // 20))),
        "apply_async": lambda pool: [r.get() for r in [pool.apply_async(abs, (i,)) for i in range(n // 20)]],
    }


def measure(make_pool, n: int, repeat: int) -> dict[str, float]:
    out = {}
    with make_pool() as pool:
        for name, run in workloads(n).items():
            run(pool)  # warm-up
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                run(pool)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--method", default="fork", choices=["fork", "spawn", "forkserver"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import arraymp

    stdlib = measure(lambda: multiprocessing.get_context(args.method).Pool(args.workers), args.n, args.repeat)
    ours = measure(lambda: arraymp.get_context(args.method).Pool(args.workers), args.n, args.repeat)
    print(f"{args.workers} workers, {args.method}, median of {args.repeat}; N = {args.n}")
    print("| workload | stdlib (s) | arraymp (s) | arraymp / stdlib |")
    print("|---|---|---|---|")
    for name in stdlib:
        print(f"| {name} | {stdlib[name]:.3f} | {ours[name]:.3f} | {ours[name] / stdlib[name]:.2f} |")


if __name__ == "__main__":
    main()
