"""Issue 35, scenario 5: a process whose descriptors go past 1024 (allowed once arraymp raised its limit: ~1,500
shared arrays) makes a ProcessPoolExecutor, a Pool and a Queue, and uses shm-manager: everything completes
(select.select fails past descriptor 1023; nothing of ours uses it). Run in a fresh interpreter, so that the
descriptors it holds are its own."""

import os
import resource
import subprocess
import sys

import pytest

METHODS = ["fork", "spawn", "forkserver"]
HIGH = """
import concurrent.futures, faulthandler, os, sys
import numpy as np
import arraymp as mp
import shm_manager

faulthandler.dump_traceback_later(100, exit=True)
method = sys.argv[1]
held = [mp.empty_shared(1 << 15) for _ in range(1500)]  # 256 KiB each: a segment and a descriptor each
fillers = [os.open("/dev/null", os.O_RDONLY) for _ in range(max(0, 1100 - len(os.listdir("/proc/self/fd"))))]
ctx = mp.get_context(method)
with mp.ProcessPoolExecutor(2, mp_context=ctx) as ex:
    futures = [ex.submit(abs, -i) for i in range(200)]
    assert ex._state.core.outqueue._reader.fileno() > 1024  # made at the first submit
    assert [f.result(60) for f in futures] == list(range(200))
    assert float(ex.submit(np.sum, held[-1]).result(60)) == float(held[-1].sum())
with ctx.Pool(2) as pool:
    assert pool.map(abs, range(-100, 0)) == list(range(100, 0, -1))
q = ctx.Queue()
q.put(held[-1]); q.put(np.ones(1 << 17))
assert q.get(timeout=60).shape == held[-1].shape and q.get(timeout=60).sum() == 1 << 17
mp.set_sharing_strategy("file_system")
named = mp.empty_shared(1 << 17)
q.put(named)
assert q.get(timeout=60).shape == named.shape
assert shm_manager.flush(5)
print("ok", max(map(int, os.listdir("/proc/self/fd"))))
"""


@pytest.mark.parametrize("method", METHODS)
def test_executor_pool_queue_and_manager_with_descriptors_past_1024(method):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit here is {hard}: the scenario needs descriptors past 1024 and more")
    limits = (1024, hard)  # a normal user's soft limit: arraymp raises it as the arrays need
    r = subprocess.run([sys.executable, "-c", HIGH, method], capture_output=True, text=True, timeout=180,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    assert int(r.stdout.split()[1]) > 1024
