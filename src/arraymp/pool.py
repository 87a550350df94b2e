"""``multiprocessing.pool`` with our ``Pool`` (arrays by shared memory, survives dead workers).

Every other name is the stdlib's (``ThreadPool``, ``AsyncResult``, ...).
"""

from multiprocessing import pool as _stdlib
from multiprocessing.pool import ThreadPool

from mp_reductions import Pool

__all__ = ["Pool", "ThreadPool"]


def __getattr__(name):
    return getattr(_stdlib, name)
