"""The per-process connections to the group's daemons: frames sent, reconnects, ``release``, their end at exit.

Adapts the client half of CPython's ``multiprocessing/resource_tracker.py``:
one stream connection per process and segment directory (a forked child drops
the parent's and makes its own), small framed messages, no replies. A call
appends a frame and sends it with MSG_DONTWAIT (one syscall, no round trip);
what the socket does not take now goes with the next call. A connection stays
open while its daemon lives, however far behind it is (its EOF would have the
daemon give back counts this process still holds): past ``_MAX_PENDING``
bytes unsent, a call waits up to ``_BEHIND_WAIT`` for room. The daemon of a
directory serves only that directory and group (Note [Daemon input] in
_daemon.py), so a name goes to the daemon of the directory it is in and of the
group its name carries, which need not be this process's (Note [Holds across
groups] in _group.py). The daemon is started on
first need; when it is gone (killed), the next call starts a new one and sends
it every name this process still has registered. Nothing here ever raises:
when no daemon can be had, that is said once (a RuntimeWarning) and the group
works on; its segments are then removed when it ends (Note [End of a group] in
_end.py), or by the next program's sweep or ``gc``.

Frame: ``<u32 length><op><name>`` (``_frame``); ``_calls`` lists the ops and
has most of the calls that send them (``register``, ``hold``, ``give``,
``send_to``, ...). Here are those that act on the connections as a whole:
``release`` (a count given back, even from inside a call: Note [release from
a collection]), ``done_with`` (to every daemon), ``held``, ``flush``,
``daemon_pid``.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import threading
import time
import warnings

import shm_core

from . import _group, _paths

_MAX_PENDING = 4 << 20
_BEHIND_WAIT = 1.0  # seconds a call waits for a daemon that far behind
_RETRY_AFTER = 1.0


class _Conn:
    """This process's connection to the daemon of one group in one segment directory."""

    sock: socket.socket | None = None
    next_try: float = 0.0

    def __init__(self, shm: str, token: str):
        self.shm, self.token = shm, token
        self.pending = bytearray()
        self.names: set[str] = set()
        self.holds: dict[str, int] = {}  # name -> counts this process holds
        self.claims: dict[str, int] = {}  # of those, counts given at fork not claimed yet (unconnected)


