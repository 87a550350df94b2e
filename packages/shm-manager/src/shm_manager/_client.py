"""The per-process connection to the group's daemon: ``register`` / ``unregister``.

Adapts the client half of CPython's ``multiprocessing/resource_tracker.py``:
one stream connection per process (a forked child drops the parent's and
makes its own), small framed messages, no replies. A call appends a frame and
sends it with MSG_DONTWAIT (one syscall, no round trip); what the socket does
not take now goes with the next call. The daemon is started on first need;
when it is gone (killed), the next call starts a new one and sends it every
name this process still has registered. Nothing here ever raises: without a
daemon the group keeps working, and a dead group's segments are still removed
by the next daemon, ``gc`` or the next program's startup sweep.

Frame: ``<u32 length><op><dir>\\0<name>``, op ``R`` (register) or ``U``,
``H`` (this process holds one count of the segment's refcount) or ``X`` (the
daemon takes one count back for it: unlinking at zero).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import threading
import time

import shm_core

from . import _group, _paths

_MAX_PENDING = 4 << 20
_RETRY_AFTER = 1.0


class _Conn:
    sock: socket.socket | None = None
    pid: int = 0
    pending: bytearray
    names: set
    holds: dict
    next_try: float = 0.0

    def __init__(self):
        self.pending = bytearray()
        self.names = set()
        self.holds = {}  # (dir, name) -> counts this process holds
        self.pid = os.getpid()


_conn = _Conn()
_lock = threading.Lock()
_closing = False


def _frame(op: bytes, d: str, name: str) -> bytes:
    payload = op + os.fsencode(d) + b"\0" + os.fsencode(name)
    return struct.pack("<I", len(payload)) + payload


def _tell(c: _Conn, op: bytes, d: str, name: str, connect: bool = True) -> None:
    """Send one change; unconnected, connect instead (when ``connect``), which sends every name and
    hold, this change included. Under _lock."""
    if c.sock is None:
        if connect:
            _connect(c)
    else:
        c.pending += _frame(op, d, name)
    _drain(c)


def register(name: str, dir: str | os.PathLike | None = None) -> None:
    """Tell the group's daemon about a named segment (fire-and-forget; never raises)."""
    try:
        d = shm_core.shm_dir(dir)
        _group.group()
        with _lock:
            c = _conn
            c.names.add((d, name))
            _tell(c, b"R", d, name)
    except Exception:
        pass


def unregister(name: str, dir: str | os.PathLike | None = None) -> None:
    """Tell the daemon a segment was unlinked (fire-and-forget; never raises)."""
    try:
        d = shm_core.shm_dir(dir)
        with _lock:
            c = _conn
            c.names.discard((d, name))
            _tell(c, b"U", d, name, connect=bool(c.names))
    except Exception:
        pass


def hold(name: str, dir: str | os.PathLike | None = None) -> None:
    """This process now holds one count of the segment's header refcount (fire-and-forget).

    Should this process die holding it, the daemon gives the count back (and
    unlinks the segment when that was the last): a SIGKILLed consumer does not
    pin a segment until its whole group ends.
    """
    try:
        d = shm_core.shm_dir(dir)
        _group.group()
        with _lock:
            c = _conn
            c.holds[(d, name)] = c.holds.get((d, name), 0) + 1
            _tell(c, b"H", d, name)
    except Exception:
        pass


def release(name: str, dir: str | os.PathLike | None = None) -> bool:
    """Give back one count held with :func:`hold`, through the daemon.

    True: the daemon takes the count off the header (and unlinks the segment
    when it was the last), exactly once even if this process dies right now.
    False: no daemon knows of the hold; the caller takes the count off itself.
    """
    try:
        d = shm_core.shm_dir(dir)
        with _lock:
            c = _conn
            n = c.holds.get((d, name), 0)
            if n <= 1:
                c.holds.pop((d, name), None)
            else:
                c.holds[(d, name)] = n - 1
            if c.sock is None or not n:
                return False
            c.pending += _frame(b"X", d, name)
            # the daemon must see the release soon (it unlinks at zero): a full socket
            # waits for it a little, rather than holding the frame until the next call
            _send_pending(c, 1.0)
            return True
    except Exception:
        return False


def flush(timeout: float = 1.0) -> bool:
    """Send what is buffered, waiting up to ``timeout``; True when nothing is left."""
    with _lock:
        return _send_pending(_conn, timeout)


def _send_pending(c: _Conn, timeout: float) -> bool:
    """Send what is buffered, waiting up to ``timeout`` for room in the socket; True when nothing is left.
    Under _lock."""
    deadline = time.monotonic() + timeout
    _drain(c)
    while c.sock is not None and c.pending and time.monotonic() < deadline:
        select.select([], [c.sock], [], 0.05)
        _drain(c)
    return not c.pending


def daemon_pid() -> int | None:
    """The pid of the daemon this process is connected to (connecting if needed), or None."""
    with _lock:
        c = _conn
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
    while c.sock is not None and c.pending:
        try:
            n = c.sock.send(c.pending, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            if len(c.pending) > _MAX_PENDING:  # daemon stuck: start over later, names are kept
                _drop(c)
            return
        except OSError:  # daemon gone (killed): reconnect, with every name, at once
            _drop(c)
            if _connect(c) and c.pending:
                continue
            return
        del c.pending[:n]


def _connect(c: _Conn, force: bool = False) -> bool:
    if _closing or (not force and time.monotonic() < c.next_try):
        return False
    token = _group.current_group()
    if token is None:
        return False
    addr = _paths.socket_address(os.getuid(), token)
    sock = _try_connect(addr)
    if sock is None:
        try:
            _start_daemon(token)
        except Exception:  # no python to run, no room for a process: the group works on without
            pass
        sock = _try_connect(addr)
    if sock is None:
        c.next_try = time.monotonic() + _RETRY_AFTER
        return False
    c.sock = sock
    c.pending = bytearray(b"".join(_frame(b"R", d, n) for d, n in c.names))
    c.pending += b"".join(_frame(b"H", d, n) * k for (d, n), k in c.holds.items())
    return True


def _try_connect(addr: bytes) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(addr)
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # somebody else squats the address: never talk to it
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    except OSError:
        sock.close()
        return None


def _start_daemon(token: str) -> None:
    """Run ``python -m shm_manager._daemon``; it returns once the daemon listens (see _daemon.py)."""
    import subprocess

    st = _group._state
    rdir = st.rdir or _paths.runtime_dir()
    log = os.path.join(rdir, _paths.LOG_NAME)
    try:
        if os.stat(log).st_size > (1 << 20):
            os.replace(log, log + ".1")
    except OSError:
        pass
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "shm_manager._daemon", "--group", token, "--runtime-dir", rdir,
           "--dir", st.shm or shm_core.shm_dir()]
    logfd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
    global _lock, _conn
    _lock = threading.Lock()
    old = _conn
    _conn = _Conn()
    if old.sock is not None:
        try:  # the parent keeps using the connection: close only our copy of the descriptor
            os.close(old.sock.detach())
        except OSError:
            pass


def _at_exit() -> None:
    global _closing
    try:
        flush(0.5)
    except Exception:
        pass
    _closing = True  # no daemon is started while the interpreter goes down


os.register_at_fork(after_in_child=_after_fork_in_child)
import atexit  # noqa: E402

atexit.register(_at_exit)
