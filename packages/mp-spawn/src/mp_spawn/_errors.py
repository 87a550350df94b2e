"""Exceptions raised by the supervisor, and the one-shot error files behind them.

Adapted from ``torch/multiprocessing/spawn.py``: same exception classes, same
constructor arguments, same message prefixes, so code (and regexes) written for
torch keep working.  What changed:

* the child sends a *record* (type name, message, formatted traceback, the
  pickled exception when it pickles) instead of only the traceback text, and it
  sends it for every ``BaseException`` (torch drops ``KeyboardInterrupt``);
* death by a signal says what the signal usually means and what to do; a
  SIGKILL says whether the kernel's OOM killer sent it, where the memory
  cgroup's counter can be read (``oom_kills``);
* the extra attributes survive pickling.

Note [error files, not pipes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a failed child's error reaches its parent whole, whatever its size: the parent reads
``<dir>/<index>.error`` only after the child has exited, never half a record, then removes it.

A child that fails writes that one file, in a directory only the owner can enter (``mkdtemp``, mode 0700), then
exits. It writes to a temporary name and renames. A pipe or a queue would deadlock on a large traceback (the child
blocks on a full pipe while the parent waits for the child to exit); a file has no such limit.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback

__all__ = [
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
]


class ProcessException(Exception):
    """Raised when a process started by the supervisor failed.

    ``error_index`` is the index ``i`` the failed process was started with and
    ``error_pid`` its process id.  ``pid`` is kept as an alias of
    ``error_pid`` for code written for torch.  ``other_failures`` lists the
    exceptions of the other processes found failed at the same time (their
    messages are part of this one's).
    """

    def __init__(self, msg: str, error_index: int, error_pid: int):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.other_failures: list[ProcessException] = []

    @property
    def pid(self) -> int:
        return self.error_pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid), self._extra_state()

    def _extra_state(self) -> dict:
        base = {"msg", "error_index", "error_pid"}
        return {k: v for k, v in self.__dict__.items() if k not in base}

    # (BaseException's takes None too; __reduce__ above always gives a dict)
    def __setstate__(self, state: dict) -> None:  # type: ignore[override]
        self.__dict__.update(state)


class ProcessRaisedException(ProcessException):
    """Raised when a process failed because its function raised an exception.

    The child's formatted traceback ends the message.  ``exc_type`` is the
    qualified name of the child's exception type, ``exc_message`` its
    ``str()``, ``child_traceback`` the formatted traceback, and ``original``
    the exception itself when it could be pickled in the child and unpickled
    here (``None`` otherwise).
    """

    def __init__(self, msg: str, error_index: int, error_pid: int):
        super().__init__(msg, error_index, error_pid)
        self.exc_type: str | None = None
        self.exc_message: str | None = None
        self.child_traceback: str | None = None
        self.original: BaseException | None = None


class ProcessExitedException(ProcessException):
    """Raised when a process failed by exiting with a non-zero code or by a signal.

    ``exit_code`` is ``multiprocessing``'s ``exitcode``: the code passed to
    ``sys.exit``, or minus the signal number.  ``signal_name`` is the signal's
    name (``"SIGKILL"``) or ``None`` for an ordinary exit.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        args = (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)
        return type(self), args, self._extra_state()

    def _extra_state(self) -> dict:
        base = {"msg", "error_index", "error_pid", "exit_code", "signal_name"}
        return {k: v for k, v in self.__dict__.items() if k not in base}


# What a signal usually means, and what to do about it.  Keys are signal names.
SIGNAL_HINTS = {
    "SIGKILL": (
        "this is often the out-of-memory killer; check `dmesg` or the container's "
        "memory limit, or use fewer processes or less memory per process"
    ),
    "SIGBUS": (
        "this is often /dev/shm full (a shared-memory page could not be backed); "
        "enlarge it, e.g. `docker run --shm-size=8g`, or share less memory"
    ),
    "SIGSEGV": (
        "a crash in native code (a C extension or the interpreter); "
        "the Python stack at the crash is shown below when it could be captured"
    ),
    "SIGABRT": (
        "an abort, usually a failed assertion in native code; "
        "the Python stack at the abort is shown below when it could be captured"
    ),
    "SIGFPE": "an arithmetic error in native code",
    "SIGILL": "an illegal instruction, often a binary built for another CPU",
    "SIGTERM": "it was terminated from outside (a job scheduler, `kill`, or a supervisor)",
    "SIGINT": "it was interrupted (Ctrl-C)",
    "SIGPIPE": "it wrote to a pipe or socket whose reader had gone",
    "SIGXCPU": "it exceeded its CPU time limit (`ulimit -t`)",
    "SIGXFSZ": "it exceeded its file size limit (`ulimit -f`)",
}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


# A SIGKILL, when the memory cgroup's OOM count is known (Note [OOM kills]): True, it rose; False, it did not.
_SIGKILL_BY = {
    True: (
        "killed by the kernel's OOM killer: the memory cgroup counted an OOM kill while it ran; use fewer "
        "processes or less memory per process, or raise the memory limit"
    ),
    False: (
        "sent from outside, e.g. `kill -9` or a job scheduler: the memory cgroup counted no OOM kill"
    ),
}


def exited_message(index: int, exit_code: int, started: bool, oom: bool | None = None) -> tuple[str, str | None]:
    """The torch message for a process that exited without an error record; ``oom`` for a SIGKILL: whether the
    memory cgroup's OOM count rose (None: unknown)."""
    if exit_code < 0:
        name = signal_name(-exit_code)
        msg = f"process {index:d} terminated with signal {name}"
        hint = _SIGKILL_BY[oom] if name == "SIGKILL" and oom is not None else SIGNAL_HINTS.get(name)
        if hint:
            msg += f" ({hint})"
        return msg, name
    msg = f"process {index:d} terminated with exit code {exit_code:d}"
    if not started:
        msg += (
            " before it could run its function (it could not unpickle the function "
            "or its arguments; define the function at the top level of an importable "
            "module and see the child's stderr)"
        )
    return msg, None


def raised_message(index: int, record: dict) -> str:
    """The torch message for a process whose function raised."""
    return f"\n\n-- Process {index:d} terminated with the following error:\n" + record["traceback"]


# Note [OOM kills]
# ~~~~~~~~~~~~~~~~
# Invariant: a child's death is blamed on the OOM killer only when it died of a SIGKILL the supervisor did not send
# and its memory cgroup's OOM-kill count went above the count read before the children started and above the count
# given to an earlier such death (each count explains one death); where no counter is readable nothing is said about
# the OOM killer beyond the usual hint.
#
# Why: the kernel counts each process its OOM killer ends in the victim's memory cgroup, before it sends the SIGKILL:
# cgroup v2 ``memory.events`` (hierarchical), cgroup v1 ``memory.oom_control`` (that cgroup's own), both
# ``oom_kill N``. The supervisor reads the count of its own cgroup. (mp_reductions' pool does the same in its own
# _deaths module: the two packages are installed alone.)


def oom_kills() -> int | None:
    """The OOM-kill count of this process's memory cgroup, or None where none can be read (Note [OOM kills])."""
    try:
        with open("/proc/self/cgroup") as fh:
            groups = [line.rstrip("\n").split(":", 2) for line in fh]
        with open("/proc/self/mountinfo") as fh:
            mounts = [line.split() for line in fh]
    except OSError:
        return None
    v1 = next((path for _, names, path in groups if "memory" in names.split(",")), None)
    v2 = next((path for hid, names, path in groups if hid == "0" and not names), None)
    for fields in mounts:
        if "-" not in fields:
            continue
        root, point, fstype = fields[3], fields[4], fields[fields.index("-") + 1]
        if v1 is not None and fstype == "cgroup" and "memory" in fields[-1].split(","):
            path = os.path.join(point, _below(v1, root), "memory.oom_control")
        elif v1 is None and v2 is not None and fstype == "cgroup2":
            rel = _below(v2, root)
            path = os.path.join(point, rel, "memory.events") if rel else "/proc/vmstat"  # the root: the machine's
        else:
            continue
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return None
    return None


def _below(path: str, root: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path.strip("/")


# --- the child's side -------------------------------------------------------


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def make_record(exc: BaseException, stack: traceback.StackSummary | None = None) -> dict:
    """Describe ``exc`` with plain strings, whatever ``exc`` does when used.

    ``stack``, when given, is the traceback to show for an exception not raised yet.
    """
    try:
        message = str(exc)
    except BaseException as e:  # noqa: BLE001 - a broken __str__ must not hide the error
        message = f"<str() failed: {type(e).__name__}>"
    try:
        if stack is None:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        else:
            tb = "Traceback (most recent call last):\n" + "".join(stack.format())
            tb += "".join(traceback.format_exception_only(type(exc), exc))
    except BaseException:  # noqa: BLE001
        tb = f"Traceback unavailable\n{_type_name(exc)}: {message}\n"
    try:
        pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - unpicklable exceptions still travel as text
        pickled = None
    return {
        "type": _type_name(exc),
        "message": message,
        "traceback": tb,
        "exception": pickled,
        "pid": os.getpid(),
        "time": time.time(),
    }


def write_record(path: str, exc: BaseException, stack: traceback.StackSummary | None = None) -> bool:
    """Write ``exc``'s record to ``path`` atomically; False when that failed."""
    record = make_record(exc, stack)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pickle.dump(record, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:
        # The parent gave up on us and removed the directory; it will report
        # our exit code instead.
        return False
    return True


# --- the parent's side ------------------------------------------------------


def read_record(path: str) -> dict | None:
    """Read and remove the record at ``path``; None when there is none."""
    try:
        with open(path, "rb") as fh:
            record = pickle.load(fh)
    except FileNotFoundError:
        return None
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return record


def raised_exception(index: int, pid: int, record: dict) -> ProcessRaisedException:
    exc = ProcessRaisedException(raised_message(index, record), index, pid)
    exc.exc_type = record["type"]
    exc.exc_message = record["message"]
    exc.child_traceback = record["traceback"]
    if record.get("exception") is not None:
        try:
            exc.original = pickle.loads(record["exception"])
        except BaseException:  # noqa: BLE001 - pickles but does not unpickle here
            exc.original = None
    return exc