class _Lock:
    """The lock over the connections, and the releases that arrived while this thread held it.

    Note [release from a collection]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Invariant: a release() on a thread that holds the lock already neither takes the lock nor touches a connection:
    it is queued in ``deferred``, and the holder makes it, in full, before it lets the lock go.

    Why: a garbage collection can run inside any allocation, also while this thread holds the lock (in register,
    say), and free a named segment whose ``__del__`` calls release(). Taking the lock again would hang; touching the
    connection then would interleave with the half-done change of the holder (its pending bytes, its holds being sent
    on a reconnect).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.deferred: list[tuple[str, object]] = []

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self):
        self._lock.acquire()
        self._owner = threading.get_ident()

    def __exit__(self, *exc):
        try:
            while self.deferred:
                _release_locked(*self.deferred.pop())
        finally:
            self._owner = None
            self._lock.release()


_conns: dict[tuple[str, str], _Conn] = {}
_lock = _Lock()
_closing = False
_warned = False


def _frame(op: bytes, name: str) -> bytes:
    payload = op + os.fsencode(name)
    return struct.pack("<I", len(payload)) + payload


def _key(dir) -> str:
    return os.path.abspath(shm_core.shm_dir(dir))


def _conn(dir, token: str) -> _Conn:
    """Under _lock."""
    key = _key(dir), token
    c = _conns.get(key)
    if c is None:
        c = _conns[key] = _Conn(*key)
    return c


def _token(name: str) -> str:
    """The group a segment name carries (this process's own for a name of no group)."""
    parsed = _paths.parse(name)
    return parsed[2] if parsed is not None else _group.group()


def _tell(c: _Conn, op: bytes, name: str, connect: bool = True) -> None:
    """Send one change; unconnected, connect instead (when ``connect``), which sends every name and
    hold, this change included. Under _lock."""
    if c.sock is None:
        if connect:
            _connect(c)
    else:
        c.pending += _frame(op, name)
    _drain(c)


def done_with(senders) -> None:
    """This process has read every message the processes ``senders`` (pids, dead or gone) sent it: the counts
    they told with :func:`send_to` that it never took go back (Note [Counts sent to a reader] in _books.py).
    Told to every daemon this process is connected to, and to its own group's (connecting, but not starting one:
    with none there, nothing was told); fire-and-forget."""
    try:
        with _lock:
            token = _group.current_group()
            if token is not None:
                c = _conn(None, token)
                if c.sock is None:
                    _connect(c, force=True, launch=False)
            for c in _conns.values():
                if c.sock is not None:
                    c.pending += b"".join(_frame(b"S", str(pid)) for pid in senders)
                    _drain(c)
    except Exception:
        pass


_start: tuple[int, int | None] = (0, None)  # (pid, its start time): read once per process, not once per claim


def _my_start() -> int | None:
    global _start
    if _start[0] != os.getpid():
        _start = (os.getpid(), _paths.start_time(os.getpid()))
    return _start[1]


def release(name: str, dir: str | os.PathLike | None = None) -> bool:
    """Give back one count held with :func:`hold`, through the daemon.

    True: the daemon takes the count off the header (and unlinks the segment
    when it was the last), exactly once even if this process dies right now.
    False: no daemon knows of the hold; the caller takes the count off itself.
    """
    try:
        if _lock.held_here():  # from a collection inside our own critical section: Note [release from a collection]
            c = _conns.get((_key(dir), _token(name)))
            if c is None or c.sock is None or not c.holds.get(name):
                return False
            _lock.deferred.append((name, dir))
            return True
        with _lock:
            return _release_locked(name, dir)
    except Exception:
        return False


def _release_locked(name: str, dir) -> bool:
    c = _conn(dir, _token(name))
    n = c.holds.get(name, 0)
    if n <= 1:
        c.holds.pop(name, None)
    else:
        c.holds[name] = n - 1
    if c.sock is None or not n:
        return False
    c.pending += _frame(b"X", name)
    # the daemon must see the release soon (it unlinks at zero): a full socket
    # waits for it a little, rather than holding the frame until the next call
    _send_pending(c, 1.0)
    return True


def held() -> set[str]:
    """The names of the segments this process holds a count of (told with :func:`hold`, not yet released), or
    held until its exit gave them back (_close_connections)."""
    with _lock:
        return {name for c in _conns.values() for name, n in c.holds.items() if n > 0} | _held_at_exit


def flush(timeout: float = 1.0) -> bool:
    """Send what is buffered, waiting up to ``timeout`` per daemon; True when nothing is left."""
    with _lock:
        return all([_send_pending(c, timeout) for c in _conns.values()])


def _send_pending(c: _Conn, timeout: float) -> bool:
    """Send what is buffered, waiting up to ``timeout`` for room in the socket; True when nothing is left.
    Under _lock."""
    deadline = time.monotonic() + timeout
    _drain(c)
    while c.sock is not None and c.pending and time.monotonic() < deadline:
        room = select.poll()  # (select.select fails past descriptor 1023)
        room.register(c.sock, select.POLLOUT)
        room.poll(50)
        _drain(c)
    return not c.pending


def daemon_pid(dir: str | os.PathLike | None = None) -> int | None:
    """The pid of the daemon this process is connected to for ``dir`` (connecting if needed), or None."""
    token = _group.current_group()
    if token is None:
        return None
    with _lock:
        c = _conn(dir, token)
        if c.sock is None:
            _connect(c, force=True)
            _drain(c)
        if c.sock is None:
            return None
        pid, _uid, _gid = struct.unpack("3i", c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid


def _drop(c: _Conn) -> None:
    if c.sock is not None:
        try:
            c.sock.close()
        except OSError:
            pass
    c.sock = None
    c.pending.clear()


def _drain(c: _Conn) -> None:
    waited = False
    while c.sock is not None and c.pending:
        try:
            n = c.sock.send(c.pending, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            if len(c.pending) <= _MAX_PENDING or waited:
                return  # the rest goes with the next call
            waited = True  # a daemon this far behind (stopped, starved) slows this process, never drops it
            room = select.poll()
            room.register(c.sock, select.POLLOUT)
            room.poll(int(_BEHIND_WAIT * 1000))
            continue
        except OSError:  # daemon gone (killed): reconnect, with every name, at once
            _drop(c)
            if _connect(c) and c.pending:
                continue
            return
        del c.pending[:n]


def _connect(c: _Conn, force: bool = False, launch: bool = True) -> bool:
    """Connect ``c`` and queue every name and hold it has; without ``launch``, only to a daemon already there."""
    global _warned
    if _closing or (not force and time.monotonic() < c.next_try):
        return False
    token, rdir = c.token, _group.runtime_dir_of(c.shm, c.token)
    if rdir is None:
        return False  # not a member there (yet): nothing of ours to watch
    sock = _try_connect(rdir, token)
    if sock is None and not launch:
        return False
    if sock is None:
        try:
            _start_daemon(token, rdir, c.shm)
        except Exception:  # no python to run, no room for a process: the group works on without
            pass
        sock = _try_connect(rdir, token)
    if sock is None:
        c.next_try = time.monotonic() + _RETRY_AFTER
        if not _warned:
            _warned = True
            warnings.warn(f"shm-manager: no cleanup daemon could be started for {c.shm} (see "
                          f"{os.path.join(rdir, _paths.LOG_NAME)}): named segments of processes killed from now on "
                          "are removed when the program ends, by the next arraymp program, or by `shm-manager gc`",
                          RuntimeWarning, stacklevel=4)
        return False
    c.sock = sock
    c.pending = bytearray(b"".join(_frame(b"R", n) for n in c.names))
    c.pending += b"".join(_frame(b"H", n) * (k - c.claims.get(n, 0)) for n, k in c.holds.items())
    if c.claims:  # (once: a daemon met later, a new one, knows of no count given)
        start = _my_start()
        c.pending += b"".join(_frame(b"C", f"{start}:{n}") * k for n, k in c.claims.items())
        c.claims.clear()
    return True


def _try_connect(rdir: str, token: str) -> socket.socket | None:
    try:
        rfd = os.open(rdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(_paths.socket_address(rfd, token))
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # never talk to anybody else
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    except OSError:
        sock.close()
        return None
    finally:
        os.close(rfd)


def _start_daemon(token: str, rdir: str, shm: str) -> None:
    """Run ``python -m shm_manager._daemon``; it returns once the daemon listens (see _daemon.py)."""
    import subprocess

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "shm_manager._daemon", "--group", token, "--runtime-dir", rdir, "--dir", shm]
    logfd = os.open(os.path.join(rdir, _paths.LOG_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC |
                    os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logfd,
                                close_fds=True, start_new_session=True, cwd="/", env=env)
    finally:
        os.close(logfd)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    except ChildProcessError:  # SIGCHLD ignored by the application
        pass


def _after_fork_in_child() -> None:
    global _lock, _conns
    _lock = _Lock()
    old, _conns = _conns, {}
    for c in old.values():
        if c.sock is not None:
            try:  # the parent keeps using the connection: close only our copy of the descriptor
                os.close(c.sock.detach())
            except OSError:
                pass


def _at_exit() -> None:
    global _closing
    try:
        flush(0.5)
    except Exception:
        pass
    _closing = True  # no daemon is started while the interpreter goes down


_held_at_exit: set[str] = set()


def _close_connections() -> None:
    """Last at exit, after every finalizer that may release a segment (multiprocessing's run after atexit's
    hooks, this one after them): give back the counts still held (a normal exit, not a death the daemon would
    log), send what is left and close the daemon connections, which the daemon reads as this process's end, as
    after os._exit (no socket is left for the interpreter to warn about)."""
    with _lock:
        for c in _conns.values():
            if c.sock is not None:
                for name, n in c.holds.items():
                    c.pending += _frame(b"X", name) * n
                    _held_at_exit.add(name)
                c.holds.clear()
    try:
        flush(0.5)
    except Exception:
        pass
    with _lock:
        for c in _conns.values():
            _drop(c)


os.register_at_fork(after_in_child=_after_fork_in_child)
import atexit  # noqa: E402
from multiprocessing import util as _mp_util  # noqa: E402

atexit.register(_at_exit)
_mp_util.Finalize(None, _close_connections, exitpriority=-100)
