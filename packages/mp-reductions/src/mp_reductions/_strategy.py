"""Sharing strategies and the inline threshold (process-wide settings).

``file_descriptor`` (default): anonymous memfd segments; descriptors travel in
the message (SCM_RIGHTS) on our channels, by ``multiprocessing.reduction.DupFd``
on the stdlib's. Nothing has a name, so nothing can leak.

``file_system``: named segments in /dev/shm, counted in their header and
registered with shm_manager, whose daemon and ``gc`` remove what a crash left.
"""

from __future__ import annotations

import shm_manager

_STRATEGIES = ("file_descriptor", "file_system")
_settings = {"strategy": "file_descriptor", "threshold": 64 * 1024}


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies this platform supports."""
    return set(_STRATEGIES)


def get_sharing_strategy() -> str:
    """The strategy used for arrays created or copied from now on."""
    return _settings["strategy"]


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose ``'file_descriptor'`` or ``'file_system'`` for this process.

    ``file_system`` makes this process a member of its shm_manager group at once (OSError, with the remedy,
    when the segment directory is unusable): a group is proved dead when no member is left, and named
    segments on their way to this process must not be cleaned up before it has them.
    """
    if new_strategy not in _STRATEGIES:
        raise ValueError(f"unknown sharing strategy {new_strategy!r}; valid ones are: {', '.join(_STRATEGIES)}")
    if new_strategy == "file_system":
        shm_manager.member()
    _settings["strategy"] = new_strategy


def get_inline_threshold() -> int:
    """Arrays smaller than this many bytes travel inside the pickle, as the stdlib sends them."""
    return _settings["threshold"]


def set_inline_threshold(nbytes: int) -> None:
    """Set the inline threshold in bytes (0 sends every non-empty unshared array by shared memory)."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"the inline threshold is a number of bytes >= 0, got {nbytes!r}")
    _settings["threshold"] = nbytes
