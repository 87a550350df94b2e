import os

import pytest


def _ours():
    return {n for n in os.listdir("/dev/shm") if n.startswith("arraymp_")}


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves no segment in /dev/shm and no extra descriptor."""
    shm_before = _ours()
    fds_before = set(os.listdir("/proc/self/fd"))
    yield
    assert _ours() - shm_before == set(), "segments left in /dev/shm"
    assert len(set(os.listdir("/proc/self/fd")) - fds_before) == 0, "descriptors left open"
