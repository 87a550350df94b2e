import os
import subprocess
import warnings

import pytest

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))


def _ours():
    return {n for n in os.listdir(os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")) if n.startswith("arraymp_")}


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves no segment in /dev/shm and no extra descriptor."""
    shm_before = _ours()
    fds_before = set(os.listdir("/proc/self/fd"))
    yield
    assert _ours() - shm_before == set(), "segments left in /dev/shm"
    assert len(set(os.listdir("/proc/self/fd")) - fds_before) == 0, "descriptors left open"


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(size)``: a fresh tmpfs of ``size`` (e.g. "4m") under tmp_path, unmounted after the test
    (skips where mounting is not permitted)."""
    mounted = []

    def mount(size: str):
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)
