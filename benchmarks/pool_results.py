"""The /dev/shm-leak scenario users hit with torch, against the stdlib Pool and torch's, in one run.

A pool of workers runs ``imap_unordered`` over N tasks (20,000 by default),
each returning a list of 5 float32 arrays of 100x100 (40 KB each); the parent
keeps every result, then deletes them and closes the pool. Each system runs in
a fresh process (``--one``); this script reports, per system:

- wall time of the run (pool start to pool joined) and its ratio to ours;
- segments alive at the peak (the parent holds every result at the end, so the
  end of the run is the peak; sampled at each quarter too), after the results
  are deleted and the pool is closed, and after the process exited:
  /dev/shm files for ``file_system``; for ``file_descriptor``, distinct
  shared-memory mappings in the parent (memfd or deleted /dev/shm files) and
  its open descriptors.

Systems: arraymp with the default inline threshold (40 KB arrays travel inline,
as the stdlib sends them), arraymp with the threshold at 0 (every result by
shared memory, one segment per message) under both strategies, the stdlib Pool
(plain pickling), and ``torch.multiprocessing.Pool`` returning tensors under
both torch strategies when torch is importable. A system that fails (torch runs
out of descriptors or mappings with 100,000 live tensors) is reported with its
error; the torch rows are then repeated at a size that fits, for a ratio.

    python benchmarks/pool_results.py [--n 20000] [--method fork] [--workers 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPE, PER_TASK = (100, 100), 5
PREFIXES = {"arraymp": "arraymp_", "torch": "torch_"}


# ---------------------------------------------------------------- in workers
def five_arrays(i):
    return [np.full(SHAPE, i, np.float32) for _ in range(PER_TASK)]


def five_tensors(i):
    import torch

    return [torch.full(SHAPE, float(i), dtype=torch.float32) for _ in range(PER_TASK)]


def plain_pickling():
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler._extra_reducers.pop(np.ndarray, None)


def arraymp_worker(threshold, strategy):
    import arraymp

    arraymp.set_inline_threshold(threshold)
    arraymp.set_sharing_strategy(strategy)


def torch_worker(strategy):
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy(strategy)


# ---------------------------------------------------------------- counting
def shm_files(prefix: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def shared_mappings() -> int:
    """Distinct shared-memory objects mapped in this process (memfd, or /dev/shm files)."""
    seen = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and ("/memfd:" in parts[5] or parts[5].startswith("/dev/shm/")):
                seen.add(parts[4])
    return len(seen)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- one system
def run_one(system: str, strategy: str, n: int, method: str, workers: int, threshold: int) -> dict:
    if system == "stdlib":
        import multiprocessing

        plain_pickling()
        ctx, func, init, initargs, prefix = multiprocessing.get_context(method), five_arrays, plain_pickling, (), None
    elif system == "arraymp":
        import arraymp

        arraymp.set_inline_threshold(threshold)
        arraymp.set_sharing_strategy(strategy)
        ctx, func, init, initargs = arraymp.get_context(method), five_arrays, arraymp_worker, (threshold, strategy)
        prefix = PREFIXES["arraymp"]
    else:
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy(strategy)
        ctx, func, init, initargs = torch.multiprocessing.get_context(method), five_tensors, torch_worker, (strategy,)
        prefix = PREFIXES["torch"]

    base_files = shm_files(prefix) if prefix else set()
    base_maps, base_fds = shared_mappings(), open_fds()

    def count() -> dict:
        return {"files": len(shm_files(prefix) - base_files) if prefix else 0,
                "mappings": shared_mappings() - base_maps, "fds": open_fds() - base_fds}

    peak = {"files": 0, "mappings": 0, "fds": 0}
    out = {"system": system, "strategy": strategy, "n": n}
    results, paused = [], 0.0
    t0 = time.perf_counter()
    try:
        pool = ctx.Pool(workers, initializer=init, initargs=initargs)
        try:
            for r in pool.imap_unordered(func, range(n), chunksize=1):
                results.append(r)
                if len(results) % max(1, n // 4) == 0:
                    t = time.perf_counter()
                    peak = {k: max(v, peak[k]) for k, v in count().items()}
                    paused += time.perf_counter() - t
            pool.close()
            pool.join()
        finally:
            pool.terminate()
    except Exception as e:  # torch out of descriptors / mappings: that is the result
        out["error"] = f"{type(e).__name__}: {e}"[:160]
        out["received"] = len(results)
        return out
    out["wall"] = time.perf_counter() - t0 - paused
    assert sorted(float(r[0][0, 0]) for r in results) == list(range(n)), "lost or wrong results"
    peak = {k: max(v, peak[k]) for k, v in count().items()}
    del results, r
    gc.collect()
    time.sleep(0.5)
    out.update(peak=peak, final=count())
    return out


# ---------------------------------------------------------------- the table
def spawn_one(args, system, strategy, n, threshold) -> dict:
    prefix = PREFIXES.get(system)
    before = shm_files(prefix) if prefix else set()
    cmd = [sys.executable, __file__, "--one", system, strategy, str(n), args.method, str(args.workers), str(threshold)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "strategy": strategy, "n": n, "error": f"timed out after {args.timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        out = {"system": system, "strategy": strategy, "n": n, "error": f"exit {proc.returncode}: {tail[0][:140]}"}
    else:
        out = json.loads(lines[-1])
    time.sleep(1.0)  # let daemons (shm-manager, torch_shm_manager) clean what the exit left
    out["after_exit"] = len(shm_files(prefix) - before) if prefix else 0
    return out


def label(r) -> str:
    extra = {"inline": " (inline)", "shm": " (threshold 0)"}.get(r.get("variant"), "")
    return f"{r['system']}{extra} {r['strategy']}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--method", default="fork", choices=["fork", "spawn", "forkserver"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--fits", type=int, default=2_000, help="n for the rerun of systems that failed")
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        system, strategy, n, method, workers, threshold = args.one
        print(json.dumps(run_one(system, strategy, int(n), method, int(workers), int(threshold))))
        return 0

    try:
        import torch  # noqa: F401

        has_torch = True
    except ImportError:
        has_torch = False
    plan = [("arraymp", "file_descriptor", 64 << 10, "inline"), ("arraymp", "file_descriptor", 0, "shm"),
            ("arraymp", "file_system", 0, "shm"), ("stdlib", "-", 0, None)]
    if has_torch:
        plan += [("torch", "file_descriptor", 0, None), ("torch", "file_system", 0, None)]

    def run(plan, n):
        rows = []
        for system, strategy, threshold, variant in plan:
            sys.stderr.write(f"{system} {strategy} n={n} ...\n")
            r = spawn_one(args, system, strategy, n, threshold)
            r["variant"] = variant
            rows.append(r)
        return rows

    rows = run(plan, args.n)
    failed = [(s, st, th, v) for (s, st, th, v), r in zip(plan, rows, strict=True) if "error" in r]
    if failed and args.fits < args.n:
        rows += run([plan[0], plan[1], *failed], args.fits)

    print(f"\nimap_unordered over N tasks x {PER_TASK} float32 {SHAPE[0]}x{SHAPE[1]} arrays, "
          f"{args.workers} workers, start method {args.method}; ratio = wall / arraymp (inline) wall at that N")
    print(f"{'system':40} {'N':>6} {'wall s':>7} {'ratio':>6} {'peak files/maps/fds':>20} "
          f"{'final files/maps/fds':>21} {'after exit':>10}")
    ref = {r["n"]: r["wall"] for r in rows if r.get("variant") == "inline" and "wall" in r}
    for r in rows:
        if "error" in r:
            got = f" after {r['received']} results" if "received" in r else ""
            print(f"{label(r):40} {r['n']:>6}  FAILED{got}: {r['error']}   after exit {r['after_exit']}")
            continue
        pk, fi = r["peak"], r["final"]
        ratio = r["wall"] / ref[r["n"]] if r["n"] in ref else float("nan")
        peak = f"{pk['files']}/{pk['mappings']}/{pk['fds']}"
        final = f"{fi['files']}/{fi['mappings']}/{fi['fds']}"
        print(f"{label(r):40} {r['n']:>6} {r['wall']:7.2f} {ratio:6.2f} {peak:>20} {final:>21} {r['after_exit']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
