"""Child functions for the mp-spawn tests.

They live in an importable module (not in the test files) so that spawn and
forkserver children can unpickle them by reference.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import mp_spawn

# The parent changes this in memory; only fork children see the change.
MARK = "module default"

LONG_SLEEP_S = 60.0


def success(i, out_dir=None):
    if out_dir is not None:
        with open(os.path.join(out_dir, f"ran-{i}"), "w") as fh:
            fh.write(str(os.getpid()))


def put_index(i, queue, extra):
    queue.put((i, extra))


def report_mark(i, queue):
    queue.put(MARK)


def exception_single(i, arg):
    if i == arg:
        raise ValueError(f"legitimate exception from process {i}")
    time.sleep(LONG_SLEEP_S)  # torch sleeps 1 s; long enough to be surely terminated


def exception_all(i):
    time.sleep(random.random() / 10)
    raise ValueError(f"legitimate exception from process {i}")


def exception_all_now(i):
    raise ValueError(f"legitimate exception from process {i}")


def terminate_signal(i, signum=signal.SIGABRT):
    if i == 0:
        os.kill(os.getpid(), signum)
    time.sleep(1.0)


def terminate_exit(i, arg, sleep=1.0):
    if i == 0:
        sys.exit(arg)
    time.sleep(sleep)


def fail_and_raise(i):
    if i == 0:
        sys.exit(3)
    raise RuntimeError(f"second failure from process {i}")


def success_first_then_exception(i, arg=None):
    if i == 0:
        return
    time.sleep(0.1)
    raise ValueError("legitimate exception")


def infinite(i):
    while True:
        time.sleep(1)


def process_exit(i):
    sys.exit(12)


def wait_for_file(i, path):
    while not os.path.exists(path):
        time.sleep(0.02)


def ignore_sigterm_then_wait(i, marker, exitcode):
    """Process 1 ignores SIGTERM; process 0 fails once process 1 is ready."""
    if i == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(marker, "w"):
            pass
        while True:
            time.sleep(1)
    while not os.path.exists(marker):
        time.sleep(0.02)
    sys.exit(exitcode)


# --- error transport ---


class Unpicklable(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


class NeedsTwoArgs(Exception):
    """Pickles, but unpickling calls __init__ with one argument and fails."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")


class CustomBase(BaseException):
    pass


class WithPayload(Exception):
    def __init__(self, msg, payload):
        super().__init__(msg, payload)
        self.payload = payload


def raise_unpicklable(i):
    raise Unpicklable(f"cannot pickle me {i}")


def raise_needs_two_args(i):
    raise NeedsTwoArgs("x", i)


def raise_base_exception(i):
    raise CustomBase(f"a BaseException subclass from process {i}")


def raise_keyboard_interrupt(i):
    raise KeyboardInterrupt


def sigint_self(i):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(LONG_SLEEP_S)


def raise_huge(i, nbytes):
    raise ValueError("start-" + "x" * nbytes + "-end")


def raise_with_payload(i):
    raise WithPayload("has a payload", {"index": i, "data": [1, 2, 3]})


def leave_non_daemon_thread_and_raise(i):
    threading.Thread(target=time.sleep, args=(LONG_SLEEP_S,), daemon=False).start()
    raise ValueError("raised with a non-daemon thread running")


# --- parallel start ---


class SlowToUnpickle:
    """Unpickling takes ``seconds`` in the child (like a slow import); it writes its
    (start, end) CLOCK_MONOTONIC window to a file in ``directory``."""

    def __init__(self, seconds, directory):
        self.seconds, self.directory = seconds, directory

    def __reduce__(self):
        return (_slow_rebuild, (self.seconds, self.directory))


def _slow_rebuild(seconds, directory):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.path.join(directory, str(os.getpid())), "w") as fh:
        fh.write(f"{start} {time.monotonic()}")
    return SlowToUnpickle(seconds, directory)


def noop_with_args(i, *args):
    pass


# --- nesting and parent death ---


def _write_pid(directory, tag):
    path = os.path.join(directory, f"{tag}-{os.getpid()}")
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(path + ".tmp", path)


def grandchild(i, directory):
    _write_pid(directory, "grandchild")
    time.sleep(LONG_SLEEP_S)


