"""A group's end: what its main process removes as it exits normally (adapts nothing of the stdlib's).

Note [End of a group]
~~~~~~~~~~~~~~~~~~~~~
Invariant: when the main process (the one that made the token) exits normally and closing its locks proves the group
dead (Note [Proof of death]), nothing of the group is left in the dirs it was a member of and in the default shm dir:
no segment, no daemon's socket, no lock file; even when no daemon ran (its first segment could not be made) or none
could be started. The main process removes them itself.

Other members leave that to the daemon: a child that ends right after sending a segment to a parent that has had none
yet (so is no member) would otherwise remove it under the parent, with no linger. The daemon does the same when
members are killed; the next program's sweep, or ``shm-manager gc``, when the daemon was killed too.
"""

from __future__ import annotations

import os
from multiprocessing import util

import shm_core

from . import _client, _gc, _group, _paths


def _at_exit() -> None:
    """Note [End of a group]."""
    st = _group._state
    group = st.token
    if st.pid != os.getpid() or not st.root or group is None:
        return
    still_held = _client.held()  # referenced here at exit (a module-level array): removed, but no leak
    held, st.locks = st.locks, {}
    for fd, _rdir in held.values():
        os.close(fd)
    locks = {shm: got for (shm, token), got in held.items() if token == group}
    # also the default dir where only children (leaving by os._exit) were members
    default = os.path.abspath(shm_core.shm_dir())
    for shm in {**locks, default: None}:
        try:
            rdir = locks[shm][1] if shm in locks else _paths.runtime_dir(shm, create=False, group=group)
            dfd = _gc.open_dir(shm)
            try:
                _gc.end_group(group, rdir, dfd, held=still_held)
            finally:
                os.close(dfd)
        except Exception:  # exiting anyway; the next program's sweep removes what is left
            pass


# after _client's _close_connections (-100), which gives back what this process still holds
util.Finalize(None, _at_exit, exitpriority=-200)
