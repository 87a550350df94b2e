"""The fork guard: CUDA cannot be used in a child forked after the parent initialised it.

The parent's CUDA context does not survive fork; a child that touches it
hangs or crashes inside the driver. ``os.register_at_fork`` marks such a child
and every shm_cuda operation there raises ForkedAfterInitError instead.
"""

from __future__ import annotations

import os

from ._errors import ForkedAfterInitError

_initialised = False
_forked = False  # this process is a fork child
_forked_after_init = False


def mark_initialised() -> None:
    """Record that this process has initialised CUDA (called by the module that touches cupy)."""
    global _initialised
    _initialised = True


def _after_fork_in_child() -> None:
    global _forked_after_init, _initialised, _forked
    _forked = True
    if _initialised:
        _forked_after_init = True
        _initialised = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_error() -> ForkedAfterInitError:
    return ForkedAfterInitError(
        f"process {os.getpid()} was forked after CUDA had been initialised in its parent, and CUDA cannot be used "
        "in such a child; use the 'spawn' or 'forkserver' start method "
        "(multiprocessing.set_start_method('spawn') or arraymp.get_context('spawn'))")


def check_fork() -> None:
    """Raise ForkedAfterInitError in a child forked after CUDA was initialised (by shm_cuda)."""
    if _forked_after_init:
        raise forked_error()


def was_forked() -> bool:
    """Whether this process is a fork child (its parent may have initialised CUDA without shm_cuda)."""
    return _forked
