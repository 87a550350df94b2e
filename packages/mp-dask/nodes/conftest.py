"""Issue 45's harness: a Dask scheduler and workers as separate nodes on this machine (nodes.py), and this test
process as the client. Needs root (mount namespaces); skipped, saying why, where they cannot be made.

    host (127.0.0.1)          sched 127.0.0.2    b 127.0.0.3     hostnet 127.0.0.1        local 127.0.0.1
    client, /dev/shm dir D    own /dev/shm       own /dev/shm    own /dev/shm (issue's)   host memory, dir D

The cluster is made once per module; a test that loses a node starts its own victim. After each test no arraymp
segment is left in any node's /dev/shm, nor in D.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]  # nodes.py; _wait.py
import nodes  # noqa: E402

WHY_NOT = nodes.unavailable()  # the tests skip, saying why, where it is not None

# before anything starts a process: the client's segment directory, private to this run
SHM_DIR = tempfile.mkdtemp(prefix="arraymp-nodes-test-", dir="/dev/shm")
os.environ["ARRAYMP_SHM_DIR"] = SHM_DIR
os.environ.setdefault("ARRAYMP_RECYCLE_IDLE", "0.2")
os.environ.setdefault("ARRAYMP_MANAGER_LINGER", "0.5")

try:
    import dask
    import mp_dask
    import mp_reductions
    from _wait import wait_until
    from mp_reductions import _recycle
except BaseException:
    shutil.rmtree(SHM_DIR, ignore_errors=True)
    raise

_recycle.IDLE = float(os.environ["ARRAYMP_RECYCLE_IDLE"])
# each task runs where its argument was scattered: no stolen task moves an argument between workers, so the
# counters are exact (the scheduler reads this from its environment: NODE_ENV)
dask.config.set({"distributed.scheduler.work-stealing": False})
NODE_ENV = {"DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False", "ARRAYMP_RECYCLE_IDLE": "0.2",
            "ARRAYMP_MANAGER_LINGER": "0.5",
            "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
REMOTE = ("b", "hostnet")  # worker nodes of their own /dev/shm
WAIT = 120  # seconds a node's workers may take to start on a loaded machine


def segments() -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("arraymp_"))


def pytest_sessionfinish(session):
    shutil.rmtree(SHM_DIR, ignore_errors=True)


class Cluster:
    """The nodes of this module, the context joined to their scheduler, and the workers by node name."""

    def __init__(self, workdir: str):
        self.workdir, self.nodes = workdir, {}
        env = nodes.base_env(NODE_ENV)
        self.nodes["sched"], self.address = nodes.scheduler("127.0.0.2", workdir, env)
        self.nodes["b"] = nodes.workers("b", "127.0.0.3", self.address, workdir, env)
        self.nodes["hostnet"] = nodes.workers("hostnet", "127.0.0.1", self.address, workdir, env)
        self.nodes["local"] = nodes.workers("local", "127.0.0.1", self.address, workdir,
                                            {**env, "ARRAYMP_SHM_DIR": SHM_DIR}, host_shm=True)
        self.ctx = mp_dask.get_context(address=self.address)
        self.ctx.client.wait_for_workers(3, timeout=WAIT)
        self.published()

    def published(self) -> dict[str, str | None]:
        """``ctx.shm_domains()``, once every worker has published its domain (a worker that joined after the
        context's client gets its plugin as it registers)."""
        wait_until(lambda: None not in self.ctx.shm_domains().values(), WAIT, "every worker's domain")
        return self.ctx.shm_domains()

    def add(self, name: str, host: str, local: bool = False) -> nodes.Node:
        """Start a worker node ``name`` on ``host`` (``local``: of the client's memory), and wait for it."""
        env = nodes.base_env({**NODE_ENV, **({"ARRAYMP_SHM_DIR": SHM_DIR} if local else {})})
        n = len(self.ctx.client.nthreads())
        node = self.nodes[name] = nodes.workers(name, host, self.address, self.workdir, env, host_shm=local)
        self.ctx.client.wait_for_workers(n + 1, timeout=WAIT)
        self.published()
        return node

    def workers(self) -> dict[str, str]:
        """Worker name -> address, now."""
        info = self.ctx.client.run(lambda dask_worker: dask_worker.name)
        return {name: address for address, name in info.items()}

    def leftovers(self) -> dict[str, list[str]]:
        """The arraymp segments in every node's /dev/shm and in the client's directory."""
        found = {"client": segments()}
        for name, node in self.nodes.items():
            if not node.host_shm and node.proc.poll() is None:
                found[name] = node.segments()
        return {k: v for k, v in found.items() if v}

    def close(self) -> None:
        try:
            self.ctx.close()
        finally:
            for node in self.nodes.values():
                node.close()


@pytest.fixture(scope="module")
def cluster():
    workdir = tempfile.mkdtemp(prefix="arraymp-nodes-")
    c = None
    try:
        c = Cluster(workdir)
        yield c
    except BaseException:
        if c is not None:
            for name, node in c.nodes.items():
                print(f"--- node {name} ---\n{node.tail()}", file=sys.stderr)
        raise
    finally:
        if c is not None:
            c.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def reductions():
    mp_reductions.init_reductions()


@pytest.fixture(autouse=True)
def leak_check(request):
    """No arraymp segment left in any node's /dev/shm, nor in the client's directory, after the test."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        wait_until(lambda: not c.leftovers(), 10, f"segments to go: {c.leftovers()}")
    else:
        wait_until(lambda: not segments(), 10, f"segments to go: {segments()}")
