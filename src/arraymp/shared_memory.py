"""``multiprocessing.shared_memory``: the stdlib's, under arraymp's name (``import arraymp.shared_memory`` works as
``import multiprocessing.shared_memory`` does); its private names too."""

from multiprocessing import shared_memory as _stdlib
from multiprocessing.shared_memory import ShareableList, SharedMemory

__all__ = ["ShareableList", "SharedMemory"]


def __getattr__(name):
    return getattr(_stdlib, name)
