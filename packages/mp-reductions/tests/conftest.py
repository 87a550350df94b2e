import gc
import multiprocessing
import os
import subprocess
import time
import warnings

import mp_reductions
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


def nfds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="session", autouse=True)
def reductions():
    mp_reductions.init_reductions()


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    old = mp_reductions.get_sharing_strategy()
    mp_reductions.set_sharing_strategy(request.param)
    yield request.param
    mp_reductions.set_sharing_strategy(old)


@pytest.fixture(autouse=True)
def leak_check():
    """No segment left in /dev/shm, descriptors back to baseline +-5, no child left running."""
    shm_before, fds_before = ours(), nfds()
    yield
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        children = multiprocessing.active_children()
        left = ours() - shm_before
        if not left and not children and nfds() <= fds_before + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in children:  # never leave a stuck child for the interpreter's exit to join forever
        child.kill()
        child.join(10)
    assert not children, f"children still running: {children}"
    assert not left, f"segments left in /dev/shm: {sorted(left)}"
    assert nfds() <= fds_before + 5, f"descriptors: {fds_before} before, {nfds()} after"


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
