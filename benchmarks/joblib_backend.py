"""joblib's backend "arraymp" against loky (joblib's default) and joblib's multiprocessing backend, in one run.

Workloads (``n_jobs=2`` unless ``--workers``):

- ``big arrays``: ``Parallel()(delayed(f)(X, i) for i in range(64))`` where ``X`` is a 64 MiB float64 array and
  ``f`` returns a new 16 MiB array (a quarter of ``X`` plus ``i``); every result is kept until the call returns.
  loky memory-maps ``X`` (over ``max_nbytes``) and pickles each result through a pipe; arraymp shares ``X`` once
  per call and each result comes back by shared memory.
- ``cross_val_score``: scikit-learn's ``cross_val_score(RandomForestClassifier(n_estimators=50, random_state=0),
  X, y, cv=4, n_jobs=2)`` on ``make_classification(n_samples=2000, n_features=20)`` (skipped without sklearn).
- ``tiny tasks``: ``Parallel()(delayed(tiny)(i) for i in range(10_000))``, ``batch_size="auto"``.

Each backend keeps its workers between calls (loky's reusable executor, arraymp's reused pool; joblib's
multiprocessing backend starts a pool per call, which is part of its cost): one warm-up call each, then the median
of ``--repeat`` calls, the backends taking turns. Ratios are to loky's time (< 1: faster than loky). Wall time and
CPU time of all the processes (the caller and its workers) are both reported: on a loaded machine the wall time
favours the backend that keeps more processes busy (loky's caller unpickles every result while its two workers
run), the CPU time shows the work done. The load average is printed: the figures move with it.

    python benchmarks/joblib_backend.py [--workers 2] [--repeat 5] [--method fork] [--no-multiprocessing]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time

import numpy as np

MiB = 1 << 20
QUARTER = 16 * MiB // 8  # float64 elements in 16 MiB


def f(X, i):
    k = i % 4
    return X[k * QUARTER : (k + 1) * QUARTER] + i


def tiny(i):
    return i


def workloads(joblib, workers: int):
    from joblib import Parallel, delayed

    X = np.random.default_rng(0).random(64 * MiB // 8)

    def big():
        out = Parallel(n_jobs=workers)(delayed(f)(X, i) for i in range(64))
        assert len(out) == 64 and out[5][0] == X[QUARTER] + 5

    def tiny_tasks():
        assert Parallel(n_jobs=workers)(delayed(tiny)(i) for i in range(10_000))[-1] == 9_999

    runs = {"big arrays (64 x 16 MiB out)": big}
    try:
        from sklearn.datasets import make_classification
        from sklearn.ensemble import RandomForestClassifier
        from sklearn.model_selection import cross_val_score
    except ImportError:
        print("scikit-learn is not installed: cross_val_score skipped")
    else:
        Xc, yc = make_classification(n_samples=2000, n_features=20, random_state=0)

        def cv():
            model = RandomForestClassifier(n_estimators=50, random_state=0)
            return cross_val_score(model, Xc, yc, cv=4, n_jobs=workers)

        runs["cross_val_score (RF 50, cv=4)"] = cv
    runs["10,000 tiny tasks"] = tiny_tasks
    return runs


def cpu_seconds() -> float:
    """CPU time of this process and all its children so far: the reaped ones (joblib's multiprocessing backend
    ends its pool at each call) and the live ones (loky's and arraymp's workers, kept between calls)."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


_TICK = os.sysconf("SC_CLK_TCK")


def measure(joblib, backends: dict, run, repeat: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of ``run`` per backend: one warm-up call each, then the backends in turn
    ``repeat`` times (interleaved, so that a change in the machine's load falls on every backend alike)."""
    times: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
    for rep in range(-1, repeat):
        for b, params in backends.items():
            with joblib.parallel_config(backend=b, **params):
                c0, t0 = cpu_seconds(), time.perf_counter()
                run()
                t1 = time.perf_counter()
                if rep >= 0:  # -1: the warm-up (workers started, imports done)
                    times[b].append((t1 - t0, cpu_seconds() - c0))
    return {b: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for b, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--method",
        default=None,
        choices=["fork", "spawn", "forkserver"],
        help="arraymp's start method (default: arraymp's, the stdlib's current one)",
    )
    ap.add_argument("--no-multiprocessing", action="store_true", help="skip joblib's multiprocessing backend")
    args = ap.parse_args()

    import joblib
    from joblib.externals.loky import get_reusable_executor

    import arraymp
    import arraymp.joblib

    backends = {"loky": {}, "arraymp": {"start_method": args.method} if args.method else {}}
    if not args.no_multiprocessing:
        backends["multiprocessing"] = {}
    rows = []
    for name, run in workloads(joblib, args.workers).items():
        rows.append((name, measure(joblib, backends, run, args.repeat)))
    get_reusable_executor().shutdown(wait=True)
    arraymp.joblib.shutdown()

    method = args.method or arraymp.get_start_method()
    print(
        f"n_jobs={args.workers}, arraymp start method {method}, median of {args.repeat} warm calls; joblib "
        f"{joblib.__version__}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
    )
    for i, what in enumerate(["wall", "CPU (all processes)"]):
        print(f"\n{what} seconds")
        head = " | ".join(f"{b} (s)" for b in backends)
        ratios = " | ".join(f"{b} / loky" for b in backends if b != "loky")
        print(f"| workload | {head} | {ratios} |")
        print("|---" * (2 * len(backends)) + "|")
        for name, t in rows:
            cells = " | ".join(f"{t[b][i]:.3f}" for b in backends)
            rel = " | ".join(f"{t[b][i] / t['loky'][i]:.2f}" for b in backends if b != "loky")
            print(f"| {name} | {cells} | {rel} |")


if __name__ == "__main__":
    main()