def middle(i, directory, start_method, how_to_die):
    """Start two grandchildren, announce them, then die (or wait)."""
    ctx = mp_spawn.start_processes(grandchild, args=(directory,), nprocs=2, join=False, start_method=start_method)
    deadline = time.monotonic() + LONG_SLEEP_S
    pids = ctx.pids()
    while not all(any(name.endswith(f"-{pid}") for name in os.listdir(directory)) for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError("grandchildren did not start")
        time.sleep(0.02)
    with open(os.path.join(directory, f"pids-{i}.json.tmp"), "w") as fh:
        json.dump({"middle": os.getpid(), "grandchildren": pids}, fh)
    os.rename(os.path.join(directory, f"pids-{i}.json.tmp"), os.path.join(directory, f"pids-{i}.json"))
    if how_to_die == "wait":
        time.sleep(LONG_SLEEP_S)
    else:
        # Die when the test has looked at the grandchildren.
        while not os.path.exists(os.path.join(directory, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), getattr(signal, how_to_die))
        time.sleep(LONG_SLEEP_S)


def driver(directory, start_method, nprocs):
    """The main of a separate program: start middles that start grandchildren, wait."""
    with open(os.path.join(directory, "driver-ready"), "w") as fh:
        fh.write(str(os.getpid()))
    mp_spawn.start_processes(
        middle,
        args=(directory, start_method, "wait"),
        nprocs=nprocs,
        join=True,
        start_method=start_method,
    )


def watchdog_child(parent_pid, parent_start):
    """The main of a separate program: only the watchdog (no PR_SET_PDEATHSIG)."""
    from mp_spawn import _deathsig

    _deathsig.start_watchdog(parent_pid, parent_start)
    print("armed", flush=True)
    time.sleep(LONG_SLEEP_S)


# --- descendants spawn does not know about (subprocess.Popen) ---

# The grandchild: a Python that starts a great-grandchild (sleep), announces
# both pids in the file named by argv[1], then waits.
_GRANDCHILD = f"""
import json, os, subprocess, sys, time
sleeper = subprocess.Popen(["sleep", "{LONG_SLEEP_S:.0f}"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump([os.getpid(), sleeper.pid], fh)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep({LONG_SLEEP_S})
"""


def popen_descendants(i, directory, then):
    """Start a grandchild and a great-grandchild with Popen, then ``then``: ``"wait"`` (until
    killed), or once the test says go, ``"return"`` or ``"raise"`` (process 0 raises, the others
    wait to be terminated)."""
    path = os.path.join(directory, f"descendants-{i}.json")
    subprocess.Popen([sys.executable, "-c", _GRANDCHILD, path])
    deadline = time.monotonic() + LONG_SLEEP_S
    while then != "wait" and not os.path.exists(os.path.join(directory, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
    if then == "raise" and i == 0:
        raise ValueError("failed, leaving descendants")
    if then != "return":
        infinite(i)


def popen_driver(directory, start_method, nprocs):
    """The main of a separate program: children that start descendants with Popen, then wait."""
    mp_spawn.start_processes(
        popen_descendants, args=(directory, "wait"), nprocs=nprocs, join=True, start_method=start_method
    )


def leave_shared_memory(i, name):
    """Create a named segment and exit without unlinking it: the resource tracker's job."""
    from multiprocessing import shared_memory

    shared_memory.SharedMemory(name=name, create=True, size=4096).close()


def shared_memory_driver(name, start_method):
    """The main of a separate program, whose fork children start a resource tracker of their own."""
    mp_spawn.start_processes(leave_shared_memory, args=(name,), nprocs=1, join=True, start_method=start_method)


def ctrl_c_driver(directory, start_method):
    """The main of a separate program on a terminal (stdin): torch's join loop, for Ctrl-C to interrupt."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # we lead a new session: the terminal becomes ours
    ctx = mp_spawn.start_processes(
        popen_descendants, args=(directory, "wait"), nprocs=2, join=False, start_method=start_method
    )
    while not ctx.join(timeout=1.0):
        pass


# --- what a child leaves behind: daemons, cleanup daemons ---


def double_fork_daemon(i, directory):
    """Start a daemon the classic way (fork, setsid, fork), wait for it to write its pid to
    ``daemon.pid``, and return.  The daemon inherits every descriptor of this process."""
    path = os.path.join(directory, "daemon.pid")
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                with open(path + ".tmp", "w") as fh:
                    fh.write(str(os.getpid()))
                os.rename(path + ".tmp", path)
                time.sleep(LONG_SLEEP_S)
        finally:
            os._exit(0)
    os.waitpid(intermediate, 0)
    deadline = time.monotonic() + LONG_SLEEP_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def session_daemon(i, directory):
    """Start a daemon with ``start_new_session=True`` (it leaves our group), write both pids to ``session.json``,
    and wait to be killed with the supervisor."""
    daemon = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({LONG_SLEEP_S})"],
                              start_new_session=True)
    path = os.path.join(directory, "session.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"child": os.getpid(), "daemon": daemon.pid}, fh)
    os.rename(path + ".tmp", path)
    time.sleep(LONG_SLEEP_S)


def session_daemon_driver(directory, start_method):
    """The main of a separate program: one child that starts a session daemon, joined."""
    mp_spawn.start_processes(session_daemon, args=(directory,), nprocs=1, join=True, start_method=start_method)


def leak_shared_memory_behind_slow_grandchild(i, directory):
    """Create an unnamed-by-us ``SharedMemory`` (a ``psm_*`` name) and leave it for the resource
    tracker; fork a grandchild, which inherits the tracker's pipe and takes 2 s to handle SIGTERM;
    write ``ready`` (with the segment's name) and wait to be killed with the supervisor."""
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(create=True, size=4096)
    segment.close()
    grandchild = os.fork()
    if grandchild == 0:
        try:

            def slow_exit(signum, frame):
                time.sleep(2.0)
                os._exit(0)

            signal.signal(signal.SIGTERM, slow_exit)
            open(os.path.join(directory, "grandchild-ready"), "w").close()
            time.sleep(LONG_SLEEP_S)
        finally:
            os._exit(0)
    deadline = time.monotonic() + LONG_SLEEP_S
    while not os.path.exists(os.path.join(directory, "grandchild-ready")) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.path.join(directory, "ready.tmp"), "w") as fh:
        json.dump({"segment": segment.name, "grandchild": grandchild}, fh)
    os.rename(os.path.join(directory, "ready.tmp"), os.path.join(directory, "ready"))
    time.sleep(LONG_SLEEP_S)


def shared_memory_slow_grandchild_driver(directory, start_method):
    """The main of a separate program, to be killed with SIGKILL once ``ready`` exists."""
    mp_spawn.start_processes(
        leak_shared_memory_behind_slow_grandchild, args=(directory,), nprocs=1, join=True, start_method=start_method
    )
