"""shm-manager: leave /dev/shm clean after any crash.

Named arraymp segments carry the token of the process group that made them
(the first arraymp process and its descendants). Every member holds a lock on
the group's lock file from its first named segment on, so a dead group is
proved, not guessed. A per-group daemon, started on first ``register()``,
unlinks what the group registered (and every file of the group) once all its
processes are gone;
``gc()`` / ``shm-manager gc`` and the startup sweep of the next arraymp program
remove what a group left when its daemon died with it. Nothing of a live group
or of another user is ever touched.
"""

from . import _end  # noqa: F401  (registers the group's end at exit: Note [End of a group])
from ._calls import claim, drop_from, give, hold, register, send_to, take_back, take_from, unregister
from ._client import daemon_pid, done_with, flush, release
from ._gc import gc, list_segments, stats
from ._group import current_group, group, join_group, member, new_name
from ._paths import parse as parse_name
from ._paths import runtime_dir, start_time

__all__ = [
    "claim",
    "current_group",
    "daemon_pid",
    "done_with",
    "drop_from",
    "flush",
    "gc",
    "give",
    "group",
    "hold",
    "join_group",
    "list_segments",
    "member",
    "new_name",
    "parse_name",
    "register",
    "release",
    "runtime_dir",
    "send_to",
    "start_time",
    "stats",
    "take_back",
    "take_from",
    "unregister",
]


def __getattr__(name):
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("shm-manager")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
