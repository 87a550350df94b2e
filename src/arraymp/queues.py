"""``multiprocessing.queues`` with our ``Queue``, ``JoinableQueue`` and ``SimpleQueue``.

They subclass the stdlib's classes of the same names, so ``isinstance`` checks
written for the stdlib hold, and a subclass of ``arraymp.queues.Queue`` that
overrides ``_on_queue_feeder_error`` gets it called as the stdlib's does.
"""

from multiprocessing import queues as _stdlib

from mp_reductions import JoinableQueue, Queue, SimpleQueue

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]


def __getattr__(name):
    return getattr(_stdlib, name)
