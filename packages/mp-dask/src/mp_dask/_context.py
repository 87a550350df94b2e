"""``arraymp.get_context("dask", ...)``: Pool and ProcessPoolExecutor on a Dask cluster.

The context joins a running scheduler (``address``, else
``$DASK_SCHEDULER_ADDRESS``) or starts a ``LocalCluster`` of worker processes
on first use; it closes only a cluster it started. Its client talks to the
workers directly (``direct_to_workers``), so task arguments and results go
between the client and the workers, never through the scheduler, and travel
as Note [Same-node transport] (_transport.py) says: as handles only between
processes of one shared-memory domain, which each process says in its Dask
handshakes (the client from before it connects, the workers from the
context's worker plugin, which also publishes them to the scheduler:
``shm_domains()``); ``same_node=False`` sends bytes everywhere.
"""

from __future__ import annotations

import os
import threading

from . import _deaths, _domain, _transport


class DaskContext:
    """What ``get_context("dask", ...)`` returns: the stdlib context's Pool and ProcessPoolExecutor, on Dask."""

    _client = None
    _cluster = None  # ours to close: started by this context

    def __init__(self, address=None, n_workers=None, threads_per_worker=1, *, same_node=True, **cluster_kwargs):
        self._address = address or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
        self._cluster_kwargs = {"n_workers": n_workers, "threads_per_worker": threads_per_worker, "processes": True,
                                **cluster_kwargs}
        self.same_node = bool(same_node)
        self._lock = threading.Lock()

    @property
    def client(self):
        """The ``distributed.Client`` of this context (connecting, or starting a LocalCluster, on first use)."""
        with self._lock:
            if self._client is None:
                from distributed import Client, LocalCluster

                _domain.install()  # before it connects (Note [Same-node transport])
                if self._address:
                    self._client = Client(self._address, set_as_default=False, direct_to_workers=True)
                else:
                    import shm_manager

                    shm_manager.group()  # its workers join this program's group ($ARRAYMP_GROUP)
                    self._cluster = LocalCluster(**self._cluster_kwargs)
                    try:
                        self._client = Client(self._cluster, set_as_default=False, direct_to_workers=True)
                    except BaseException:
                        self._cluster.close()
                        self._cluster = None
                        raise
                _deaths.tell(self._client)  # once per client (Note [Dask deaths explained])
                _domain.publish(self._client)  # its workers say their domain, and publish it
            return self._client

    def cpu_count(self) -> int:
        """Worker threads in the cluster now (at least 1)."""
        return max(1, sum(self.client.nthreads().values()))

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None, *, task_timeout=None):
        from ._pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self, task_timeout=task_timeout)

    def ProcessPoolExecutor(self, max_workers=None, initializer=None, initargs=(), max_tasks_per_child=None, *,
                            task_timeout=None):
        from ._executor import ProcessPoolExecutor

        return ProcessPoolExecutor(max_workers, initializer, initargs, max_tasks_per_child, context=self,
                                   task_timeout=task_timeout)

    def transfer_counters(self) -> dict[str, int]:
        """The transfer counters (Note [Same-node transport]) of this process and every worker, summed."""
        total = _transport.transfer_counters()
        for counts in self.client.run(_transport.transfer_counters).values():
            for k, n in counts.items():
                total[k] += n
        return total

    def reset_transfer_counters(self) -> None:
        _transport.reset_transfer_counters()
        self.client.run(_transport.reset_transfer_counters)

    def shm_domains(self) -> dict[str, str | None]:
        """The shared-memory domain each worker published (Note [Same-node transport]), by address, and this
        process's under ``"client"``: a worker whose domain is the client's gets arrays as handles; None: not
        told (a worker without mp-dask's plugin), which gets bytes."""
        return {"client": _domain.domain(), **_domain.published(self.client)}

    def close(self) -> None:
        """Close the client, and the cluster when this context started it."""
        with self._lock:
            client, cluster, self._client, self._cluster = self._client, self._cluster, None, None
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        where = self._address or ("LocalCluster" if self._cluster else "LocalCluster (not started)")
        return f"<DaskContext {where} same_node={self.same_node}>"
