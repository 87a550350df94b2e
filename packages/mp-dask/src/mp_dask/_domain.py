"""Which processes of a Dask cluster share this process's shared memory (Note [Same-node transport] in _transport.py).

A process's *shared-memory domain* names what a handle needs to be opened
and counted: the kernel (its boot id), the segment directory (the device and
inode of ``shm_core.shm_dir()``, and its path, which handles name), the user
(segments are owner-only) and the pid namespace (shm-manager's daemon keeps
its counts by pid)::

    b0a1d3fb-...-cac901bc5793:27:1:0:4026531836:/dev/shm
    boot id                   dev ino uid pid ns  directory

Two processes of one domain see the same files under the same names and the
same pids. Every process of ours says its domain, and its pid, in the
handshake of each Dask connection it opens or accepts (the ``handshake_info``
of distributed's comms, wrapped once per process by ``install``): so the
serializer of any message finds its recipient's in the ``context`` Dask
serializes it with (``peer``), whichever end opened the connection (a result
goes back on the connection its reader opened, whose address names no
listening process). The client installs it before it connects; each worker
when the context's worker plugin ``Published`` starts there, which also
publishes the worker's domain to the scheduler (an event of ``TOPIC``):
``DaskContext.shm_domains()`` reads them.
"""

from __future__ import annotations

import functools
import os
import re
import threading

import shm_core
from distributed import WorkerPlugin

DOMAIN_KEY = "arraymp-shm-domain"  # in a Dask handshake: the process's domain (a str), or absent
PID_KEY = "arraymp-pid"  # and its pid
TOPIC = "arraymp-shm-domains"
NAME = "arraymp-shm-domain"
_DOMAIN_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}:[0-9]{1,20}:[0-9]{1,20}:"
                        r"[0-9]{1,10}:[0-9]{1,20}:/[^\0]{0,4095}")
_lock = threading.Lock()
_installed = False


@functools.lru_cache(maxsize=1)
def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        return None
    return boot if re.fullmatch(r"[0-9a-f-]{36}", boot) else None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def domain() -> str | None:
    """This process's shared-memory domain (see the module header); None when it cannot be told (no boot id, no
    segment directory): such a process neither sends nor accepts handles."""
    boot, pidns = _boot_id(), _pid_namespace()
    d = os.path.normpath(shm_core.shm_dir())
    try:
        st = os.stat(d)
    except OSError:
        return None
    if boot is None or pidns is None:
        return None
    found = f"{boot}:{st.st_dev}:{st.st_ino}:{os.geteuid()}:{pidns}:{d}"
    return found if valid(found) else None


def valid(d) -> bool:
    """Whether ``d``, read from another process, is a domain as ``domain()`` writes them."""
    return isinstance(d, str) and _DOMAIN_RE.fullmatch(d) is not None


def describe(d: str | None) -> str:
    """``d`` for a message: its parts by name."""
    if not valid(d):
        return "not told"
    assert d is not None
    boot, dev, ino, uid, pidns, path = d.split(":", 5)
    return f"{path} (device {dev}, inode {ino}) of boot {boot[:8]}, uid {uid}, pid namespace {pidns}"


def peer(context) -> tuple[str | None, int | None]:
    """The domain and pid the recipient of a message said in its handshake (``context``: what Dask serializes the
    message with); None where not said, or not as ours writes them."""
    try:
        info = context["recipient"]
        d, pid = info.get(DOMAIN_KEY), info.get(PID_KEY)
    except (TypeError, KeyError, AttributeError):
        return None, None
    return (d if valid(d) else None), (pid if type(pid) is int and 0 < pid < 1 << 31 else None)


def install() -> None:
    """Say this process's domain and pid in the handshake of every Dask connection it opens or accepts from now on
    (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        from distributed.comm.core import Comm

        said = Comm.handshake_info

        @functools.wraps(said)
        def handshake_info(self):
            info = said(self)
            d = domain()
            if d is not None:
                info[DOMAIN_KEY], info[PID_KEY] = d, os.getpid()
            return info

        # (unused where distributed is not installed, as in the lint session)
        Comm.handshake_info = handshake_info  # type: ignore[method-assign,unused-ignore]
        _installed = True


class Published(WorkerPlugin):
    """On every worker, present and future: ``install``, and the worker's domain published to the scheduler."""

    idempotent = True

    async def setup(self, worker):
        install()
        # a call, not the batched stream: registering the plugin returns once every worker's domain is in
        await worker.scheduler.log_event(topic=TOPIC, msg={"address": worker.address, "domain": domain(),
                                                           "pid": os.getpid()})


def publish(client) -> None:
    """Register ``Published`` on the cluster's workers, once per cluster (a worker that cannot run it says no
    domain, and gets bytes)."""
    try:
        client.register_plugin(Published(), name=NAME)
    except Exception:
        pass


def published(client) -> dict[str, str | None]:
    """The domain each worker of the cluster now published (None: not published, or not as ours writes them)."""
    told: dict[str, str | None] = {}
    for _, msg in client.get_events(TOPIC):
        if isinstance(msg, dict) and isinstance(msg.get("address"), str):
            d = msg.get("domain")
            told[msg["address"]] = d if valid(d) else None
    return {address: told.get(address) for address in client.nthreads()}
