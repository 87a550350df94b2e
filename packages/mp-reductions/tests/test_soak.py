"""The soak test (issue 12): a pipeline and a Pool under random SIGKILLs, both strategies.

``_soak_targets.py`` runs as the parent (never killed) for ARRAYMP_SOAK_SECONDS per start method (15 by default,
half per strategy; ``nox -s soak`` sets 300), under spawn and under fork, and prints its figures; this test checks
them and, once that parent has exited, that nothing of its run is left.
"""

import json
import os
import subprocess
import sys
import time

import pytest

SECONDS = float(os.environ.get("ARRAYMP_SOAK_SECONDS", "15"))
TARGETS = os.path.join(os.path.dirname(__file__), "_soak_targets.py")


def left_behind(group: str, pids) -> list[str]:
    """Our segments of the run's group or made by one of its processes, and the run's processes still alive."""
    pids = {str(p) for p in pids}
    names = [n for n in os.listdir("/dev/shm") if n.startswith("arraymp_")
             and (n.split("_")[2] == group or n.split("_")[3] in pids)]
    return names + [f"pid {p}" for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]


def _zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def leak_check():
    """Replaces conftest's, which counts every arraymp segment of this user (other test runs' too, while this
    runs for minutes): this test counts its run's own, by group and pid."""
    yield


def shm_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_soak(strategy, method):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    env.pop("ARRAYMP_GROUP", None)  # the run is a group of its own: its end is checked below
    shm_before = shm_kib()
    out = subprocess.run([sys.executable, TARGETS, strategy, str(SECONDS / 2), method], capture_output=True, text=True,
                         timeout=SECONDS / 2 + 300, env=env)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.splitlines()[-1])
    print(json.dumps({k: v for k, v in figures.items() if k != "pids"}))
    assert figures["wrong"] == 0, figures
    assert figures["hung_calls"] == 0 and figures["longest_call"] < 20, figures
    assert figures["slowest_put"] < 20, figures
    assert figures["calls"] > 0 and figures["arrays_checked"] > 0, figures
    deadline = time.monotonic() + 3
    while left_behind(figures["group"], figures["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left_behind(figures["group"], figures["pids"]), figures
    # Shmem: is machine-wide (other programs move it too): reported, not asserted; the counts above are ours
    print(f"Shmem: {shm_kib() - shm_before:+d} KiB 3 s after the run")
