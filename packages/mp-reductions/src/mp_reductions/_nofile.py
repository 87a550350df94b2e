"""The open-files limit (RLIMIT_NOFILE): raised for this process's shared-memory descriptors when they need it, and
for nothing else.

Note [open-files limit]: the descriptor LRU (_shared Note [descriptors]) keeps a budget of a quarter of the soft
limit; a normal user's soft limit is commonly 1024 (a budget of 256) under a hard one of 65,536 or more, and a
descriptor the LRU closes cannot be re-opened without privileges. So, as Go's runtime does, the process raises its
soft limit to the hard one, but only when it must and only for itself:

- when the LRU is about to close a live segment's descriptor, or a receive is about to refuse a message for want of
  descriptors (``raise_for_budget``), never at import: a program that keeps fewer than a quarter of its limit in
  shared segments and never runs out never changes it;
- never a limit the user set: one under ``FLOOR`` (1024, the usual default: lower was set on purpose), nor one
  changed since this module first saw it (``resource.setrlimit`` after import);
- never for other programs: once raised, every child that execs (``subprocess``, ``os.exec*``, ``os.system``,
  ``os.posix_spawn``, multiprocessing's spawn and forkserver launches) gets the limit the process had before, as
  Go gives every exec'd child. Those calls are wrapped while the limit is raised: the soft limit is lowered around
  the call and restored after (an exec that succeeds replaces the process). Where this process already holds a
  descriptor at or past the old limit, lowering it could fail another thread's ``open`` meanwhile: then the child
  gets the raised limit. A fork child (no exec) keeps it, as it keeps the descriptors it counts for.

A spawned arraymp process starts from the old limit and raises it on its own when its descriptors need it.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import os
import resource
import subprocess
import threading

FLOOR = 1024
_lock = threading.Lock()
_seen = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # the soft limit as this process last saw or set it
_before: int | None = None  # the soft limit before this process raised it
_lowered = 0  # wrapped exec calls under way
_restore_to: int | None = None  # the raised soft limit, while the calls under way run under the old one


def raise_for_budget() -> bool:
    """Raise the soft limit to the hard one (at most the kernel's fs.nr_open) if Note [open-files limit] allows;
    True when it changed."""
    global _seen, _before
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != _seen or soft == resource.RLIM_INFINITY or soft < FLOOR or _lowered:
            return False
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


def _lower() -> None:
    global _lowered, _restore_to
    with _lock:
        _lowered += 1
        if _lowered > 1 or _before is None:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == _seen and soft > _before and _highest_fd() < _before:
            resource.setrlimit(resource.RLIMIT_NOFILE, (_before, hard))
            _restore_to = soft


def _restore() -> None:
    global _lowered, _restore_to
    with _lock:
        _lowered -= 1
        if _lowered or _restore_to is None:
            return
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (_restore_to, hard))
        _restore_to = None


def _highest_fd() -> int:
    try:
        return max(map(int, os.listdir("/proc/self/fd")))
    except (OSError, ValueError):
        return 1 << 30  # cannot tell: do not lower


def _exec_with_old_limit(call):
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        _lower()
        try:
            return call(*args, **kwargs)
        finally:
            _restore()

    wrapper._arraymp_wrapped = call
    return wrapper


# Where a child is exec'd: (module, attribute). subprocess binds _posixsubprocess.fork_exec as its own
# _fork_exec; multiprocessing's spawn calls _posixsubprocess.fork_exec; os.exec* and os.spawn* call os.execv /
# os.execve by name.
EXEC_CALLS = [(os, "execv"), (os, "execve"), (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp"),
              (subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec")]


def _wrap_exec() -> None:
    for module, name in EXEC_CALLS:
        call = getattr(module, name, None)
        if call is not None and not hasattr(call, "_arraymp_wrapped"):
            setattr(module, name, _exec_with_old_limit(call))
