"""A LocalCluster per test module (loopback, its HTTP server on a free port, scratch in a temp dir), segments in a
private directory, and the leak check: no arraymp segment left there after each test."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import warnings

import dask
import pytest

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))

# before anything starts a process: workers and spawn children inherit these
SHM_DIR = tempfile.mkdtemp(prefix="arraymp-dask-test-", dir="/dev/shm")
os.environ["ARRAYMP_SHM_DIR"] = SHM_DIR
os.environ.setdefault("ARRAYMP_RECYCLE_IDLE", "0.2")  # received mappings are dropped 0.2 s after last use
os.environ.setdefault("ARRAYMP_MANAGER_LINGER", "0.5")

try:
    import mp_dask
    import mp_reductions
    from _wait import wait_until
    from mp_reductions import _recycle
except BaseException:  # this conftest fails to load: no pytest_sessionfinish will remove the directory
    shutil.rmtree(SHM_DIR, ignore_errors=True)
    raise

_recycle.IDLE = float(os.environ["ARRAYMP_RECYCLE_IDLE"])
# each task runs where its argument was scattered: no stolen task moves an argument between workers, so the
# handle counts are exact (the LocalCluster's scheduler runs in this process and reads this)
dask.config.set({"distributed.scheduler.work-stealing": False})
# (the scheduler's HTTP server binds a port whatever dashboard_address says, 8787 for None, and warns when another
# cluster has it; port 0 takes a free one)
CLUSTER = {"n_workers": 2, "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}


def segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("arraymp_")}


def started(marker: str) -> int:
    """The pid a task wrote in ``marker`` as it started (waiting for it)."""
    wait_until(lambda: os.path.exists(marker), 60, f"a task to start and write {marker}")
    with open(marker) as fh:
        return int(fh.read())


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def pytest_sessionfinish(session):
    shutil.rmtree(SHM_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def reductions():
    mp_reductions.init_reductions()


@pytest.fixture
def scratch(tmp_path):
    d = tmp_path / "dask-scratch"
    d.mkdir()
    return str(d)


@pytest.fixture
def dask_ctx(scratch):
    """A context that started its own LocalCluster of 2 worker processes; closed after the test."""
    ctx = mp_dask.get_context(**CLUSTER, local_directory=scratch)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture(autouse=True)
def leak_check():
    """No segment of ours left in the private segment directory after the test."""
    before = segments()
    yield
    wait_until(lambda: not segments() - before, 10, f"segments to go: {sorted(segments() - before)}")
