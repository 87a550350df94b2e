"""Issue 42, item 6 (Note [Booked counts], _books.py): a frame from a stray process of the same user announcing a
count nobody added, alone, twice, on two connections, naming another process, a dead one or one that is not its
child, or interleaved with others, makes the daemon give back nothing: the live program's segment keeps its count,
a process that receives its name attaches it, and the daemon serves on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import shm_core
import shm_manager
from conftest import HERE, wait_until
from shm_manager import _paths

NAME = "<name>"
LIVE = "<live>"  # the live program's pid; <live start>: its start time

CASES = {
    "H": [[["H", NAME]]],
    "H twice": [[["H", NAME], ["H", NAME]]],
    "H on two connections": [[["H", NAME]], [["H", NAME]]],
    "A from pid 1": [[["A", f"1:{NAME}"]]],
    "A from the live program": [[["A", f"{LIVE}:{NAME}"]]],
    "A from itself": [[["A", f"{{me}}:{NAME}"]]],
    "C with no G": [[["C", f"1:{NAME}"]]],
    "C with its own start and no G": [[["C", f"{{start}}:{NAME}"]]],
    "G to a dead pid": [[["G", f"999999999:1:{NAME}"]]],
    "G to its own dead child": [[["G", f"{{dead}}:{NAME}"]]],
    "G to the live program (not its child)": [[["G", f"{LIVE}:<live start>:{NAME}"]]],
    "G to another process (not its child), which then dies": [[["G", f"<other>:{NAME}"]]],
    "G to its live child, which claims it": [[["G", f"{{child}}:{NAME}"], ["C", f"{{claim}}{NAME}"]]],
    "C of its live child, then G": [[["C", f"{{claim}}{NAME}"], ["G", f"{{child}}:{NAME}"]]],
    "R then U": [[["R", NAME], ["U", NAME]]],
    "T to the live program, then V": [[["T", f"{LIVE}:{NAME}"], ["V", f"{LIVE}:{NAME}"]]],
    "X": [[["X", NAME]]],
    "D then A from the live program": [[["D", f"{LIVE}:{NAME}"], ["A", f"{LIVE}:{NAME}"]]],
}
CASES["all of them, on two connections"] = [
    [frame for case in list(CASES.values())[::2] for conn in case for frame in conn],
    [frame for case in list(CASES.values())[1::2] for conn in case for frame in conn],
]

# While a message naming the segment is in flight, its header holds a count on nobody's books (its reader has not
# taken it over yet): frames that announce a count may then take that one (the limit Note [Booked counts] states),
# but a G must still come from the child's parent, and a process holds one count on its word at a time.
IN_FLIGHT = {
    "G to a dead pid": [[["G", f"999999999:1:{NAME}"]]],
    "G to the live program (not its child)": CASES["G to the live program (not its child)"],
    "G to another process (not its child), which then dies": CASES[
        "G to another process (not its child), which then dies"],
    "a holder's H twice": [[["+", NAME], ["H", NAME], ["H", NAME]]],
    "a holder's H on two connections": [[["+", NAME], ["H", NAME]], [["H", NAME]]],
}

RECEIVER = """
import sys, shm_core
seg = shm_core.attach(sys.argv[1], sys.argv[2])
print(bytes(memoryview(seg)[:4]).hex(), flush=True)
"""


def stray(d: str, group: str, conns, name: str, other: int) -> None:
    fill = {NAME: name, LIVE: str(os.getpid()), "<live start>": str(_paths.start_time(os.getpid())),
            "<other>": f"{other}:{_paths.start_time(other)}"}
    text = json.dumps(conns)
    for key, value in fill.items():
        text = text.replace(key, value)
    r = subprocess.run([sys.executable, os.path.join(HERE, "_stray.py"), d, group, text], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, ARRAYMP_GROUP=group))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("case, in_flight", [(case, False) for case in CASES] + [(case, True) for case in IN_FLIGHT])
def test_a_stray_frame_gives_back_no_count_of_a_live_program(tmp_path, monkeypatch, case, in_flight):
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))
    frames = (IN_FLIGHT if in_flight else CASES)[case]
    d = str(tmp_path)
    seg = shm_core.create(4096, name=shm_manager.new_name(), dir=d)  # the live program's array
    shm_manager.register(seg.name, d)
    shm_manager.hold(seg.name, d)
    seg.incref()
    memoryview(seg)[:4] = b"\x2a\x2a\x2a\x2a"
    if in_flight:
        seg.incref()  # a message's count, on nobody's books until its reader takes it over
    shm_manager.flush()
    daemon = shm_manager.daemon_pid(d)
    other = subprocess.Popen(["sleep", "60"])  # a process of the user that is not the stray's child
    try:
        stray(d, shm_manager.group(), frames, seg.name, other.pid)
        other.kill()
        other.wait()
        time.sleep(0.5)  # the daemon has read the stray's frames and its EOF, and seen the other process die
        assert os.path.exists(seg.path), f"{case}: the live program's segment was removed"
        assert seg.refcount == 1 + in_flight, f"{case}: refcount {seg.refcount}, not the live program's counts"
        got = subprocess.run([sys.executable, "-c", RECEIVER, seg.name, d], capture_output=True, text=True,
                             timeout=60)
        assert got.returncode == 0 and got.stdout.strip() == "2a2a2a2a", got.stderr  # its next message's reader
        assert shm_manager.daemon_pid(d) == daemon  # it serves on
    finally:
        other.kill()
        other.wait()
        if in_flight and os.path.exists(seg.path):
            seg.decref()  # its reader's, given back
        assert shm_manager.release(seg.name, d)
        wait_until(lambda: not os.path.exists(seg.path), 5, "the live program's release to unlink")
        seg.close()
