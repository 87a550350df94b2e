import gc
import multiprocessing
import os
import time

import pytest


def ours():
    return {n for n in os.listdir("/dev/shm") if n.startswith("arraymp_")}


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
    assert not children and not left and fds <= fds_before + 5, (children, left, fds_before, fds)
