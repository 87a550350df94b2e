"""shm-core: native shared-memory segments for arraymp.

Anonymous (memfd) and named segments with reserved pages, a 64-byte checked
header, a buffer-protocol mapping that keeps no file descriptor, and atomic
counters inside shared memory. Policy above this (sharing strategies, cleanup)
lives in mp-reductions and shm-manager.
"""

import sys

if not sys.platform.startswith("linux"):  # pragma: no cover
    raise ImportError(f"shm-core supports Linux only (memfd, tmpfs, futex); this is {sys.platform}")
if sys.implementation.name != "cpython":  # pragma: no cover
    raise ImportError(f"shm-core supports CPython 3.11 to 3.15 only (its extension uses CPython's C API, and the "
                      f"packages above it CPython's multiprocessing); this is {sys.implementation.name}")

from ._fds import check_headroom, recv_fds, recv_many, send_fds
from ._native import (
    Mapping,
    address,
    array_from,
    file_id,
    memfd_create,
    pack_array,
    set_allocator,
    shared_handler,
    swap_handler,
)
from ._segment import (
    DEFAULT_PREFIX,
    HEADER_SIZE,
    NAME_RE,
    REFCOUNT_OFFSET,
    USER_OFFSET,
    VIEWS_OFFSET,
    Segment,
    SegmentError,
    SharedMemoryFullError,
    attach,
    attach_fd,
    create,
    create_anonymous,
    parse_name,
    segment_name,
    shm_dir,
    unlink,
)

__all__ = [
    "DEFAULT_PREFIX",
    "HEADER_SIZE",
    "NAME_RE",
    "REFCOUNT_OFFSET",
    "USER_OFFSET",
    "VIEWS_OFFSET",
    "Mapping",
    "Segment",
    "SegmentError",
    "SharedMemoryFullError",
    "address",
    "array_from",
    "attach",
    "attach_fd",
    "check_headroom",
    "create",
    "create_anonymous",
    "file_id",
    "memfd_create",
    "pack_array",
    "parse_name",
    "recv_fds",
    "recv_many",
    "segment_name",
    "send_fds",
    "set_allocator",
    "shared_handler",
    "shm_dir",
    "swap_handler",
    "unlink",
]


def __getattr__(name):
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("shm-core")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
