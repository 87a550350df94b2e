"""Process liveness that is safe against pid reuse.

A process is named by (pid, start time); the start time is field 22 of
/proc/<pid>/stat (clock ticks after boot), so a recycled pid never looks like
the process we meant. ``Watch`` keeps a pidfd where the kernel has one
(Linux >= 5.3): it refers to exactly one process and polls readable once that
process exited, even before it is reaped.
"""

from __future__ import annotations

import os
import select


def start_time(pid: int) -> int | None:
    """The start time of ``pid``, or None when no such process runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def is_alive(pid: int, start: int) -> bool:
    """True while the process ``pid`` that started at ``start`` has not exited."""
    return pid > 0 and start_time(pid) == start


class Watch:
    """Liveness of one process, named by pid and start time."""

    pidfd = -1

    def __init__(self, pid: int, start: int):
        self.pid, self.start = pid, start
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        # the pidfd is pinned to whatever process has this pid now: keep it only if that is ours
        if start_time(pid) == start:
            self.pidfd = fd
        else:
            os.close(fd)
            self.pid = -1

    def alive(self) -> bool:
        if self.pid < 0:
            return False
        if self.pidfd >= 0:
            p = select.poll()
            p.register(self.pidfd, select.POLLIN)
            return not p.poll(0)
        return is_alive(self.pid, self.start)

    def close(self) -> None:
        fd, self.pidfd = self.pidfd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        self.close()
