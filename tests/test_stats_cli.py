"""``python -m arraymp stats PID`` as a user meets it: a running program's counts, then nothing once it is killed
(issue 34, item 4)."""

import json
import os
import subprocess
import sys

import arraymp as mp

PROGRAM = """
import sys
import arraymp as mp, numpy as np
q = mp.Queue()
shared = mp.empty_shared(1 << 17)
for i in range(3):
    q.put(np.full(10, i, float))
for i in range(2):
    q.put(np.ones(1 << 17))
q.put(shared)
for _ in range(6):
    q.get()
print("ready", flush=True)
sys.stdin.readline()
"""


def arraymp(*args):
    return subprocess.run([sys.executable, "-m", "arraymp", *args], capture_output=True, text=True, timeout=120)


def test_stats_of_a_running_program_then_of_a_killed_one():
    p = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        out = arraymp("stats", str(p.pid))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == f"arraymp stats of process {p.pid}, since it started:"
        rows = {line[:36].strip(): line[36:].split() for line in lines[1:]}
        assert rows["messages sent"] == ["6"] and rows["messages received"] == ["6"]
        assert rows["arrays sent as handles"][0] == "1"
        assert rows["arrays copied into shared memory"] == ["2", "2.0", "MiB"]
        assert rows["arrays sent inline (pickled)"] == ["3", "240", "B"]
        assert rows["of which sharing stopped"] == ["0", "0", "B"]
        d = json.loads(arraymp("stats", str(p.pid), "--json").stdout)
        assert {k: d[k] for k in ("pid", "messages_sent", "messages_received", "handles_sent", "arrays_copied",
                                  "bytes_copied", "arrays_inline", "bytes_inline", "fallbacks")} == {
            "pid": p.pid, "messages_sent": 6, "messages_received": 6, "handles_sent": 1, "arrays_copied": 2,
            "bytes_copied": 2 << 20, "arrays_inline": 3, "bytes_inline": 240, "fallbacks": 0}
        assert d["segments_live"] >= 1 and d["descriptors_held"] >= 1 and d["sharing_stopped_at"] is None
        p.kill()
        p.wait(30)
        out = arraymp("stats", str(p.pid))
        assert out.returncode == 1 and out.stderr == f"python -m arraymp stats: error: no process {p.pid} is running\n"
    finally:
        p.kill()
        p.wait()
    shm = os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")
    assert not [n for _, _, names in os.walk(shm) for n in names if f"_{p.pid}_" in n]


def test_stats_of_a_process_without_arraymp_says_so():
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        out = arraymp("stats", str(p.pid))
        assert out.returncode == 1 and "publishes no arraymp counters: it has not imported arraymp" in out.stderr
    finally:
        p.stdin.close()
        p.wait(30)


def test_the_facade_exports_stats_and_the_warning():
    assert "stats" in mp.__all__ and "SharingStoppedWarning" in mp.__all__
    assert issubclass(mp.SharingStoppedWarning, UserWarning)
    assert mp.stats().pid == os.getpid()
    assert arraymp("stats", "--help").returncode == 0
