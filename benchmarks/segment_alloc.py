"""Segment allocation and copy bandwidth against plain numpy, in one run.

For sizes 4 KiB ... 256 MiB:
- alloc: create + reserve + map + first touch of a segment (memfd, and named in
  /dev/shm) against ``numpy.empty`` + fill;
- copy: copying an array into a fresh segment against ``numpy.copyto`` into a
  fresh ``numpy.empty``.
Medians of several repeats, alternating the systems; ratios > 1 mean the
segment is slower.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import shm_core

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]


def _time(fn, repeat):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _seg_alloc(n, named):
    def run():
        seg = shm_core.create(n) if named else shm_core.create_anonymous(n)
        v = seg.ndarray((n,), np.uint8)
        v.fill(1)
        del v
        if named:
            seg.unlink()
        seg.close()
    return run


def _np_alloc(n):
    def run():
        np.empty(n, np.uint8).fill(1)
    return run


def _seg_copy(src):
    def run():
        seg = shm_core.create_anonymous(src.nbytes)
        v = seg.ndarray(src.shape, src.dtype)
        np.copyto(v, src)
        del v
        seg.close()
    return run


def _np_copy(src):
    def run():
        np.copyto(np.empty_like(src), src)
    return run


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main():
    print(f"{'size':>8} | {'numpy alloc+fill':>16} {'memfd':>10} {'ratio':>6} {'named':>10} {'ratio':>6} | "
          f"{'numpy copy':>10} {'segment copy':>12} {'ratio':>6} {'GB/s':>6}")
    for n in SIZES:
        repeat = 30 if n <= 1 << 20 else 5
        src = np.ones(n, np.uint8)
        t = {k: [] for k in ("np", "fd", "named", "npc", "segc")}
        for _ in range(3):  # alternate the systems
            t["np"].append(_time(_np_alloc(n), repeat))
            t["fd"].append(_time(_seg_alloc(n, False), repeat))
            t["named"].append(_time(_seg_alloc(n, True), repeat))
            t["npc"].append(_time(_np_copy(src), repeat))
            t["segc"].append(_time(_seg_copy(src), repeat))
        m = {k: statistics.median(v) for k, v in t.items()}
        print(f"{human(n):>8} | {m['np'] * 1e6:14.1f}us {m['fd'] * 1e6:8.1f}us {m['fd'] / m['np']:6.2f} "
              f"{m['named'] * 1e6:8.1f}us {m['named'] / m['np']:6.2f} | {m['npc'] * 1e6:8.1f}us "
              f"{m['segc'] * 1e6:10.1f}us {m['segc'] / m['npc']:6.2f} {n / m['segc'] / 1e9:6.2f}")


if __name__ == "__main__":
    main()
