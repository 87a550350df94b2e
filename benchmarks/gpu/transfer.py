"""Device arrays of 4 KiB .. 1 GiB through a spawn Queue: CUDA IPC vs a copy through host memory."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from multiprocessing.reduction import ForkingPickler

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]


def consumer(q_in, q_out, via_host):
    import cupy
    import shm_cuda
    shm_cuda.init_reductions(ForkingPickler.register)
    while True:
        item = q_in.get()
        if item is None:
            return
        arr = cupy.asarray(item) if via_host else item
        cupy.cuda.get_current_stream().synchronize()
        q_out.put(arr.nbytes)
        del arr


def run(size, via_host, reps, ctx, cp):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q_in, q_out, via_host), daemon=True)
    p.start()
    arr = cp.ones(size // 4, dtype=cp.float32)
    q_in.put(cp.asnumpy(arr) if via_host else arr)  # warm-up
    q_out.get()
    t0 = time.perf_counter()
    for _ in range(reps):
        q_in.put(cp.asnumpy(arr) if via_host else arr)
        q_out.get()
    dt = (time.perf_counter() - t0) / reps
    q_in.put(None)
    p.join(60)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    import cupy as cp
    import shm_cuda
    if not shm_cuda.device_available():
        raise SystemExit("no CUDA device is visible: run this on a GPU machine")
    shm_cuda.init_reductions(ForkingPickler.register)
    ctx = mp.get_context("spawn")
    rows = []
    for size in SIZES:
        reps = 20 if size <= (16 << 20) else 3
        ipc = run(size, False, reps, ctx, cp)
        host = run(size, True, reps, ctx, cp)
        rows.append({"bytes": size, "cuda_ipc_s": ipc, "via_host_s": host, "speedup": host / ipc})
        print(f"{size:>12,} B  ipc {ipc * 1e3:9.3f} ms  via host {host * 1e3:9.3f} ms  x{host / ipc:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
