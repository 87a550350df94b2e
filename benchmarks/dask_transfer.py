"""Arrays through a Dask cluster on one node: plain Dask against arraymp's Dask Pool, in one run.

One LocalCluster of 2 worker processes (1 thread each, loopback); 64 tasks,
each taking a 16 MiB float32 array and returning a new one of the same size:

- plain Dask: ``client.gather(client.map(work, arrays))``, as users write it;
- arraymp: ``mp.get_context("dask", address=<the same cluster>).Pool(2).map(work, arrays)``,
  arrays between processes as shared-memory handles;
- arraymp with ``same_node=False`` (Dask's bytes, through our serializer);
- arraymp with the inputs already in shared memory (``mp.share_memory``, outside
  the timing): the client sends names only, the workers still copy each result
  into a segment.

Reported per system: wall time (median of ``--repeat`` runs, after one warm-up),
its ratio to arraymp's, and the bytes through the loopback interface during one
run (psutil, system-wide ``lo``: other traffic on the machine counts too), with
arraymp's own counters (handles sent, array bytes sent in-band).

    python benchmarks/dask_transfer.py [--tasks 64] [--mib 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import psutil


def work(a):
    return a * 2


def lo_bytes() -> int:
    return psutil.net_io_counters(pernic=True)["lo"].bytes_sent


def measure(run, repeat: int) -> tuple[float, int]:
    run()  # warm-up: connections, imports, worker memory
    times, moved = [], None
    for _ in range(repeat):
        before, t0 = lo_bytes(), time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        moved = lo_bytes() - before if moved is None else moved
    return statistics.median(times), moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from distributed import Client, LocalCluster

    import arraymp as mp

    arrays = [np.full(args.mib << 18, i, np.float32) for i in range(args.tasks)]
    expect = [a * 2 for a in arrays[:2]]
    scratch = tempfile.mkdtemp(prefix="dask-transfer-")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None, local_directory=scratch) as cluster, \
            Client(cluster, set_as_default=False) as client:

        def plain():
            out = client.gather(client.map(work, arrays, pure=False))
            assert all(np.array_equal(o, e) for o, e in zip(out[:2], expect, strict=True))

        rows = [("plain Dask (client.map)", *measure(plain, args.repeat), None)]
        mp.set_sharing_strategy("file_system")  # named segments: what a Dask context sends as handles
        shared = mp.share_memory(arrays)
        for label, same_node, inputs in (("arraymp Pool.map", True, arrays),
                                         ("arraymp Pool.map, same_node=False", False, arrays),
                                         ("arraymp Pool.map, inputs in shared memory", True, shared)):
            with mp.get_context("dask", address=cluster.scheduler_address, same_node=same_node) as ctx, \
                    ctx.Pool(2) as pool:

                def ours(inputs=inputs):
                    out = pool.map(work, inputs)
                    assert all(np.array_equal(o, e) for o, e in zip(out[:2], expect, strict=True))

                ctx.reset_transfer_counters()
                t, moved = measure(ours, args.repeat)
                counts = {k: v // (args.repeat + 1) for k, v in ctx.transfer_counters().items()}
                rows.append((label, t, moved, counts))

    ours_t = rows[1][1]
    print(f"{args.tasks} tasks of {args.mib} MiB in and out, LocalCluster of 2 workers; median of {args.repeat}")
    print("| system | wall (s) | vs arraymp | loopback bytes | handles sent | in-band array bytes |")
    print("|---|---|---|---|---|---|")
    for label, t, moved, counts in rows:
        h = counts["handles_sent"] if counts else "-"
        b = f"{counts['inband_array_bytes']:,}" if counts else "-"
        print(f"| {label} | {t:.2f} | {t / ours_t:.1f}x | {moved:,} | {h} | {b} |")


if __name__ == "__main__":
    main()
