"""A named segment freed by a garbage collection that runs while this thread is inside shm-manager's client
(its lock held, as in register()) gives its count back without deadlocking (shm_manager._client Note [release
from a collection])."""

import subprocess
import sys

CODE = """
import os, time, numpy as np, mp_reductions as mpr
from shm_manager import _client
mpr.init_reductions(); mpr.set_sharing_strategy("file_system")
a = mpr.zeros_shared(1 << 20)
name = [n for n in os.listdir("/dev/shm") if f"_{os.getpid()}_" in n][0]
with _client._lock:  # where a collection inside register() would free the segment
    del a
for _ in range(100):
    if not os.path.exists("/dev/shm/" + name):
        break
    time.sleep(0.05)
print("gone" if not os.path.exists("/dev/shm/" + name) else "left")
"""


def test_release_from_a_collection_inside_the_client_does_not_deadlock():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gone"
