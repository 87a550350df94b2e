"""The holders of the lifecycle state machine (test_lifecycle_machine): the test process and its workers.

A holder keeps items (an array, or a dict of arrays from share_memory) under
keys the machine gives; every write fills an item with one number, so an item
reads as that number or as None (mixed: a lost or torn write). The same
operations run in the test process (``Holder``) and, driven by commands on a
stdlib Pipe, in each worker (``worker``); items travel on mp_reductions
Queues, one inbox per holder, with their key::

    test process ──cmd──▶ worker 0 ──inbox 1──▶ worker 1
         ▲  │                 ▲                    │
         │  └───inbox 0───────┘                    │
         └──────────────── inbox "p" ◀─────────────┘
"""

import faulthandler
import signal
import traceback

import mp_reductions as mpr
import numpy as np
from _budget_targets import start

#: kind -> (number of int64 elements, constructor); "dict" is share_memory of two arrays, one segment for both
SHARED_KINDS = {
    "tiny": (2, mpr.zeros_shared),  # 16 bytes, from an arena
    "small": (16, mpr.empty_shared),  # 128 bytes, from an arena
    "page": (512, mpr.zeros_shared),  # 4 KiB, from an arena
    "arena_max": (8192, mpr.empty_shared),  # 64 KiB: the largest array an arena serves
    "big": (8200, mpr.zeros_shared),  # just over: a segment of its own
    "mib": (1 << 17, mpr.empty_shared),  # 1 MiB
    "arena_size": (1 << 19, mpr.zeros_shared),  # 4 MiB, an arena's size
    "dict": (4096 + 64, None),  # share_memory({"w": 4096 elements, "b": 64 elements})
}
#: born in shared memory by numpy itself (the shared handler, _alloc; under file_system numpy's own memory, sent as
#: a copy): made at half its size and grown in place, so numpy's realloc moves it to a new segment
BORN_KINDS = {"born": (1 << 18) + 1024}  # 2 MiB + 8 KiB
#: unshared arrays: over the inline threshold they travel as copies in (recycled) segments, under it inline
UNSHARED_KINDS = {"copy": 12_800, "copy_large": 40_000, "inline": 100}
TIMEOUT = 60


def nbytes(kind: str) -> int:
    return 8 * ({**BORN_KINDS, **UNSHARED_KINDS}[kind] if kind not in SHARED_KINDS else SHARED_KINDS[kind][0])


def travels_shared(kind: str, strategy: str) -> bool:
    return kind in SHARED_KINDS or kind in BORN_KINDS and strategy == "file_descriptor"


def make(kind: str):
    if kind == "dict":
        return mpr.share_memory({"w": np.zeros((64, 64), np.int64), "b": np.zeros(64, np.int64)})
    if kind in UNSHARED_KINDS:
        return np.zeros(UNSHARED_KINDS[kind], np.int64)
    if kind in BORN_KINDS:
        with mpr.shared_allocation():
            a = np.zeros(BORN_KINDS[kind] // 2, np.int64)
            a.resize(BORN_KINDS[kind], refcheck=False)
        return a
    elements, constructor = SHARED_KINDS[kind]
    return constructor(elements, np.int64)


def arrays(item):
    return list(item.values()) if isinstance(item, dict) else [item]


def fill(item, value: int) -> None:
    for a in arrays(item):
        a.fill(value)


def read(item):
    """The number every element of ``item`` holds, or None if they differ."""
    values = {int(a.flat[0]) for a in arrays(item)}
    if len(values) == 1 and all((a == a.flat[0]).all() for a in arrays(item)):
        return values.pop()
    return None


class Holder:
    """Items under keys, and the operations the machine runs on them (in this process or a worker)."""

    def __init__(self, me, inboxes):
        self.me, self.inboxes, self.items = me, inboxes, {}

    def make(self, keys, kind, values):
        for key, value in zip(keys, values, strict=True):
            self.items[key] = make(kind)
            fill(self.items[key], value)

    def send(self, keys, dest, new_keys, drop):
        for key, new_key in zip(keys, new_keys, strict=True):
            self.inboxes[dest].put((new_key, self.items[key]))
            if drop:
                del self.items[key]

    def burst(self, keys, kind, values, dest, new_keys, drop):
        for key, value, new_key in zip(keys, values, new_keys, strict=True):
            self.make([key], kind, [value])
            self.send([key], dest, [new_key], drop)

    def resend(self, key, dest, new_key):
        """Send one item; the OSError of a segment that cannot be re-opened is returned, not raised."""
        try:
            self.send([key], dest, [new_key], False)
        except OSError as exc:
            return str(exc)
        return None

    def recv(self, keys):
        for key in keys:
            got_key, item = self.inboxes[self.me].get(timeout=TIMEOUT)
            assert got_key == key, f"holder {self.me} expected item {key}, got {got_key}"
            self.items[key] = item

    def write(self, key, value):
        fill(self.items[key], value)

    def drop(self, keys):
        for key in keys:
            del self.items[key]

    def read_all(self):
        return {key: read(item) for key, item in self.items.items()}


def worker(cmds, me, inboxes, strategy, nofile):
    """Run the machine's commands (method name, args) until "stop"; reply ("ok", result) or ("error", traceback)."""
    start(strategy, nofile)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the machine asks for our stacks when we hang
    holder = Holder(me, inboxes)
    cmds.send(("ok", None))  # ready: the machine counts this process's descriptors from here
    while True:
        op, args = cmds.recv()
        if op == "stop":
            holder.items.clear()
            cmds.send(("ok", None))
            return
        try:
            cmds.send(("ok", getattr(holder, op)(*args)))
        except Exception:
            cmds.send(("error", traceback.format_exc()))
