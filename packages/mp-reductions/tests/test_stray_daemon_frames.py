"""Issue 42, item 6, as a program meets it (shm_manager Note [Booked counts]): a program shares an array under
``file_system`` and sends it to a reader again and again; between its messages a stray process of the same user
sends the group's cleanup daemon frames announcing counts nobody added (a hold, a take from pid 1, a claim with no
give, a give to a dead pid, all of them at once). Every message still arrives with its data, no FileNotFoundError,
and the segment goes once the program lets go. fork, spawn and forkserver readers."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import mp_reductions as mpr
import pytest
import shm_manager
from mp_reductions import _shared

STRAY = """
import json, os, struct, sys, time
import shm_manager
from shm_manager import _client
d, group, frames = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
shm_manager.join_group(group)
sock = _client._try_connect(shm_manager.member(d, group)[1], group)
for op, payload in frames:
    data = op.encode() + payload.encode()
    sock.sendall(struct.pack("<I", len(data)) + data)
time.sleep(0.2)
sock.close()
"""

FORGED = {
    "H": [["H", "{name}"]],
    "A from pid 1": [["A", "1:{name}"]],
    "C with no G": [["C", "1:{name}"]],
    "G to a dead pid": [["G", "999999999:1:{name}"]],
    "all, twice": [["H", "{name}"], ["A", "1:{name}"], ["C", "1:{name}"], ["G", "999999999:1:{name}"],
                   ["R", "{name}"], ["U", "{name}"]] * 2,
}


def _read(q, out, n):
    mpr.init_reductions()
    for _ in range(n):
        try:
            x = q.get(timeout=60)
            out.put(float(x[0]) if (x == 7).all() else f"wrong data {x[:4]}")
            del x
        except Exception as exc:
            out.put(repr(exc))


@pytest.fixture
def file_system():
    old = mpr.get_sharing_strategy()
    mpr.set_sharing_strategy("file_system")
    yield
    mpr.set_sharing_strategy(old)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_stray_clients_frames_leave_a_live_programs_shared_array_alone(file_system, method):
    a = mpr.empty_shared(1 << 18)  # 2 MiB: a named segment of its own
    a[:] = 7
    seg = _shared.segment_of(a)[0]
    path = os.path.join(seg.dir, seg.name)
    ctx = multiprocessing.get_context(method)
    q, out = mpr.Queue(ctx=ctx), ctx.SimpleQueue()
    reader = ctx.Process(target=_read, args=(q, out, 1 + len(FORGED)))
    reader.start()
    try:
        q.put(a)
        assert out.get() == 7.0
        for case, frames in FORGED.items():
            text = json.dumps(frames).replace("{name}", seg.name)
            r = subprocess.run([sys.executable, "-c", STRAY, seg.dir, shm_manager.group(), text], timeout=60,
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            time.sleep(0.3)  # the daemon has read them, and the stray's end
            q.put(a)
            got = out.get()
            assert got == 7.0 and os.path.exists(path), f"after a stray {case}, the reader got {got}"
    finally:
        reader.join(10)
        if reader.is_alive():  # (a failure above: it waits for messages that will not come)
            reader.kill()
            reader.join()
        q.close()
        q.join_thread()
    assert reader.exitcode == 0
    del a, seg
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(path)
