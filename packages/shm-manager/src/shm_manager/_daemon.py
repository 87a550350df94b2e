"""The group's cleanup daemon: ``python -m shm_manager._daemon --group G ...``.

Adapts CPython's ``multiprocessing/resource_tracker.py`` (and loky's): EOF on
a client's connection means that client is gone; the daemon ignores SIGINT,
SIGTERM and SIGHUP; messages are small frames; it warns about what it cleaned.
What changed: one daemon per group and segment directory (not per process tree
root), found at ``<runtime dir>/<group>.sock`` (the runtime dir is 0700: no other
user can reach the socket, nor take its name first), started on first need by
any member, and the end of the group is proved with the group lock::

    client A --frames--> +--------+   all connections at EOF
    client B --frames--> | daemon |   + linger (0.5 s) with no newcomer
    client C --frames--> +--------+   + LOCK_EX on the group lock succeeds
                              |
                              v
          unlink registered names + every file of the group, log, exit

The daemon holds no group lock: if it did, a hung daemon would keep its group
"alive" for ``gc`` forever. Instead it waits, after its last client left, until
the lock proves that no member (connected or not: a process that only
attached segments never connects) is left. Killed, it is replaced on the next
register() of any member; killed together with the whole group, the next
program's startup sweep or ``shm-manager gc`` removes what is left.

Note [Daemon input]
~~~~~~~~~~~~~~~~~~~
Invariant: the daemon opens and unlinks only regular files owned by its uid, with names of its own group's pattern
(no ``/``), inside the one directory it was started for (``--dir``), and serves only connections of its uid.

A frame is ``<u32 length><op><name>``: a name, never a path. The daemon acts through a descriptor of its directory,
opens with ``O_NOFOLLOW`` and unlinks with ``unlinkat`` on that descriptor. A connection from another uid is closed
at once; refusals are logged at most once per ``_REFUSAL_INTERVAL``, and the log is capped (``_paths.log``).

The counts the daemon gives back (Note [Booked counts], Note [Counts given at fork], Note [Counts sent to a reader])
are its books: ``_books``.

Start-up: the first process binds and listens in a forked grandchild, reports over a pipe and exits, so the caller's
``wait()`` returns once the address accepts connections and the daemon is nobody's child (no zombie, own session). A
second daemon for the same group finds the socket answering and exits; a socket nobody answers on (its daemon was
killed) is replaced, under an flock of the runtime directory so that two starting daemons do not both replace it.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import selectors
import signal
import socket
import struct
import sys
import time

from . import _gc, _paths
from ._books import _CLAIM_KEEP, Books

_MAX_FRAME = 4 << 10
_REFUSAL_INTERVAL = 10.0


class Daemon(Books):
    def __init__(self, listener: socket.socket, group: str, rdir: str, dfd: int, linger: float):
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        super().__init__(group, rdir, dfd, sel)
        self.listener, self.linger = listener, linger
        self.clients: dict[socket.socket, bytearray] = {}
        self.refused: dict[int, int] = {}  # uid -> connections refused since the last log line
        self.refusals_logged = -_REFUSAL_INTERVAL

    def serve(self) -> None:
        idle_since = time.monotonic()
        while True:
            timeout = None
            if not self.clients:
                wait = idle_since + self.linger - time.monotonic()
                if wait <= 0:
                    if self._finish_if_dead():
                        return
                    wait = 0.1  # members without a connection still live: poll their lock
                timeout = wait
            if self.early:
                timeout = _CLAIM_KEEP if timeout is None else min(timeout, _CLAIM_KEEP)
            for key, _ in self.sel.select(timeout):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.data is not None:  # a watched child ended
                    self._child_ended(key.data)
                elif not self._read(key.fileobj):
                    self._release_holds(key.fileobj)
                    self.sel.unregister(key.fileobj)
                    del self.clients[key.fileobj]
                    pid = self.peers.pop(key.fileobj)
                    key.fileobj.close()
                    self._settle_dead(pid)
                    self._settle_sent(pid)
                    if not self.clients:
                        idle_since = time.monotonic()
            if self.early:
                now = time.monotonic()
                self.early = {child: got for child, got in self.early.items() if now - got[0] < _CLAIM_KEEP}

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.uid:
            conn.close()
            self.refused[uid] = self.refused.get(uid, 0) + 1
            if time.monotonic() - self.refusals_logged >= _REFUSAL_INTERVAL:
                self._log_refusals()
            return
        conn.setblocking(False)
        self.clients[conn] = bytearray()
        self._connected(conn, pid)
        self.sel.register(conn, selectors.EVENT_READ)

    def _log_refusals(self) -> None:
        """One line for every refusal since the last one (Note [Daemon input])."""
        if self.refused:
            who = ", ".join(f"uid {uid} ({n})" for uid, n in sorted(self.refused.items()))
            _paths.log(self.rdir, self.group, f"refused {sum(self.refused.values())} connection(s) of other "
                                              f"users: {who}")
            self.refused.clear()
        self.refusals_logged = time.monotonic()

    def _read(self, conn: socket.socket) -> bool:
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False  # EOF: this client is gone
        buf = self.clients[conn]
        buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack_from("<I", buf)
            if n > _MAX_FRAME or n < 2:
                _paths.log(self.rdir, self.group, "dropped a client that sent a malformed frame")
                return False
            if len(buf) < 4 + n:
                break
            op, name = bytes(buf[4:5]), os.fsdecode(bytes(buf[5:4 + n]))
            del buf[:4 + n]
            self._apply(conn, op, name)
        return True

    def _finish_if_dead(self) -> bool:
        try:
            removed = _gc.end_group(self.group, self.rdir, self.dfd, sorted(self.names))
        except OSError as exc:
            _paths.log(self.rdir, self.group, f"cannot check the group lock: {exc}")
            return False
        if removed is None:
            return False
        self._log_refusals()
        return True


def _listen(rdir: str, group: str) -> socket.socket | None:
    """The group's listening socket in ``rdir``; None when a live daemon has it (see the start-up above)."""
    rfd = os.open(rdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(rfd).st_uid != os.getuid():
            raise PermissionError(errno.EPERM, "runtime directory not owned by this user", rdir)
        addr = _paths.socket_address(rfd, group)
        fcntl.flock(rfd, fcntl.LOCK_EX)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                listener.bind(addr)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.settimeout(5.0)
                    try:
                        probe.connect(addr)
                        listener.close()
                        return None  # the group has its daemon
                    except ConnectionRefusedError:  # left by a killed daemon
                        os.unlink(group + _paths.SOCK_SUFFIX, dir_fd=rfd)
                listener.bind(addr)
            listener.listen(128)
            return listener
        except BaseException:
            listener.close()
            raise
    finally:
        os.close(rfd)  # drops the flock


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m shm_manager._daemon")
    p.add_argument("--group", required=True)
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--linger", type=float, default=None)
    args = p.parse_args(argv)
    if not _paths.GROUP_RE.fullmatch(args.group):
        p.error(f"bad group token {args.group!r}")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.umask(0o077)
    linger = _paths.linger_default() if args.linger is None else args.linger

    r, w = os.pipe()
    if os.fork():  # first process: report whether the grandchild listens, then go
        os.close(w)
        status = os.read(r, 1)
        os._exit(0 if status in (b"L", b"A") else 1)
    os.close(r)
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:
            pass
    try:
        dfd = _gc.open_dir(args.dir)
        listener = _listen(args.runtime_dir, args.group)
    except OSError as exc:
        _paths.log(args.runtime_dir, args.group, f"cannot start the daemon: {exc}")
        os._exit(1)
    if listener is None:
        os.write(w, b"A")
        os._exit(0)
    os.write(w, b"L")
    os.close(w)
    try:
        Daemon(listener, args.group, args.runtime_dir, dfd, linger).serve()
    except Exception as exc:  # pragma: no cover - logged for the user, then the group falls back on gc
        import traceback

        _paths.log(args.runtime_dir, args.group, f"daemon failed: {exc!r}\n{traceback.format_exc()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
