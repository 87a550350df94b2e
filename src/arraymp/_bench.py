"""Producer -> consumer through a Queue: arraymp against the stdlib and torch, in one run.

Systems (each a long-lived spawn consumer, so imports are paid once):

  arraymp   arraymp's Queue (--strategy: file_descriptor, the default, or file_system)
  stdlib    multiprocessing's Queue with plain pickling (arraymp's reducer removed)
  torch-fd  torch.multiprocessing's Queue with tensors, file_descriptor strategy
  torch-fs  the same, file_system strategy (torch systems only when torch imports)

Workloads, for 4 KiB ... 256 MiB arrays (--sizes), through a Queue(maxsize=2) (a steady stream):

  fresh      an array that is not in shared memory, so each message moves its
             bytes (torch: a new torch.from_numpy tensor each time, which torch
             copies into shared memory once per message, as we do);
  shared     an array already in shared memory (torch: a tensor after
             share_memory_()), so only a handle travels;
  ping-pong  a 16-element array to the consumer and back, over Queue and Pipe.

The systems alternate within each repeat; medians of the repeats are printed
with ratios, throughput in GiB/s (2^30 bytes per second). --quick (or
benchmarks/queue_transfer.py) for a short run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

import numpy as np

from ._benchkit import As, Status, human, meminfo, plain_pickling

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1, "": 1}  # longest suffix first


def parse_sizes(text: str) -> list[int]:
    """'4KiB,1MiB,256MiB' (or bytes: '4096,1048576') -> sizes in bytes."""
    sizes = []
    for item in text.split(","):
        item = item.strip()
        unit = next(u for u in UNITS if item.endswith(u))
        number = item[:len(item) - len(unit)].strip()
        if not number.isdigit() or int(number) * UNITS[unit] < 8:
            raise argparse.ArgumentTypeError(f"{item!r} is not a size of at least 8 bytes; write sizes like "
                                             "4KiB,1MiB,256MiB (units B, KiB, MiB, GiB) or in bytes")
        sizes.append(int(number) * UNITS[unit])
    return sizes


def _setup(system: str):
    """Make this process send the way ``system`` does; returns the module whose Queue/Pipe to use."""
    if system == "arraymp":
        import arraymp

        return arraymp.get_context("spawn")
    plain_pickling()
    if system == "stdlib":
        return multiprocessing.get_context("spawn")
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_descriptor" if system == "torch-fd" else "file_system")
    return tmp.get_context("spawn")


def _consumer(system, ctl, done, data, back, conn):
    _setup(system)
    while True:
        cmd = ctl.get()
        if cmd is None:
            return
        kind, n = cmd
        if kind == "stream":
            for _ in range(n):
                a = data.get()
                a[0]  # touch
                del a
            done.put(time.perf_counter())
        elif kind == "queue-pingpong":
            for _ in range(n):
                back.put(data.get())
            done.put(None)
        elif kind == "pipe-pingpong":
            for _ in range(n):
                conn.send(conn.recv())
            done.put(None)


class System:
    def __init__(self, name: str):
        self.name = name
        if name == "arraymp":
            import arraymp

            ctx = arraymp.get_context("spawn")
        elif name == "stdlib":
            ctx = multiprocessing.get_context("spawn")
        else:
            import torch.multiprocessing as tmp

            ctx = tmp.get_context("spawn")
        self.ctx = ctx
        self.ctl, self.done, self.data, self.back = ctx.Queue(), ctx.Queue(), ctx.Queue(maxsize=2), ctx.Queue()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_consumer, args=(name, self.ctl, self.done, self.data, self.back, child))
        with As(name):
            self.proc.start()

    def payload(self, nbytes: int, shared: bool):
        base = np.ones(nbytes // 8, np.float64)
        if self.name.startswith("torch"):
            import torch

            if shared:
                t = torch.from_numpy(base).clone()
                t.share_memory_()
                return lambda: t
            return lambda: torch.from_numpy(base)
        if shared:
            import arraymp

            s = arraymp.share_memory(base)
            return lambda: s
        return lambda: base

    def stream(self, nbytes: int, n: int, shared: bool) -> float:
        make = self.payload(nbytes, shared)
        with As(self.name):
            self.ctl.put(("stream", 3))  # warm-up: fill the recycling pools
            for _ in range(3):
                self.data.put(make())
            self.done.get()
            self.ctl.put(("stream", n))
            t0 = time.perf_counter()
            for _ in range(n):
                self.data.put(make())
            t1 = self.done.get()
        return t1 - t0

    def pingpong(self, n: int, pipe: bool) -> float:
        a = np.arange(16.0)
        with As(self.name):
            if self.name.startswith("torch"):
                import torch

                a = torch.from_numpy(a)
            self.ctl.put(("pipe-pingpong" if pipe else "queue-pingpong", n))
            t0 = time.perf_counter()
            for _ in range(n):
                if pipe:
                    self.conn.send(a)
                    self.conn.recv()
                else:
                    self.data.put(a)
                    self.back.get()
            dt = time.perf_counter() - t0
            self.done.get()
        return dt / n

    def close(self):
        self.ctl.put(None)
        self.proc.join(30)


def _count(nbytes: int, quick: bool) -> int:
    budget = (256 << 20) if quick else (4 << 30)  # bytes per run of a fresh stream
    return max(4 if quick else 12, min(3000 if quick else 20000, budget // nbytes))


def _mem_available() -> int:
    return meminfo("MemAvailable")


def _receive_all(q, done):
    a = q.get()
    done.put(float(a[:: 1 << 16].sum()))  # touch it across
    del a
    done.put(None)


def memory_peak(shared: bool, nbytes: int = 1 << 30) -> float:
    """Peak memory of the whole machine while one array goes producer -> consumer, in arrays' worth."""
    import threading

    import arraymp

    ctx = arraymp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive_all, args=(q, done))
    p.start()
    time.sleep(0.5)
    base, low, stop = _mem_available(), [_mem_available()], threading.Event()

    def sample():
        while not stop.is_set():
            low[0] = min(low[0], _mem_available())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    a = arraymp.zeros_shared(nbytes // 8) if shared else np.zeros(nbytes // 8)
    a[:] = 1.0
    q.put(a)
    done.get(timeout=300)
    stop.set()
    t.join()
    del a
    done.get(timeout=60)
    p.join(60)
    return (base - low[0]) / nbytes


def estimate(sizes: list[int], repeat: int, quick: bool, systems: list[str], pickled_rate: float) -> float:
    """Rough seconds of a run whose pickling Queue moves ``pickled_rate`` bytes/s: the stdlib's copies dominate."""
    streamed = sum((_count(n, quick) + 3) * n for n in sizes)  # one fresh stream of each size, warm-up included
    seconds = 2 * streamed / pickled_rate  # the stdlib pickles its "shared" arrays too
    seconds += (len(systems) - 1) * streamed / (2 << 30)  # arraymp, torch: one copy into a segment, ~2 GiB/s
    seconds += len(systems) * 4 * (300 if quick else 2000) * 300e-6  # ping-pong, Queue and Pipe
    seconds = repeat * seconds + 2 * len(systems)  # consumers' start
    return seconds if quick else seconds + 20  # the peak-memory runs


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def main(argv: list[str] | None = None, prog: str = "python -m arraymp bench") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer messages per size")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per workload; medians are printed")
    parser.add_argument("--sizes", type=parse_sizes, default=SIZES,
                        help="array sizes, comma-separated: 4KiB,1MiB,256MiB (units B, KiB, MiB, GiB; default "
                             "4KiB,64KiB,1MiB,16MiB,256MiB)")
    parser.add_argument("--strategy", choices=["file_descriptor", "file_system"], default="file_descriptor",
                        help="arraymp's sharing strategy (the sender's)")
    parser.add_argument("--overhead", action="store_true",
                        help="instead: the per-task and per-message cost of Pool, executor and Queue against the "
                             "stdlib's, under fork, spawn and forkserver (about 2 minutes)")
    parser.add_argument("--payloads", action="store_true",
                        help="instead: any payload (bytes, strings, dicts of small arrays, Arrow tables, DataFrames) "
                             "through Queue and Pool.map results against the stdlib, under fork, spawn and forkserver")
    parser.add_argument("--inputs", action="store_true",
                        help="instead: one big input (the first of --sizes if given, else 1 GiB) given to each of 16 "
                             "tasks of one Pool.starmap / map / imap and executor.map call, a plain array against one "
                             "shared first: seconds, the caller's copies, peak shared memory")
    parser.add_argument("--methods", default="fork,spawn,forkserver",
                        help="start methods of --payloads, comma-separated")
    parser.add_argument("--rows", default=None, help="--payloads: only the payloads whose name contains this")
    args = parser.parse_args(argv)
    if args.payloads:
        from ._payloads import main as payloads

        return payloads(repeat=args.repeat, quick=args.quick, methods=args.methods.split(","), only=args.rows)
    if args.overhead:
        from ._overhead import main as overhead

        return overhead(repeat=args.repeat)
    if args.inputs:
        from ._inputs import main as inputs

        return inputs(args.sizes[0] if args.sizes is not SIZES else 1 << 30, repeat=args.repeat)
    import arraymp  # registers our reducer, which _as() removes for the others

    arraymp.set_sharing_strategy(args.strategy)

    names = ["arraymp", "stdlib"]
    try:
        import torch  # noqa: F401

        names += ["torch-fd", "torch-fs"]
        others = "the stdlib (pickling) and torch (file_descriptor, file_system)"
    except ImportError:
        others = "the stdlib (pickling); not torch, which does not import (pip install torch==2.13.0)"
    status = Status()
    low, high = (estimate(args.sizes, args.repeat, args.quick, names, rate * (1 << 30)) for rate in (0.5, 0.15))
    status.line(f"{prog}: arrays producer -> consumer through a Queue(maxsize=2), and ping-pong over Queue and Pipe: "
                f"arraymp ({args.strategy}) against {others}")
    status.line(f"  sizes {', '.join(human(n) for n in args.sizes)}, fresh and shared; start method spawn, one "
                f"consumer per system; {args.repeat} repeats" + ("" if args.quick else ", then peak memory")
                + f"; about {_duration(low)} to {_duration(high)} on 2 cores"
                + ("" if args.quick else " (--quick: less)"))
    t_start = time.perf_counter()
    systems = [System(n) for n in names]
    results: dict[tuple, list[float]] = {}
    try:
        for r in range(args.repeat):
            for nbytes in args.sizes:
                for shared in (False, True):
                    for s in systems:
                        status.show(f"  repeat {r + 1}/{args.repeat}: {'shared' if shared else 'fresh'} "
                                    f"{human(nbytes)}, {s.name}")
                        # the stdlib pickles even a "shared" array: bound its run by bytes, as for fresh ones
                        copies = not shared or s.name == "stdlib"
                        n = _count(nbytes, args.quick) if copies else (1000 if args.quick else 5000)
                        dt = s.stream(nbytes, n, shared)
                        results.setdefault((s.name, nbytes, shared), []).append(n / dt)
            for pipe in (False, True):
                for s in systems:
                    status.show(f"  repeat {r + 1}/{args.repeat}: ping-pong {'Pipe' if pipe else 'Queue'}, {s.name}")
                    results.setdefault((s.name, "pingpong", pipe), []).append(s.pingpong(300 if args.quick else 2000,
                                                                                        pipe))
            status.line(f"  repeat {r + 1}/{args.repeat} done ({time.perf_counter() - t_start:.0f} s)")
    finally:
        status.done()
        for s in systems:
            s.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    cols = [n for n in names]
    print(f"\nmessages/s (and GiB/s for fresh arrays), median of {args.repeat}; ratio = arraymp / other; "
          f"arraymp's strategy: {args.strategy}")
    print(f"{'workload':22}" + "".join(f"{c:>23}" for c in cols) + "".join(f"{'x ' + c:>12}" for c in cols[1:]))
    for shared in (False, True):
        for nbytes in args.sizes:
            row = f"{('shared ' if shared else 'fresh ') + human(nbytes):22}"
            for c in cols:
                rate = med[(c, nbytes, shared)]
                row += f"{rate:10.0f}/s {rate * nbytes / (1 << 30):5.2f} GiB/s" if not shared else f"{rate:21.0f}/s"
            for c in cols[1:]:
                row += f"{med[('arraymp', nbytes, shared)] / med[(c, nbytes, shared)]:12.2f}"
            print(row)
    for pipe in (False, True):
        row = f"{'ping-pong ' + ('Pipe' if pipe else 'Queue'):22}"
        for c in cols:
            row += f"{med[(c, 'pingpong', pipe)] * 1e6:20.0f} us"
        for c in cols[1:]:
            row += f"{med[('arraymp', 'pingpong', pipe)] / med[(c, 'pingpong', pipe)]:12.2f}"
        print(row + "   (latency: ratio < 1 is faster)")
    if not args.quick:
        status.line("  peak memory of a 1 GiB transfer (arraymp)")
        print(f"\npeak memory sending one 1 GiB array (arraymp): pre-shared {memory_peak(True):.2f}x, "
              f"fresh {memory_peak(False):.2f}x the array")
    return 0


if __name__ == "__main__":
    sys.exit(main())
