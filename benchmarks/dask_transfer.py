"""Arrays through a Dask cluster: plain Dask against arraymp's Dask Pool, in one run, on one node and on three.

Layouts (``--layout``, both by default):

- one node: a LocalCluster of 2 worker processes (1 thread each, loopback), the
  client beside them: arraymp moves arrays between them as shared-memory handles;
- two nodes: the client and the scheduler on one node, one worker (1 thread) on
  each of two others, each node a mount namespace with a /dev/shm of its own on
  a loopback address of its own (packages/mp-dask/nodes, as the multi-node
  tests make them; root only: skipped, saying why, elsewhere). No process of
  the client's node shares memory with a worker: arraymp sends Dask's bytes.

In each, 64 tasks, each taking a 16 MiB float32 array and returning a new one
of the same size:

- plain Dask: ``client.gather(client.map(work, arrays))``, as users write it;
- arraymp: ``mp.get_context("dask", address=<the same cluster>).Pool(2).map(work, arrays)``;
- arraymp with ``same_node=False`` (Dask's bytes, through our serializer);
- arraymp with the inputs already in shared memory (``mp.share_memory``, outside
  the timing): within a node the client sends names only, the workers still
  copy each result into a segment.

Reported per system: wall time (median of ``--repeat`` runs, after one warm-up),
its ratio to plain Dask's, and the bytes through the loopback interface during
one run (psutil, system-wide ``lo``: other traffic on the machine counts too),
with arraymp's own counters (handles sent, array bytes sent in-band).

    python benchmarks/dask_transfer.py [--tasks 64] [--mib 16] [--repeat 3] [--layout one,two]
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import statistics
import sys
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


@contextlib.contextmanager
def one_node(scratch: str):
    """A LocalCluster of 2 workers beside the client; its scheduler's address."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                      local_directory=scratch) as cluster:
        yield cluster.scheduler_address


@contextlib.contextmanager
def two_nodes(scratch: str):
    """The scheduler on the client's node, a worker on each of two nodes of their own memory; its address."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "packages" / "mp-dask" / "nodes"))
    import nodes
    from distributed import Client

    env = nodes.base_env()
    sched, address = nodes.scheduler("127.0.0.1", scratch, env, host_shm=True)
    made = [sched]
    try:
        made += [nodes.workers(name, host, address, scratch, env) for name, host in (("b", "127.0.0.3"),
                                                                                    ("c", "127.0.0.4"))]
        with Client(address, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for node in made:
            node.close()


def run(address: str, arrays: list, repeat: int) -> list[tuple]:
    """The rows of one layout: (system, wall, loopback bytes, arraymp's counters)."""
    from distributed import Client

    import arraymp as mp

    expect = [a * 2 for a in arrays[:2]]
    with Client(address, set_as_default=False) as client:

        def plain():
            out = client.gather(client.map(work, arrays, pure=False))
            assert all(np.array_equal(o, e) for o, e in zip(out[:2], expect, strict=True))

        rows = [("plain Dask (client.map)", *measure(plain, repeat), None)]
    mp.set_sharing_strategy("file_system")  # named segments: what a Dask context sends as handles
    shared = mp.share_memory(arrays)
    for label, same_node, inputs in (("arraymp Pool.map", True, arrays),
                                     ("arraymp Pool.map, same_node=False", False, arrays),
                                     ("arraymp Pool.map, inputs in shared memory", True, shared)):
        with mp.get_context("dask", address=address, same_node=same_node) as ctx, ctx.Pool(2) as pool:

            def ours(inputs=inputs):
                out = pool.map(work, inputs)
                assert all(np.array_equal(o, e) for o, e in zip(out[:2], expect, strict=True))

            ctx.reset_transfer_counters()
            t, moved = measure(ours, repeat)
            counts = {k: v // (repeat + 1) for k, v in ctx.transfer_counters().items()}
            rows.append((label, t, moved, counts))
    return rows


def report(title: str, rows: list[tuple]) -> None:
    plain_t = rows[0][1]
    print(f"\n{title}")
    print("| system | wall (s) | plain Dask's / this | loopback bytes | handles sent | in-band array bytes |")
    print("|---|---|---|---|---|---|")
    for label, t, moved, counts in rows:
        h = counts["handles_sent"] if counts else "-"
        b = f"{counts['inband_array_bytes']:,}" if counts else "-"
        print(f"| {label} | {t:.2f} | {plain_t / t:.1f}x | {moved:,} | {h} | {b} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layout", default="one,two", help="one, two, or both (one,two)")
    args = ap.parse_args()
    layouts = args.layout.split(",")

    arrays = [np.full(args.mib << 18, i, np.float32) for i in range(args.tasks)]
    what = f"{args.tasks} tasks of {args.mib} MiB in and out; median of {args.repeat}"
    scratch = tempfile.mkdtemp(prefix="dask-transfer-")
    try:
        if "one" in layouts:
            with one_node(scratch) as address:
                report(f"One node (LocalCluster of 2 workers): {what}", run(address, arrays, args.repeat))
        if "two" in layouts:
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "packages" / "mp-dask" / "nodes"))
            import nodes

            why = nodes.unavailable()
            if why is not None:
                print(f"\nTwo nodes: skipped: {why}")
            else:
                with two_nodes(scratch) as address:
                    report(f"Client on one node, a worker on each of two others (own /dev/shm each): {what}",
                           run(address, arrays, args.repeat))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
