"""How a Dask worker process ended, told by its nanny (Note [Dask deaths explained]).

Note [Dask deaths explained]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: the ``DaskWorkerLostError`` of a worker whose nanny runs ``ExitsTold`` and sampled it says how it last ended
(signal or exit code, OOM killer or not, memory), each death told once; any other says that its nanny did not tell how.

Why: a Dask worker is its nanny's child, perhaps on another machine: the pool cannot read its exit code, memory cgroup's
OOM-kill counter and resident size as for its own workers (mp_reductions' Note [deaths explained]).

How: each client registers the nanny plugin ``ExitsTold`` under one name, idempotent (a second would wrap a nanny's
callback again, telling each death twice; a nanny started later gets it from the scheduler). It samples its worker's
pid, address, resident size and OOM-kill counter every ``RSS_INTERVAL`` seconds (the counter's baseline when it first
sees a pid), and when the worker process ends logs an event on ``TOPIC``: address, pid, exit code, whether the OOM
killer did it (``OomCounter.claim``: each count explains one death) and the last sample. A task lost past Dask's retries
(Note [Lost workers]) has its pool read the events of the address that lost it (``told``: waiting up to ``WAIT``
seconds, once per worker).

Not covered: the exit reaches the plugin through distributed's private exit callbacks (``Nanny._on_worker_exit_sync``,
``WorkerProcess.on_exit``): a distributed without them gets no plugin, and every death reads "died", how not known
(tested on the installed distributed). Untold too: a worker dead before its first sample (within ``RSS_INTERVAL`` of its
start), and one without a nanny.
"""

from __future__ import annotations

import time

from distributed.diagnostics.plugin import NannyPlugin
from mp_reductions import RSS_INTERVAL, OomCounter, resident

TOPIC = "arraymp-worker-exits"
NAME = "arraymp-exits-told"
WAIT = 5.0  # seconds a lost task's pool waits for its worker's exit to be told (the nanny's event; a loaded machine)


class ExitsTold(NannyPlugin):
    """On each nanny: its worker's last sample, and an event on ``TOPIC`` when the worker process ends."""

    idempotent = True

    def setup(self, nanny):
        from tornado.ioloop import PeriodicCallback

        self.nanny, self.last, self.sampler, self.on_exit = nanny, None, None, None
        self.told = told = getattr(nanny, "_on_worker_exit_sync", None)
        if told is None:
            return  # (a distributed without the callback: nothing told)

        def on_exit(exitcode):
            try:
                self.exited(exitcode)
            finally:
                told(exitcode)

        self.on_exit = nanny._on_worker_exit_sync = on_exit  # the workers it starts from now on
        process = getattr(nanny, "process", None)
        if process is not None and hasattr(process, "on_exit"):
            process.on_exit = on_exit  # the running one
        self.counters = OomCounter()
        self.sample()
        self.sampler = PeriodicCallback(self.sample, RSS_INTERVAL * 1000)
        self.sampler.start()

    def sample(self) -> None:
        """The worker's pid, address, memory and OOM baseline now (the baseline kept while the pid is the same)."""
        pid, address = self.nanny.pid, self.nanny.worker_address
        if pid is None or address is None:
            return
        if self.last is not None and self.last["pid"] == pid:
            counter, baseline = self.last["counter"], self.last["baseline"]
        else:
            counter = self.counters.of(pid)
            baseline = counter.read()
        got = resident(pid)
        self.last = {"pid": pid, "address": address, "counter": counter, "baseline": baseline,
                     "rss": None if got is None else (*got, time.monotonic())}

    def exited(self, exitcode) -> None:
        last, self.last = self.last, None
        if last is None:
            return
        oom = last["counter"].claim(last["baseline"]) if exitcode == -9 else None
        rss = last["rss"]
        self.nanny.log_event(TOPIC, {
            "address": last["address"], "pid": last["pid"], "exitcode": exitcode, "oom": oom,
            "rss": None if rss is None else [rss[0], rss[1], max(0.0, time.monotonic() - rss[2])]})

    def teardown(self, nanny):
        if self.on_exit is None:
            return
        self.sampler.stop()
        if nanny.__dict__.get("_on_worker_exit_sync") is self.on_exit:
            nanny._on_worker_exit_sync = self.told
        process = getattr(nanny, "process", None)
        if process is not None and getattr(process, "on_exit", None) is self.on_exit:
            process.on_exit = self.told


def tell(client) -> None:
    """Register the plugin on the cluster's nannies, once (a cluster without nannies: nothing is told)."""
    try:
        client.register_plugin(ExitsTold(), name=NAME)
    except Exception:  # (no nanny plugins on this cluster, or a worker without our package)
        pass


def told(client, address: str | None) -> dict | None:
    """The exit of the worker at ``address`` (an address names one worker process: a restarted one has a new
    port), waiting up to ``WAIT`` s for its nanny's event; None when none is told."""
    if address is None:
        return None
    return event(client, TOPIC, lambda msg: msg.get("address") == address, WAIT)


def event(client, topic: str, match, wait: float) -> dict | None:
    """The newest event of ``topic`` whose message ``match``es, waiting up to ``wait`` s for it; None."""
    deadline = time.monotonic() + wait
    while True:
        try:
            events = client.get_events(topic)
        except Exception:
            return None
        for _, msg in reversed(events):
            if isinstance(msg, dict) and match(msg):
                return msg
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
