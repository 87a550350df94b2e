"""The process group: who owns a named segment, and the lock that proves it lives.

A group is the first arraymp process and its descendants::

    main (creates group g3f..., LOCK_SH on g3f....lock, sets $ARRAYMP_GROUP)
     |- fork child        module state inherited; re-locks on its own file description
     |- spawn/forkserver  reads $ARRAYMP_GROUP (or join_group(token)) and locks
     `- daemon            started on first register(); holds no lock (see _daemon.py)

Every member holds LOCK_SH on the group's lock file for as long as it lives,
so the group is dead exactly when LOCK_EX can be taken (Note [Proof of death]
in _paths.py). Segment names carry the group token, so anybody can tell which
group a segment belongs to. The first process of a new group sweeps the shm
directory once for segments of dead groups (cheap: one listdir, one
non-blocking flock per distinct group).

Note [Locks and fork]
~~~~~~~~~~~~~~~~~~~~~
flock locks belong to the open file description; a forked child shares the
parent's, so the group stays locked while either lives. The child still takes
its own description at once (``os.register_at_fork``): code that closes
inherited descriptors, or a parent that ends while the child lives, cannot
then unlock the child. Nothing ever calls LOCK_UN, which would unlock every
process sharing the description; a member just closes.

A forkserver's server may have started before the group existed, so its
children may carry no $ARRAYMP_GROUP (they start a group of their own) or a
stale module state: a parent can pass ``group()`` along and the child call
``join_group(token)``, which switches group.
"""

from __future__ import annotations

import os
import secrets
import threading

import shm_core

from . import _paths


class _State:
    token: str | None = None
    fd: int = -1
    pid: int = 0
    rdir: str | None = None
    shm: str | None = None


_state = _State()
_lock = threading.Lock()


def group() -> str:
    """This process's group token (no ``_`` in it), creating or joining the group on first call.

    From then on this process holds the group's liveness lock until it exits.
    """
    st = _state
    if st.token is not None and st.pid == os.getpid():
        return st.token
    with _lock:
        if st.token is None or st.pid != os.getpid():
            token = os.environ.get(_paths.GROUP_ENV, "")
            if _paths.GROUP_RE.fullmatch(token):
                _join(token)
            else:
                _create()
        return st.token


def join_group(token: str) -> str:
    """Join (or switch to) the group ``token``, e.g. one passed to a forkserver child explicitly."""
    if not isinstance(token, str) or not _paths.GROUP_RE.fullmatch(token):
        raise ValueError(f"not an arraymp group token: {token!r} (expected 1-32 characters of [0-9a-z]); "
                         "pass the value of shm_manager.group() from the parent")
    with _lock:
        if _state.token != token or _state.pid != os.getpid():
            _join(token)
    return token


def new_name(prefix: str = shm_core.DEFAULT_PREFIX) -> str:
    """A segment name of this group: ``<prefix><uid>_<group>_<pid>_<16 hex>``."""
    return shm_core.segment_name(prefix, group())


def current_group() -> str | None:
    """The group token if this process already is in a group, else None (never creates one)."""
    st = _state
    return st.token if st.token is not None and st.pid == os.getpid() else None


def _adopt(token: str, fd: int, rdir: str, shm: str) -> None:
    old = _state.fd
    _state.token, _state.fd, _state.pid, _state.rdir, _state.shm = token, fd, os.getpid(), rdir, shm
    os.environ[_paths.GROUP_ENV] = token
    if old >= 0 and old != fd:
        os.close(old)


def _join(token: str) -> None:
    rdir = _paths.runtime_dir()
    fd = _paths.open_lock(_paths.lock_path(rdir, token))
    _adopt(token, fd, rdir, shm_core.shm_dir())


def _create() -> None:
    rdir = _paths.runtime_dir()
    while True:
        token = "g" + secrets.token_hex(6)
        fd = _paths.open_lock(_paths.lock_path(rdir, token), exclusive_create=True)
        if fd >= 0:
            break
    _adopt(token, fd, rdir, shm_core.shm_dir())
    _startup_sweep()


def _startup_sweep() -> None:
    """A new arraymp program removes what dead groups left (crash matrix 5)."""
    if os.environ.get("ARRAYMP_MANAGER_SWEEP", "1") == "0":
        return
    from . import _gc

    try:
        _gc.gc(dir=_state.shm)
    except Exception:  # a sweep must never break the program that runs it
        pass


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    st = _state
    if st.token is None:
        return
    try:
        fd = _paths.open_lock(_paths.lock_path(st.rdir, st.token))
    except OSError:
        st.pid = os.getpid()  # keep the inherited description: it is locked too
        return
    _adopt(st.token, fd, st.rdir, st.shm)


os.register_at_fork(after_in_child=_after_fork_in_child)
