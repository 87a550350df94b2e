"""How a pool worker ended, in words: the signal or exit code, whether the kernel's OOM killer did it (the memory
cgroup's counter), and how much memory it held when last measured (new: the stdlib's pool says nothing; loky's
message guesses).

Note [deaths explained]
~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a worker's death is told by three facts, each read where it can be read and never guessed (one that cannot
be read is left out):

- the exit: ``multiprocessing``'s exit code, minus the signal's number for a signal (named: ``SIGKILL``);
- the OOM killer: blamed for a SIGKILL only when its memory cgroup's OOM-kill counter says so (Note [OOM counts]). No
  counter readable: nothing is said about the OOM killer; one that did not rise: the message says the SIGKILL came
  from elsewhere;
- the resident size: the last sample of the worker's /proc/PID/status (``VmRSS``, ``VmHWM``: the peak), taken every
  ``RSS_INTERVAL`` seconds (``Sampler``), and its age: a dead worker's /proc entry has no memory left to read, and a
  task that allocates fast is killed between samples (its peak may be higher than told).

With worker replacement: the samples are kept per worker (by pid), dropped when its death is recorded.

Note [OOM counts]
~~~~~~~~~~~~~~~~~
Invariant: a worker's SIGKILL is blamed on the OOM killer only when the OOM-kill counter of its memory cgroup went
above both its value when the worker started and the last count given to an earlier death (``OomCounter.claim``):
each count explains one death, so a ``kill -9`` after an OOM kill is not blamed on it, and a replacement worker
starts from the count its predecessor's death left.

Why: the kernel counts each process it kills for want of memory in the victim's memory cgroup *before* it sends the
SIGKILL (cgroup v2 ``memory.events`` ``oom_kill``, hierarchical; v1 ``memory.oom_control`` ``oom_kill``, that
cgroup's own). ``OomCounter`` finds the worker's cgroup from /proc/PID/cgroup and /proc/self/mountinfo (the root of a
v2 hierarchy has no ``memory.events``: its counter is /proc/vmstat's): the pool's own as a rule, another where a fork
server started before its parent moved to another cgroup starts the workers in its own.

Not covered: an OOM kill of another process of the same cgroup, not the pool's, while a worker runs is blamed for
that worker's SIGKILL (the counter does not say whom it counted).
"""

from __future__ import annotations

import os
import signal
import time

RSS_INTERVAL = 0.5  # seconds between samples of a worker's resident size

# What a signal usually means, for the signals a task's own failure sends (the others are named only).
_SIGNAL_HINTS = {
    "SIGSEGV": "a crash in native code: a C extension, ctypes or the interpreter",
    "SIGBUS": "a bad memory access, often a full /dev/shm or a file shrunk under a mapping",
    "SIGABRT": "an abort, usually a failed assertion in native code",
    "SIGFPE": "an arithmetic error in native code",
    "SIGILL": "an illegal instruction, often a binary built for another CPU",
    "SIGTERM": "sent from outside, e.g. `kill` or a job scheduler",
}
_CRASHES = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"}


