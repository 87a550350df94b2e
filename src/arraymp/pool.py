"""``multiprocessing.pool`` with our ``Pool`` (arrays by shared memory, survives dead workers) and the result
classes it returns (subclasses of the stdlib's of the same names).

Every other name is the stdlib's (``ThreadPool``, ``MaybeEncodingError``, ...).
"""

from multiprocessing import pool as _stdlib
from multiprocessing.pool import ThreadPool

from mp_reductions import ApplyResult, AsyncResult, IMapIterator, IMapUnorderedIterator, MapResult, Pool

__all__ = ["ApplyResult", "AsyncResult", "IMapIterator", "IMapUnorderedIterator", "MapResult", "Pool", "ThreadPool"]


def __getattr__(name):
    return getattr(_stdlib, name)
