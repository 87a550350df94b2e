import gc
import multiprocessing
import os
import time
import warnings

import pytest
from mp_reductions import _recycle

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))

# Received and recycled mappings are kept up to ARRAYMP_RECYCLE_IDLE seconds
# (1 s by default); tests that check nothing is left wait less with 0.2 s.
os.environ.setdefault("ARRAYMP_RECYCLE_IDLE", "0.2")  # children
_recycle.IDLE = float(os.environ["ARRAYMP_RECYCLE_IDLE"])  # this process, already imported


def ours():
    return {n for n in os.listdir(os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")) if n.startswith("arraymp_")}


@pytest.fixture(autouse=True)
def leak_check():
    """No segment left in /dev/shm, descriptors back to baseline +-5, no child left running."""
    shm_before, fds_before = ours(), len(os.listdir("/proc/self/fd"))
    yield
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        children, left = multiprocessing.active_children(), ours() - shm_before
        fds = len(os.listdir("/proc/self/fd"))
        if (not children and not left and fds <= fds_before + 5) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in children:  # never leave a stuck child for the interpreter's exit to join forever
        child.kill()
        child.join(10)
    assert not children and not left and fds <= fds_before + 5, (children, left, fds_before, fds)
