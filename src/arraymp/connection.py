"""``multiprocessing.connection`` with our ``Pipe`` (arrays travel by shared memory).

Every other name is the stdlib's: ``wait``, ``Listener``, ``Client``, and
``Connection``, the stdlib's class over a raw descriptor, of which our Pipe's
ends are instances (``isinstance(end, Connection)`` holds, and ``wait`` and
``select`` take them: they have a ``fileno()``).
"""

from multiprocessing import connection as _stdlib
from multiprocessing.connection import Client, Connection, Listener, wait

from mp_reductions import Pipe

__all__ = ["Client", "Connection", "Listener", "Pipe", "wait"]


def __getattr__(name):
    return getattr(_stdlib, name)