def signal_name(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process of exit code ``exitcode`` (None: no signal)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def size(n: int) -> str:
    """``n`` bytes for people: 612 MiB."""
    x = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{x:.3g} {unit}"
        x /= 1024
    raise AssertionError  # pragma: no cover


def explain(exitcode: int | None, oom: bool | None, rss: tuple | None) -> tuple[str, str, str]:
    """(how the worker ended, why, what to do): ("died with signal SIGKILL", "killed by the kernel's OOM killer:
    ...", "give each task less memory, ..."); why is "" when nothing is known. ``oom``: whether the OOM counter rose
    (None: not readable); ``rss``: (resident bytes, peak bytes, seconds before the death) of the last sample, or
    None."""
    name = signal_name(exitcode)
    how = f"died with signal {name}" if name else f"exited with code {exitcode}"
    memory = ""
    if rss is not None:
        resident, peak, age = rss
        memory = f"its resident size was {size(resident)}"
        if peak > resident * 1.05:
            memory += f", peak {size(peak)},"
        memory += f" when last measured, {age:.1f} s before"
    remedy = "resubmit this one"
    if name == "SIGKILL" and oom:
        why = "killed by the kernel's OOM killer: the memory cgroup counted an OOM kill while it ran"
        remedy = "give each task less memory, use fewer processes, or raise the memory limit"
    elif name == "SIGKILL" and oom is False:
        why = "sent from outside, e.g. `kill -9` or a job scheduler: the memory cgroup counted no OOM kill"
    elif name == "SIGKILL":
        why = "`dmesg` says whether the kernel's OOM killer sent it: no memory cgroup counter is readable here"
    elif name is not None:
        why = _SIGNAL_HINTS.get(name, "")
        if name in _CRASHES:
            remedy = ("run the task alone under `python -X faulthandler` to see where it crashed; resubmitted, "
                      "it will likely crash again")
    else:
        why = "the task called sys.exit() or os._exit(), or the interpreter failed" if exitcode else ""
    if why and memory:
        why = f"{why} ({memory})"
    return how, why or memory, remedy


class OomCounter:
    """The OOM-kill counter of this process's memory cgroup (Note [OOM counts]); ``read()`` is None where
    none can be read."""

    def __init__(self, path: str | None = None, key: str = "oom_kill"):
        self.path, self.key = (path, key) if path is not None else _find_counter()
        self.claimed = 0  # the count the last OOM death was given
        self.others: dict[str, OomCounter] = {}  # the counters of other cgroups workers started in

    def of(self, pid: int) -> OomCounter:
        """The counter of process ``pid``'s memory cgroup: this one, or another's (a forkserver started before
        its parent moved to another cgroup starts its workers in its own)."""
        path, key = _find_counter(str(pid))
        if path is None or path == self.path:
            return self
        if path not in self.others:
            self.others[path] = OomCounter(path, key)
        return self.others[path]

    def read(self) -> int | None:
        if self.path is None:
            return None
        try:
            with open(self.path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == self.key:
                        return int(value)
        except (OSError, ValueError):
            pass
        return None

    def claim(self, baseline: int | None) -> bool | None:
        """Whether a SIGKILL death of a worker that started when the counter read ``baseline`` was the OOM
        killer's (None: the counter cannot be read); True takes one count."""
        now = self.read()
        if now is None or baseline is None:
            return None
        floor = max(baseline, self.claimed)
        if now > floor:
            self.claimed = floor + 1
            return True
        return False


def _find_counter(pid: str = "self") -> tuple[str | None, str]:
    """(the file holding process ``pid``'s memory cgroup's OOM-kill count, its key), or (None, "") where there is
    none."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None, ""
    v1 = v2 = None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    for fields in mounts:
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[sep + 1], fields[-1].split(",")
        if v1 is not None and fstype == "cgroup" and "memory" in options:
            return os.path.join(point, _relative(v1, root), "memory.oom_control"), "oom_kill"
        if v1 is None and v2 is not None and fstype == "cgroup2":
            rel = _relative(v2, root)
            if rel == "":
                return "/proc/vmstat", "oom_kill"  # the root cgroup: the machine's count
            path = os.path.join(point, rel, "memory.events")
            if os.path.exists(path):  # else no memory controller in this hierarchy
                return path, "oom_kill"
    return None, ""


def _relative(path: str, root: str) -> str:
    """``path`` (as /proc/self/cgroup names it) below the mount's ``root``."""
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path.strip("/")


def resident(pid: int) -> tuple[int, int] | None:
    """(resident bytes, peak resident bytes) of process ``pid`` now, or None (gone, or no procfs)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rss = peak = None
    for line in data.splitlines():
        if line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith(b"VmHWM:"):
            peak = int(line.split()[1]) * 1024
    return None if rss is None else (rss, peak if peak is not None else rss)


class Sampler:
    """The last resident-size sample of each live worker, by pid (Note [deaths explained])."""

    def __init__(self):
        self.samples: dict[int, tuple[int, int, float]] = {}  # pid -> (resident, peak, time.monotonic())
        self.last = 0.0

    def due(self, now: float) -> bool:
        return now - self.last >= RSS_INTERVAL

    def sample(self, pids, now: float) -> None:
        self.last = now
        for pid in pids:
            got = resident(pid)
            if got is not None:
                self.samples[pid] = (*got, now)

    def forget(self, pid: int) -> tuple | None:
        """The last sample of ``pid``, now dead, as (resident, peak, seconds before now), and forget it."""
        got = self.samples.pop(pid, None)
        return None if got is None else (got[0], got[1], max(0.0, time.monotonic() - got[2]))
