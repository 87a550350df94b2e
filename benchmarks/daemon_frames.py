"""What a frame costs shm-manager's daemon: its CPU time (utime + stime of the daemon process) per frame, for the
frames of the hot paths, sent on this process's connection in one go.

- ``H+X maker``: a segment's maker holds and gives back its count (the name carries its pid);
- ``H+X holder``: a process that added a count itself holds and gives it back (the name carries another pid:
  Note [Booked counts] reads the header to book it);
- ``T+A+X``: a Pool worker's result count told, its reader's take, the reader's release (Note [Counts sent to a
  reader]);
- ``R+U``: register and unregister, no count.

Run: ``python benchmarks/daemon_frames.py [iterations]`` (default 20,000 per kind), in a private /dev/shm.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time

import shm_core
import shm_manager
from shm_manager import _client

TICK = os.sysconf("SC_CLK_TCK")


def frame(op: bytes, payload: str) -> bytes:
    data = op + payload.encode()
    return struct.pack("<I", len(data)) + data


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run(kind: str, n: int, d: str) -> float:
    me, group = os.getpid(), shm_manager.group()
    maker = shm_manager.new_name()
    name = maker if kind == "H+X maker" else maker.replace(f"_{me}_", "_1_")  # another pid's name
    seg = shm_core.create(4096, name=name, dir=d)
    shm_manager.register(name, d)
    seg.incref()  # a count nobody books: the segment outlives every give-back below
    shm_manager.flush()
    daemon = shm_manager.daemon_pid(d)
    if kind.startswith("H+X"):
        seg.incref(n)  # each H's count, added by this process as it would before telling
        frames = (frame(b"H", name) + frame(b"X", name)) * n
        per = 2
    elif kind == "T+A+X":
        seg.incref(n)  # each result's in-flight count
        frames = (frame(b"T", f"{me}:{name}") + frame(b"A", f"{me}:{name}") + frame(b"X", name)) * n
        per = 3
    else:
        frames = (frame(b"R", name) + frame(b"U", name)) * n
        per = 2
    sentinel = shm_core.create(64, name=shm_manager.new_name(), dir=d)
    shm_manager.hold(sentinel.name, d)
    sentinel.incref()
    shm_manager.flush()
    time.sleep(0.2)
    before = cpu(daemon)
    with _client._lock:
        sock = _client._conn(d, group).sock
        sock.setblocking(True)
        sock.sendall(frames + frame(b"X", sentinel.name))  # the sentinel goes once the daemon read all before it
    while os.path.exists(sentinel.path):
        time.sleep(0.001)
    spent = cpu(daemon) - before
    sentinel.close()
    seg.decref(seg.refcount)
    seg.unlink()
    shm_manager.unregister(name, d)
    seg.close()
    return spent / (n * per) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        os.environ["ARRAYMP_SHM_DIR"] = d
        for kind in ("R+U", "H+X maker", "H+X holder", "T+A+X"):
            print(f"{kind:12} {run(kind, n, d):6.2f} us of daemon CPU per frame", flush=True)


if __name__ == "__main__":
    main()
