"""What every child runs: ``fn(i, *args)`` bound to its supervisor, its failure written to its error file.

Adapted from ``_wrap`` in ``torch/multiprocessing/spawn.py``.  What changed:
the child binds itself to its supervisor first (``_deathsig``: it dies with
it, its process group with it); it opens its fault file (``faulthandler``:
the Python stack of a fatal signal, and the sign that ``fn`` was reached);
it reports every ``BaseException``, KeyboardInterrupt included, through an
error file (Note [error files, not pipes] in ``_errors``); a failed child
stops the processes it started itself and exits within
``MP_SPAWN_FAILED_EXIT_TIMEOUT`` seconds; and a child that imports the main
module again and finds it starting processes says why (Note [unguarded
main]).

Note [unguarded main]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a script that calls ``spawn`` or ``start_processes`` at its top level, without ``if __name__ ==
"__main__":``, fails in the parent with a RuntimeError that names the guard, never with a bare "terminated with exit
code 1 before it could run its function".

Why: a spawn or forkserver child imports the main module again (as ``__mp_main__``) before it reads its function, so
such a script calls ``spawn`` again there; the stdlib refuses to start processes then and the child exits with code
1. So ``start_processes``, called while the process imports the main module for a start (the main module's top
level, run as ``__mp_main__``, on the stack), raises a RuntimeError that names the guard and
writes it to this child's error file, for the parent to raise as usual. The child knows that file from its process
name: the parent sends the name before the main module (the one thing it sends first), so it appends the path
(``_NAME_TAG``) for the start and takes it off again on both sides.

The fork server imports the main module itself as it starts (it preloads ``__main__``), and such a script may end it
there, before any child exists: our RuntimeError (or the stdlib's) goes to its stderr, and where the connection to
the fork server is authenticated (3.13.x and 3.14 seen here; 3.11.7's children fail instead) the start fails with a
broken connection. A forkserver start that fails so, with no child's error file, raises a RuntimeError that names the
guard.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import traceback
import types

from . import _deathsig, _errors
from ._context import _live_contexts

_fault_file = None  # the child's faulthandler file, kept open until exit

# Appended to a spawn or forkserver child's name for its start, with its error file (Note [unguarded main]).
_NAME_TAG = " mp_spawn-error-file="


def _wrap(fn, i, args, error_dir, parent_pid, parent_start, expected_ppid, exit_timeout):
    """The target of every child process."""
    current = multiprocessing.current_process()
    current.name = current.name.partition(_NAME_TAG)[0]
    _deathsig.bind_to_parent(parent_pid, parent_start, expected_ppid, error_dir)
    _enable_faulthandler(os.path.join(error_dir, f"{i}.fault"))
    try:
        fn(i, *args)
    except SystemExit:
        raise  # sys.exit(code): the exit code says it all
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is a failure too
        _errors.write_record(os.path.join(error_dir, f"{i}.error"), exc)
        del exc
        _stop_own_children()
        _arm_exit_backstop(exit_timeout)
        sys.exit(1)


def _importing_main_of_a_child() -> bool:
    """Is this thread running the main module's top level as ``__mp_main__``, as a spawn or forkserver child (or
    the fork server) imports it before it runs its function (Note [unguarded main])?"""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def _refuse_unguarded_start() -> None:
    """Raise the error of a script without ``if __name__ == "__main__":``, in the child (Note [unguarded main])."""
    exc = RuntimeError(
        "a spawn or forkserver child called spawn() or start_processes() while it imported the main module again "
        "(as __mp_main__, which such a child does before it runs its function): the script starts processes at "
        "its top level (see the traceback). "
        'The script needs `if __name__ == "__main__":`; put the code that starts processes under it.'
    )
    path = multiprocessing.current_process().name.partition(_NAME_TAG)[2]
    if path:  # a child of ours: its parent raises this error too
        _errors.write_record(path, exc, stack=traceback.extract_stack(sys._getframe(1)))
    raise exc


def _enable_faulthandler(path: str) -> None:
    """Open the fault file (its existence tells the parent ``fn`` was reached)."""
    global _fault_file
    try:
        _fault_file = open(path, "w")  # noqa: SIM115 - must stay open until exit
    except OSError:
        return
    faulthandler.enable(file=_fault_file, all_threads=True)


def _stop_own_children() -> None:
    me = os.getpid()
    for context in list(_live_contexts):
        if context._owner_pid == me:
            context._terminate(first_wait=None, term_wait=1.0)
            context._finish()


def _arm_exit_backstop(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
