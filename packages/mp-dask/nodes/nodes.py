"""Separate "nodes" on one machine, for mp-dask's multi-node tests and benchmark (issue 45).

A node is a mount namespace of its own with a private ``/dev/shm`` (a tmpfs
only its processes see), its Dask processes listening on a loopback address of
its own; the host's processes (the test, its client) are a node too::

    host: the client, /dev/shm     node sched: 127.0.0.2      node b: 127.0.0.3       node c: 127.0.0.4
    (a worker may share it)        scheduler, own /dev/shm    worker(s), own /dev/shm  worker(s), own /dev/shm

So a handle sent across nodes names a segment the receiver cannot see, as
between two machines. Nothing here leaves the run: the namespaces go with
their last process, the tmpfs with its namespace, and loopback addresses need
no setup. No address but loopback is ever used.

Each node is this file run as a script, a *holder*: it enters a new mount
namespace (unless ``--host-shm``: a process of the host's memory on an address
of its own), makes its mounts private, mounts a tmpfs on ``/dev/shm``, starts
the node's command as its child, and waits for its stdin to close: the test
closing it, or the test process dying however. Then it kills every process of
the node (by pid: its descendants, and every process in its namespace) and
exits. The holder outlives the node's Dask processes, so ``segments()`` can
read the node's ``/dev/shm`` (``/proc/<holder>/root/dev/shm``) after they were
killed. Needs root (CAP_SYS_ADMIN: ``unshare(CLONE_NEWNS)``, ``mount``);
``unavailable()`` says why not, for a skip.

    python nodes.py [--host-shm] [--shm-size 1g] -- COMMAND...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
SHM_SIZE = "1g"


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def enter_private_shm(size: str = SHM_SIZE) -> None:
    """This process: a new mount namespace, every mount in it private, a fresh tmpfs on /dev/shm."""
    _libc_call("unshare", CLONE_NEWNS)
    _libc_call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    _libc_call("mount", b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777".encode())


def unavailable() -> str | None:
    """Why nodes cannot be made here (None: they can): tried in a fork child, which exits at once."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (no thread of the parent runs here: only these calls, then _exit)
        try:
            os.close(r)
            enter_private_shm("1m")
            os._exit(0)
        except BaseException as exc:
            os.write(w, str(exc).encode()[:500])
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        why = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return (f"separate nodes need a mount namespace with a tmpfs of its own on /dev/shm, which this process may not "
            f"make ({why or 'the child died'}): run as root, or in a container with CAP_SYS_ADMIN "
            "(docker run --cap-add SYS_ADMIN --security-opt apparmor=unconfined)")


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    import psutil  # (a dependency of distributed; here, not at import: nox's own check imports this module)

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _members(holder: int, private: bool) -> list[int]:
    """The processes of the holder's node but the holder: its descendants, and (``private``: a namespace of its
    own) every process in its mount namespace (shm-manager's daemons start sessions of their own)."""
    found = set(descendants(holder))
    ns = _mount_ns(holder)
    if private and ns is not None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        found.update(p for p in pids if p != holder and _mount_ns(p) == ns)
    found.discard(holder)
    return sorted(found)


def _kill(pids) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _hold(host_shm: bool, size: str, cmd: list[str]) -> int:
    if not host_shm:
        enter_private_shm(size)
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    while os.read(0, 4096):  # until the test closes our stdin, or dies
        pass
    for _ in range(5):  # processes started meanwhile are caught by the next round
        left = _members(os.getpid(), not host_shm)
        if not left:
            break
        _kill(left)
        time.sleep(0.1)
    child.wait()
    return 0


class Node:
    """One node: a holder (see the module header) running ``cmd`` with ``env``; ``host`` its loopback address.
    ``host_shm``: the node uses the host's memory (no namespace of its own)."""

    def __init__(self, name: str, host: str, cmd: list[str], env: dict, log: str, host_shm: bool = False,
                 shm_size: str = SHM_SIZE):
        self.name, self.host, self.host_shm, self.log = name, host, host_shm, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, __file__, *(["--host-shm"] if host_shm else []),
                                          "--shm-size", shm_size, "--", *cmd],
                                         stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def shm(self) -> str:
        """The node's /dev/shm as the host sees it."""
        return f"/proc/{self.proc.pid}/root/dev/shm"

    def segments(self, dir: str | None = None) -> list[str]:
        """The arraymp segments in the node's /dev/shm (or in ``dir``, a host path, for a host-memory node)."""
        where = dir if dir is not None else self.shm
        return sorted(n for n in os.listdir(where) if n.startswith("arraymp_"))

    def processes(self) -> list[int]:
        """The node's processes but its holder."""
        return _members(self.proc.pid, not self.host_shm)

    def kill(self) -> list[int]:
        """Kill the node's Dask processes (the holder's descendants: nanny, workers), at once; their pids."""
        pids = descendants(self.proc.pid)
        _kill(pids)
        return pids

    def close(self, timeout: float = 30) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill([*self.processes(), self.proc.pid])
            self.proc.wait(timeout)

    def tail(self, n: int = 40) -> str:
        with open(self.log, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])


def base_env(extra: dict | None = None) -> dict:
    """The environment of a node's processes: this one's, without this program's arraymp group and segment
    directory (a node is another program, with /dev/shm its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ARRAYMP_GROUP", "ARRAYMP_SHM_DIR",
                                                            "ARRAYMP_RUNTIME_DIR", "DASK_SCHEDULER_ADDRESS")}
    env.update(extra or {})
    return env


def scheduler(host: str, workdir: str, env: dict, name: str = "sched", host_shm: bool = False) -> tuple[Node, str]:
    """A scheduler node listening on ``host``; (the node, its address), waiting for it to listen."""
    path = os.path.join(workdir, f"{name}.json")
    node = Node(name, host, [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", host, "--port", "0",
                             "--no-dashboard", "--scheduler-file", path], env, os.path.join(workdir, f"{name}.log"),
                host_shm)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as fh:
                return node, json.load(fh)["address"]
        if node.proc.poll() is not None or time.monotonic() > deadline:
            node.close()
            raise RuntimeError(f"the scheduler node did not start:\n{node.tail()}")
        time.sleep(0.1)


def workers(name: str, host: str, address: str, workdir: str, env: dict, n: int = 1, host_shm: bool = False,
            shm_size: str = SHM_SIZE) -> Node:
    """A node of ``n`` Dask workers (each with a nanny, one thread) on ``host``, joining the scheduler
    ``address``; the caller waits for them (``Client.wait_for_workers``)."""
    local = os.path.join(workdir, f"{name}-scratch")
    os.makedirs(local, exist_ok=True)
    return Node(name, host, [sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", host,
                             "--nworkers", str(n), "--nthreads", "1", "--no-dashboard", "--name", name,
                             "--local-directory", local], env, os.path.join(workdir, f"{name}.log"), host_shm,
                shm_size)


def main() -> int:
    ap = argparse.ArgumentParser(description="Hold a node: run COMMAND in it until stdin closes.")
    ap.add_argument("--host-shm", action="store_true", help="no namespace of its own: the host's /dev/shm")
    ap.add_argument("--shm-size", default=SHM_SIZE)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return _hold(args.host_shm, args.shm_size, cmd)


if __name__ == "__main__":
    sys.exit(main())
