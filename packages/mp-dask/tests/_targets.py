"""Functions the tests run in pool workers (importable by spawn children and Dask workers alike)."""

from __future__ import annotations

import os
import time

import numpy as np

GLOBAL = None


def init(value):
    global GLOBAL
    GLOBAL = value


def read_global(_):
    return GLOBAL


def f(a):
    a += 1  # received arrays are writable, on every context
    return a * 2


def g(a, b):
    return a - b


def boom(a):
    raise ValueError(f"boom on an array of shape {a.shape}")


def nap(i):
    time.sleep(0.2)
    return i


def mapping_of(a) -> tuple[str, bool]:
    """The file behind the mapping that holds ``a``'s data (from /proc/self/maps), and whether ``a`` is writable."""
    addr = a.ctypes.data
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return (fields[5].strip() if len(fields) > 5 else ""), bool(a.flags.writeable)
    return "", bool(a.flags.writeable)


def stall_once(a, marker: str):
    """First run: say which process runs it, then hang (until killed); a retry returns at once."""
    if os.path.exists(marker):
        return float(np.sum(a))
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(marker + ".tmp", marker)
    time.sleep(600)


def stall_first(a, marker: str):
    """The first call of all (a claim file decides): say which process runs it, then hang (until killed);
    every other call, a retry of that one included, returns at once."""
    try:
        os.close(os.open(marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return float(np.sum(a))
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(marker + ".tmp", marker)
    time.sleep(600)


def _die_unless_in(pid: int):
    if os.getpid() != pid:
        os.kill(os.getpid(), 9)


class DiesWhenUnpickled:
    """An argument whose unpickling kills any process but the one that made it: put before an array, it kills
    the worker before the worker maps the array."""

    def __reduce__(self):
        return _die_unless_in, (os.getpid(),)


def first_sum(_, a):
    return float(a.sum())


def pid_then_sleep(a, seconds: float, marker: str | None = None):
    """Say which process runs it (in ``marker``), sleep ``seconds``, then return the sum of ``a``."""
    if marker is not None:
        with open(marker + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
    time.sleep(seconds)
    return float(np.sum(a))


def crash(a):
    """End this process as a crash in native code does."""
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


def _die():
    os.kill(os.getpid(), 9)


class DiesWhenPickled:
    """A result part whose pickling kills the process, the first time of all (a claim file decides): put after
    an array, it kills the worker after it counted the array's handle and before the message went."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return str, ("sent",)
        _die()
        raise AssertionError("unreachable")


def result_then_death(a, marker: str):
    return a * 2, DiesWhenPickled(marker)


def full(n: int, value: float):
    """A fresh array of ``n`` float32 (``n`` >= 16384: 64 KiB or more, a handle where handles go)."""
    return np.full(n, value, np.float32)


def claim_domain(domain: str) -> None:
    """Make this process say ``domain`` is its shared-memory domain (in its handshakes and checks), as a
    misconfigured node would: its own check then lets handles through that it cannot open."""
    from mp_dask import _domain

    _domain.domain = lambda: domain
