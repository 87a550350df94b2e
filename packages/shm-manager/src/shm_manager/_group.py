"""The process group: who owns a named segment, and the lock that proves it lives.

A group is the first arraymp process and its descendants::

    main (group() makes token g3f..., sets $ARRAYMP_GROUP; no file yet)
     |- fork child        module state inherited; re-locks on its own file description
     |- spawn/forkserver  reads $ARRAYMP_GROUP (or join_group(token))
     |  ...               first named segment made or received in dir D: LOCK_SH on D's g3f....lock
     `- daemon            one per group and D, started on first register(); holds no lock (see _daemon.py)

``group()`` and ``join_group()`` touch no file: ``import arraymp`` (which calls
``group()``) works with any $ARRAYMP_SHM_DIR and leaves nothing in /dev/shm. A
process becomes a member in a directory, holding LOCK_SH on the group's lock
file there for as long as it lives (Note [Proof of death] in _paths.py), at
its first named segment in it: ``new_name()`` before making one, ``register()``
and ``hold()``. That is where a missing or unusable directory is reported.
Segment names carry the group token, so anybody can tell which group a
segment belongs to.

Note [Holds across groups]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a segment lives while any process on the node holds it, whatever its group, and a holder's count goes back
when the holder dies, even by SIGKILL.

A process may hold segments of groups other than its own (a Dask worker holds what a client of another program sent
it). ``hold()`` makes it a member of the segment's group in that directory too (``member(dir, token)``: LOCK_SH on
that group's lock, kept until the process dies) and tells that group's daemon. So the creating group is not proved
dead while a holder lives, and that group's daemon gives the holder's count back when it dies. Switching group
(``join_group``) keeps these foreign locks.

Note [Startup sweep]
~~~~~~~~~~~~~~~~~~~~
Invariant: a program sweeps the default shm directory for segments of dead groups at most once, in the process that
makes a new token (its first arraymp process), at that ``group()`` call (so at ``import arraymp``); the sweep creates
nothing, removes only what gc would, and never fails the caller. ``ARRAYMP_MANAGER_SWEEP=0`` turns it off. It costs
one listdir and one non-blocking flock per distinct group.

Note [Locks and fork]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a member's LOCK_SH on its group's lock file is held until that member dies, whatever its parent or its own
code does with inherited descriptors; nothing ever calls LOCK_UN, which would unlock every process sharing the open
file description (a member just closes).

flock locks belong to the open file description; a forked child shares the parent's, so the group stays locked while
either lives. The child still takes its own description at once (``os.register_at_fork``): code that closes inherited
descriptors, or a parent that ends while the child lives, cannot then unlock the child.

A forkserver's server may have started before the group existed, so its children may carry no $ARRAYMP_GROUP (they
start a group of their own) or a stale module state: a parent can pass ``group()`` along and the child call
``join_group(token)``, which switches group.
"""

from __future__ import annotations

import os
import threading

import shm_core

from . import _paths


class _State:
    token: str | None = None
    pid: int = 0
    root: bool = False  # this process made the token: the main process of the program

    def __init__(self):
        # (shm dir, group) -> (our LOCK_SH fd, runtime dir) where we are a member (Note [Holds across groups])
        self.locks: dict[tuple[str, str], tuple[int, str]] = {}


_state = _State()
_lock = threading.Lock()


def group() -> str:
    """This process's group token (no ``_`` in it): ``$ARRAYMP_GROUP``, else a new one. Touches no file."""
    st = _state
    if st.token is not None and st.pid == os.getpid():
        return st.token
    with _lock:
        if st.token is None or st.pid != os.getpid():
            token = os.environ.get(_paths.GROUP_ENV, "")
            if _paths.GROUP_RE.fullmatch(token):
                _adopt(token)
            else:
                _adopt("g" + os.urandom(6).hex())
                st.root = True
                _startup_sweep()
        return st.token


def join_group(token: str) -> str:
    """Join (or switch to) the group ``token``, e.g. one passed to a forkserver child explicitly."""
    if not isinstance(token, str) or not _paths.GROUP_RE.fullmatch(token):
        raise ValueError(f"not an arraymp group token: {token!r} (expected 1-32 characters of [0-9a-z]); "
                         "pass the value of shm_manager.group() from the parent")
    with _lock:
        if _state.token != token or _state.pid != os.getpid():
            _adopt(token)
    return token


def current_group() -> str | None:
    """The group token if this process already is in a group, else None (never creates one)."""
    st = _state
    return st.token if st.token is not None and st.pid == os.getpid() else None


def member(dir: str | os.PathLike | None = None, token: str | None = None) -> tuple[str, str, str]:
    """``(token, runtime dir, shm dir)``: this process is now a member of its group (or of the group ``token``,
    Note [Holds across groups]) in ``dir``.

    Raises OSError naming the directory and the remedy when it cannot be used.
    """
    own = group()  # first: this process's state is its own, also when it holds another group's segment
    token = token or own
    shm = os.path.abspath(shm_core.shm_dir(dir))
    with _lock:
        got = _state.locks.get((shm, token))
        if got is None:
            try:
                rdir = _paths.runtime_dir(shm, group=token)
                got = _paths.open_lock(_paths.lock_path(rdir, token)), rdir
            except OSError as exc:
                raise OSError(exc.errno, f"cannot use {shm} for named shared-memory segments ({exc.strerror}: "
                              f"{exc.filename}); set ARRAYMP_SHM_DIR to a tmpfs directory you can write "
                              "(default /dev/shm), or use the 'file_descriptor' sharing strategy", shm) from exc
            _state.locks[(shm, token)] = got
    return token, got[1], shm


def runtime_dir_of(shm: str, token: str) -> str | None:
    """The runtime dir where this process is a member of ``token`` for the shm dir ``shm`` (absolute), else None."""
    got = _state.locks.get((shm, token))
    return got[1] if got is not None and _state.pid == os.getpid() else None


def new_name(prefix: str = shm_core.DEFAULT_PREFIX) -> str:
    """A segment name of this group for the shm directory: ``<prefix><uid>_<group>_<pid>_<16 hex>``.

    Makes this process a member there first (see :func:`member`).
    """
    return shm_core.segment_name(prefix, member()[0])


def _adopt(token: str) -> None:
    st = _state
    if token != st.token:  # the old group's locks go; those of segments held across groups stay
        for key in [key for key in st.locks if key[1] == st.token]:
            os.close(st.locks.pop(key)[0])
    st.token, st.pid, st.root = token, os.getpid(), False
    os.environ[_paths.GROUP_ENV] = token


def _startup_sweep() -> None:
    """Note [Startup sweep]."""
    if os.environ.get("ARRAYMP_MANAGER_SWEEP", "1") == "0":
        return
    from . import _gc

    try:
        _gc.gc()
    except Exception:  # a sweep must never break the program that runs it
        pass


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    st = _state
    if st.token is None:
        return
    st.pid, st.root = os.getpid(), False
    for (shm, token), (old, rdir) in list(st.locks.items()):
        try:
            fd = _paths.open_lock(_paths.lock_path(rdir, token))
        except OSError:
            continue  # keep the inherited description: it is locked too
        st.locks[(shm, token)] = fd, rdir
        os.close(old)


os.register_at_fork(after_in_child=_after_fork_in_child)
