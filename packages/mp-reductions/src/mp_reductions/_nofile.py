"""The open-files limit (RLIMIT_NOFILE): raised for this process's shared-memory descriptors when they need it, and
for nothing else.

Note [open-files limit]
~~~~~~~~~~~~~~~~~~~~~~~
Invariant: the soft limit is raised (to the hard one, at most the kernel's fs.nr_open) only when the descriptor LRU
would close a live descriptor or a receive would refuse a message (``raise_for_budget``), never at import, never
where the user set it (under ``FLOOR``, or changed since), and for this process alone: what it execs gets the old
limit (Note [exec under the old limit]).

Why: the LRU (_shared Note [descriptors]) keeps a quarter of the limit, and a closed descriptor cannot be re-opened
without privileges; so the limit goes up to the hard one, as Go's runtime raises it.

Note [exec under the old limit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: every program this process execs starts under the soft limit the process had before it raised its own,
however many descriptors it holds (a child that sizes an ``fd_set`` by its limit must not abort), but for the cases
listed last.

How: open descriptors stay valid under a lower limit, so the exec alone gets the old one. ``os.execv``/``os.execve``
(so ``os.exec*``, ``os.spawn*``, fork then exec) lower it in the process that execs; ``os.system``'s shell lowers its
own (``ulimit -S -n``); ``subprocess``, ``os.posix_spawn*`` and multiprocessing's spawn and forkserver launches fork
in C, under the old limit, lowered and raised again by C calls chained with no Python between them, the GIL held:
subprocess then forks instead of vforking (which releases the GIL until the child execs) or posix_spawning (its file
actions name its new pipes, past the old limit). A thread inside a system call meanwhile, or from Python 3.14 (its
subprocess always vforks: gh-121381 removed ``_USE_VFORK``) any thread until the child execs, may be refused a
descriptor past the old limit; our receives then try again.

Not covered (the raised limit is kept): ``os.posix_spawn`` with a file action naming a descriptor past the old limit
(glibc refuses it under that limit), a call through a reference to these functions taken before the limit was raised
(``from os import execv``), what C code starts itself (ctypes, extensions), a fork child that does not exec.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import operator
import os
import resource
import subprocess
import threading
import time

FLOOR = 1024
_RETRY_AFTER_EXEC = 1.0  # seconds after a child's start in which a refusal of descriptors may have been its doing
_lock = threading.RLock()
_seen = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # the soft limit as this process last saw or set it
_before: int | None = None  # the soft limit before this process raised it
_started_at = -_RETRY_AFTER_EXEC  # time.monotonic() when the last child started under the old limit was started


def raise_for_budget() -> bool:
    """Raise the soft limit to the hard one (at most the kernel's fs.nr_open) if Note [open-files limit] allows;
    True when the caller may try again with more descriptors than it had: the limit changed, or a child was
    started under the old limit right before (another thread may have been refused a descriptor meanwhile)."""
    global _seen, _before
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != _seen or soft == resource.RLIM_INFINITY or soft < FLOOR:
            return False
        if _before is not None and time.monotonic() - _started_at < _RETRY_AFTER_EXEC:
            return True
        try:
            with open("/proc/sys/fs/nr_open") as f:
                ceiling = int(f.read())
        except (OSError, ValueError):
            ceiling = 1 << 20
        want = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
        if want <= soft:
            return False
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError):  # a sandbox may refuse it: the budget follows the soft limit as it is
            return False
        if _before is None:
            _before = soft
            _wrap_exec()
        _seen = want
        return True


def _raised() -> tuple[int, int, int] | None:
    """``(soft before, soft now, hard)`` while this process runs under the soft limit it raised, else None."""
    if _before is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (_before, soft, hard) if soft == _seen and soft > _before else None


def _under_old_limit(call, fits=lambda old, kwargs: True):
    """``call`` (an exec, or a C function that forks and execs) run with the soft limit the process had before,
    where ``fits(old, kwargs)``."""

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        global _started_at
        with _lock:
            limits = _raised()
            if limits is None or not fits(limits[0], kwargs):
                return call(*args, **kwargs)
            old, raised, hard = limits
            nofile = resource.RLIMIT_NOFILE
            steps = (functools.partial(resource.setrlimit, nofile, (old, hard)),
                     functools.partial(call, *args, **kwargs),
                     functools.partial(resource.setrlimit, nofile, (raised, hard)))
            try:
                return list(map(operator.call, steps))[1]  # C calls only: no Python thread runs in between
            except BaseException:
                resource.setrlimit(nofile, (raised, hard))  # the call failed (an exec that succeeds never returns)
                raise
            finally:
                _started_at = time.monotonic()

    wrapper._arraymp_wrapped = call
    return wrapper


def _shell_under_old_limit(system):
    """``os.system``: its shell lowers its own soft limit before it runs the command (the call waits for the
    command, which may take hours: this process keeps its limit meanwhile)."""

    @functools.wraps(system)
    def wrapper(command):
        limits = _raised()
        if limits is not None:
            command = os.fspath(command)
            prefix = f"ulimit -S -n {limits[0]} 2>/dev/null\n"
            command = os.fsencode(prefix) + command if isinstance(command, bytes) else prefix + command
        return system(command)

    wrapper._arraymp_wrapped = system
    return wrapper


def _spawn_under_old_limit(spawn):
    """``os.posix_spawn*``: glibc refuses a file action naming a descriptor at or past the soft limit (EBADF), so
    such a call keeps the raised one (Note [exec under the old limit])."""

    def fits(old, kwargs):
        try:
            for action in kwargs.get("file_actions") or ():
                if max(action[1:3] if action[0] == os.POSIX_SPAWN_DUP2 else action[1:2]) >= old:
                    return False
        except (TypeError, IndexError, ValueError):  # not ours to judge: the call raises its own error
            pass
        return True

    return _under_old_limit(spawn, fits)


# Where a child is exec'd: (module, attribute, wrapper). subprocess binds _posixsubprocess.fork_exec as its own
# _fork_exec; multiprocessing's spawn calls _posixsubprocess.fork_exec; os.exec*, os.spawn* and os.execvp* call
# os.execv / os.execve by name.
EXEC_CALLS = [(os, "execv", _under_old_limit), (os, "execve", _under_old_limit),
              (os, "posix_spawn", _spawn_under_old_limit), (os, "posix_spawnp", _spawn_under_old_limit),
              (subprocess, "_fork_exec", _under_old_limit), (_posixsubprocess, "fork_exec", _under_old_limit),
              (os, "system", _shell_under_old_limit)]


def _wrap_exec() -> None:
    # subprocess's file actions for posix_spawn name the pipes it just made, past the old limit (EBADF); and its vfork
    # lets every thread run while the child execs (the GIL released, Note [exec under the old limit]): fork, holding it
    subprocess._USE_POSIX_SPAWN = False  # type: ignore[misc]  # (Final in typeshed)
    if hasattr(subprocess, "_USE_VFORK"):  # (gone in 3.14, gh-121381: subprocess vforks where it can)
        subprocess._USE_VFORK = False  # type: ignore[misc]
    for module, name, wrap in EXEC_CALLS:
        call = getattr(module, name, None)
        if call is not None and not hasattr(call, "_arraymp_wrapped"):
            setattr(module, name, wrap(call))


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
