"""``multiprocessing.managers``: the stdlib's, under arraymp's name (``import arraymp.managers`` works as
``import multiprocessing.managers`` does); its private names too."""

from multiprocessing import managers as _stdlib
from multiprocessing.managers import BaseManager, BaseProxy, SharedMemoryManager, SyncManager, Token

__all__ = ["BaseManager", "BaseProxy", "SharedMemoryManager", "SyncManager", "Token"]


def __getattr__(name):
    return getattr(_stdlib, name)
