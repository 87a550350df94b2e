"""Any payload, not only arrays: arraymp's time over the stdlib's, in one run, under each start method.

Each payload (bytes, strings, lists, dicts of small arrays, Arrow tables, DataFrames, a sparse matrix, an ML
batch) goes two ways, for arraymp and for the stdlib (plain pickling) in turns within each repeat:

  Queue      N puts of the payload into a Queue(maxsize=2), a long-lived consumer gets each; timed from the
             first put to the consumer's last get
  Pool.map   pool.map over N tasks each returning the payload (made once per worker), 2 workers; for the
             small payloads (many tasks, a map of milliseconds), the best of SHORT_MAPS maps per repeat

Times are medians of the repeats; ratio = arraymp / stdlib (< 1: arraymp is faster). ``peak MiB`` is the
high-water mark of resident memory of the producer and the consumer together during a Queue run (each reset
before it; shared pages count in both), arraymp / stdlib; ``cpu`` the ratio of the CPU time producer and consumer
spent on a Queue run (steadier than the times on a loaded machine). Rows whose package (pyarrow, pandas, scipy) does not
import are skipped, with a word.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import numpy as np

from ._benchkit import As, plain_pickling

METHODS = ("fork", "spawn", "forkserver")
BUDGET = 256 << 20  # bytes per Queue run (at least 4, at most 2000 messages)


def _table(nbytes: int):
    import pyarrow as pa

    n = nbytes // 16
    return pa.table({"a": np.arange(n, dtype=np.float64), "b": np.ones(n)})


def _frame(nbytes: int):
    import pandas as pd

    n = nbytes // 24
    return pd.DataFrame({"a": np.arange(n, dtype=np.float64), "b": np.ones(n), "c": np.zeros(n)})


def _strings():
    import pandas as pd

    n = 100_000
    return pd.DataFrame({"name": [f"item-{i}" for i in range(n)], "x": np.arange(n, dtype=np.float64)})


def _csr():
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    return sp.random(100_000, 100_000, density=1e-4, format="csr", random_state=rng)


# name -> (maker, package it needs or None, Pool.map tasks)
PAYLOADS = {
    "bytes 64 MiB": (lambda: np.ones(8 << 20).tobytes(), None, 4),
    "bytearray 16 MiB": (lambda: bytearray(np.ones(2 << 20).tobytes()), None, 16),
    "str 16 MiB": (lambda: "x" * (16 << 20), None, 16),
    "list of 1M floats": (lambda: [float(i) for i in range(1_000_000)], None, 16),
    "dict of 1,000 arrays of 100 float64": (lambda: {f"k{i}": np.full(100, float(i)) for i in range(1000)}, None,
                                            200),
    "list of 500 arrays of 4 KiB": (lambda: [np.full(512, float(i)) for i in range(500)], None, 200),
    "tuple of a few small objects": (lambda: (1, "two", 3.0, b"four", np.arange(5)), None, 2000),
    "dict of 50 arrays of 64 float32": (lambda: {f"k{i}": np.full(64, i, np.float32) for i in range(50)}, None,
                                        2000),
    "pyarrow Table 64 MB": (lambda: _table(64_000_000), "pyarrow", 4),
    "numeric DataFrame 96 MB": (lambda: _frame(96_000_000), "pandas", 4),
    "DataFrame with a string column": (_strings, "pandas", 16),
    "scipy CSR 1M nnz": (_csr, "scipy", 16),
    "ML batch dict (786 KB image)": (lambda: {"image": np.ones((512, 512, 3), np.uint8), "label": np.arange(32),
                                              "id": "batch-0"}, None, 200),
}

_made: dict = {}
KEEP_AFTER = 16  # Pool.map tasks at most for a payload to be made once per worker (a large one)
SHORT_MAPS = 3  # maps timed per repeat (the best kept) for a payload of more tasks than KEEP_AFTER


def make(name: str):
    """The payload ``name``: a new one each call when it is small (a task's result; one object returned by every
    task of a chunk would be pickled once, by the pickle's memo), else made once per process."""
    maker, _, tasks = PAYLOADS[name]
    if tasks > KEEP_AFTER:
        return maker()
    obj = _made.get(name)
    if obj is None:
        obj = _made[name] = maker()
    return obj


def _nbytes(obj) -> int:
    import pickle

    return len(pickle.dumps(obj, 5, buffer_callback=lambda b: False)) + sum(
        memoryview(b).nbytes for b in _buffers(obj))


def _buffers(obj) -> list:
    import pickle

    bufs = []
    pickle.dumps(obj, 5, buffer_callback=bufs.append)
    return bufs


def _count(nbytes: int, quick: bool) -> int:
    return max(4, min(500 if quick else 2000, (BUDGET // (4 if quick else 1)) // max(nbytes, 1)))


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _consumer(system: str, ctl, done, data) -> None:
    if system == "stdlib":
        plain_pickling()
    while True:
        n = ctl.get()
        if n is None:
            return
        _hwm_reset()
        cpu = time.process_time()
        for _ in range(n):
            obj = data.get()
            del obj
        done.put((time.perf_counter(), _hwm(), time.process_time() - cpu))


def _worker_init(system: str) -> None:
    if system == "stdlib":
        plain_pickling()


class _System:
    def __init__(self, name: str, method: str):
        import arraymp

        self.name = name
        ctx = (arraymp if name == "arraymp" else multiprocessing).get_context(method)
        self.ctl, self.done, self.data = ctx.Queue(), ctx.Queue(), ctx.Queue(maxsize=2)
        with As(name):
            self.proc = ctx.Process(target=_consumer, args=(name, self.ctl, self.done, self.data), daemon=True)
            self.proc.start()
            self.pool = ctx.Pool(2, initializer=_worker_init, initargs=(name,))

    def queue(self, obj, n: int) -> tuple[float, float, int]:
        with As(self.name):
            self.ctl.put(2)  # warm-up: the recycling pools
            for _ in range(2):
                self.data.put(obj)
            self.done.get()
            self.ctl.put(n)
            _hwm_reset()
            t0, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                self.data.put(obj)
            cpu = time.process_time() - cpu
            t1, peak, their_cpu = self.done.get(timeout=600)  # (a hang guard)
        return t1 - t0, cpu + their_cpu, peak + _hwm()

    def pool_map(self, name: str, n: int) -> float:
        """Seconds of one ``map`` of ``n`` tasks: the best of SHORT_MAPS for small payloads, whose map lasts
        milliseconds (8 chunks on 2 workers), so that one late wake-up does not make the cell."""
        best = float("inf")
        with As(self.name):
            self.pool.map(make, [name] * 4, chunksize=1)  # warm-up: each worker makes its payload
            for _ in range(1 if n <= KEEP_AFTER else SHORT_MAPS):
                t0 = time.perf_counter()
                out = self.pool.map(make, [name] * n, chunksize=1 if n <= KEEP_AFTER else None)
                best = min(best, time.perf_counter() - t0)
                del out
        return best

    def close(self) -> None:
        self.ctl.put(None)
        self.pool.terminate()
        self.pool.join()
        self.proc.join(30)


def available(names) -> tuple[list[str], list[str]]:
    """The payloads whose package imports, and a word for each that does not."""
    import importlib

    rows, skipped = [], []
    for name in names:
        pkg = PAYLOADS[name][1]
        if pkg is not None:
            try:
                importlib.import_module(pkg)
            except ImportError:
                skipped.append(f"{name}: skipped, {pkg} does not import (pip install {pkg})")
                continue
        rows.append(name)
    return rows, skipped


def main(repeat: int = 3, quick: bool = False, methods=METHODS, only: str | None = None) -> int:
    import arraymp  # noqa: F401  (registers our reducer, which As() removes for the stdlib)

    from ._benchkit import Status

    names = [n for n in PAYLOADS if only is None or only.lower() in n.lower()]
    rows, skipped = available(names)
    status = Status()
    status.line(f"payloads through Queue and Pool.map results, arraymp against the stdlib, under "
                f"{', '.join(methods)}; median of {repeat} repeats")
    for line in skipped:
        status.line("  " + line)
    payloads = {name: PAYLOADS[name][0]() for name in rows}
    sizes = {name: _nbytes(obj) for name, obj in payloads.items()}
    results: dict[tuple, list] = {}
    for method in methods:
        systems = [_System(s, method) for s in ("stdlib", "arraymp")]
        try:
            for r in range(repeat):
                status.line(f"  {method}: repeat {r + 1}/{repeat}")
                for name in rows:
                    n = _count(sizes[name], quick)
                    tasks = max(2, PAYLOADS[name][2] // (4 if quick else 1))
                    for s in systems:
                        status.show(f"  {method} {r + 1}/{repeat}: {name}, {s.name}")
                        dt, cpu, peak = s.queue(payloads[name], n)
                        results.setdefault((method, name, "queue", s.name), []).append(dt / n)
                        results.setdefault((method, name, "cpu", s.name), []).append(cpu / n)
                        results.setdefault((method, name, "peak", s.name), []).append(peak)
                        results.setdefault((method, name, "pool", s.name), []).append(s.pool_map(name, tasks) / tasks)
        finally:
            status.done()
            for s in systems:
                s.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nper message (Queue) and per task (Pool.map result), median of {repeat}; ratio = arraymp / stdlib "
          "(< 1: arraymp is faster); peak = resident high-water mark, producer + consumer, arraymp / stdlib")
    head = f"{'payload':38}{'size':>10}"
    for method in methods:
        head += f"{method + ' Queue':>17}{'cpu':>6}{'Pool.map':>10}{'peak MiB':>14}"
    print(head)
    for name in rows:
        line = f"{name:38}{_human(sizes[name]):>10}"
        for method in methods:
            q, c, p = (med[(method, name, k, "arraymp")] / med[(method, name, k, "stdlib")]
                       for k in ("queue", "cpu", "pool"))
            mem = "/".join(f"{med[(method, name, 'peak', s)] / 2**20:.0f}" for s in ("arraymp", "stdlib"))
            line += f"{q:17.2f}{c:6.2f}{p:10.2f}{mem:>14}"
        print(line)
    for line in skipped:
        print(line)
    return 0


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 2**10:.0f} KiB" if n >= 1 << 10 else f"{n} B"
