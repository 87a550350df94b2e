"""Start + join time of mp_spawn against the stdlib and torch, in one run.

For each start method (fork, forkserver, spawn) and nprocs 1, 2, 4, the time
from the call to the return of a blocking ``start_processes`` whose children
do nothing, with two argument sizes:

- ``small``: no arguments;
- ``1 MiB``: one 1 MiB bytes argument.  More than a pipe holds, so each
  ``Process.start()`` for spawn/forkserver waits until the child has booted
  and read it: this is where a parallel start pays.

Columns: ``stdlib`` plain ``multiprocessing.Process`` start + join (no
supervision); ``seq`` mp_spawn with ``MP_SPAWN_PARALLEL_START=0``; ``par``
mp_spawn's default (parallel for spawn and forkserver; fork always starts
sequentially); ``torch`` ``torch.multiprocessing.start_processes`` when torch
imports.  Medians of several repeats, in milliseconds; ratios < 1 mean
mp_spawn's parallel start is faster.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

import mp_spawn

METHODS = ["fork", "forkserver", "spawn"]
NPROCS = [1, 2, 4]
PAYLOADS = {"small": (), "1 MiB": (b"x" * (1 << 20),)}
REPEAT = 5


def noop(i, *args):
    pass


def _stdlib(method, nprocs, args):
    ctx = multiprocessing.get_context(method)
    procs = [ctx.Process(target=noop, args=(i, *args)) for i in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def _mp_spawn(parallel):
    def run(method, nprocs, args):
        os.environ[mp_spawn.ENV_VAR_PARALLEL_START] = "1" if parallel else "0"
        mp_spawn.start_processes(noop, args=args, nprocs=nprocs, start_method=method)

    return run


def _torch():
    try:
        import torch.multiprocessing as tmp
    except ImportError:
        return None

    def run(method, nprocs, args):
        tmp.start_processes(noop, args=args, nprocs=nprocs, start_method=method)

    return run


def _median_ms(fn, method, nprocs, args):
    fn(method, nprocs, args)  # warm up (forkserver, resource tracker, imports)
    times = []
    for _ in range(REPEAT):
        t = time.perf_counter()
        fn(method, nprocs, args)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main():
    torch_run = _torch()
    systems = {"stdlib": _stdlib, "seq": _mp_spawn(False), "par": _mp_spawn(True)}
    if torch_run is not None:
        systems["torch"] = torch_run
    print(f"mp_spawn {mp_spawn.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"start + join of nprocs no-op children, median of {REPEAT}, ms")
    if torch_run is None:
        print("(torch is not installed: no torch column)")
    header = ["method", "args", "nprocs", *systems, "par/seq", "par/stdlib"]
    if torch_run is not None:
        header.append("par/torch")
    rows = []
    for method in METHODS:
        for payload, args in PAYLOADS.items():
            for nprocs in NPROCS:
                ms = {name: _median_ms(fn, method, nprocs, args) for name, fn in systems.items()}
                row = [method, payload, str(nprocs), *(f"{ms[name]:.1f}" for name in systems)]
                row += [f"{ms['par'] / ms['seq']:.2f}", f"{ms['par'] / ms['stdlib']:.2f}"]
                if torch_run is not None:
                    row.append(f"{ms['par'] / ms['torch']:.2f}")
                rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
