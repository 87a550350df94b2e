"""The group's cleanup daemon: ``python -m shm_manager._daemon --group G ...``.

Adapts CPython's ``multiprocessing/resource_tracker.py`` (and loky's): EOF on
a client's connection means that client is gone; the daemon ignores SIGINT,
SIGTERM and SIGHUP; messages are small frames; it warns about what it cleaned.
What changed: one daemon per group (not per process tree root), found at an
abstract AF_UNIX address derived from uid and group, started on first need by
any member, and the end of the group is proved with the group lock::

    client A --R/U frames--> +--------+   all connections at EOF
    client B --R/U frames--> | daemon |   + linger (0.5 s) with no newcomer
    client C --R/U frames--> +--------+   + LOCK_EX on the group lock succeeds
                                  |
                                  v
              unlink registered names + every file of the group, log, exit

The daemon holds no group lock: if it did, a hung daemon would keep its group
"alive" for ``gc`` forever. Instead it waits, after its last client left, until
the lock proves that no member (connected or not: a process that only
attached segments never connects) is left. Killed, it is replaced on the next
register() of any member; killed together with the whole group, the next
program's startup sweep or ``shm-manager gc`` removes what is left.

Start-up: the first process binds and listens in a forked grandchild, reports
over a pipe and exits, so the caller's ``wait()`` returns once the address
accepts connections and the daemon is nobody's child (no zombie, own session).
A second daemon for the same group finds the address taken and exits.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import struct
import sys
import time

import shm_core

from . import _gc, _paths

_MAX_FRAME = 16 << 10


def _log(group: str, msg: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    try:
        sys.stderr.write(f"{stamp} shm-manager[{os.getpid()}] WARNING group {group}: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Daemon:
    def __init__(self, listener: socket.socket, group: str, rdir: str, shm: str, linger: float):
        self.listener, self.group, self.rdir, self.linger = listener, group, rdir, linger
        self.uid = os.getuid()
        self.dirs = {shm}
        self.names: set[tuple[str, str]] = set()
        self.clients: dict[socket.socket, bytearray] = {}
        self.holds: dict[socket.socket, dict[tuple[str, str], int]] = {}  # counts each client holds
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.pattern = _paths.group_pattern(self.uid, group)

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
            for key, _ in self.sel.select(timeout):
                if key.fileobj is self.listener:
                    self._accept()
                elif not self._read(key.fileobj):
                    self._release_holds(key.fileobj)
                    self.sel.unregister(key.fileobj)
                    del self.clients[key.fileobj]
                    key.fileobj.close()
                    if not self.clients:
                        idle_since = time.monotonic()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.uid:
            _log(self.group, f"refused a connection from uid {uid}")
            conn.close()
            return
        conn.setblocking(False)
        self.clients[conn] = bytearray()
        self.sel.register(conn, selectors.EVENT_READ)

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
                _log(self.group, "dropped a client that sent a malformed frame")
                return False
            if len(buf) < 4 + n:
                break
            payload = bytes(buf[4:4 + n])
            del buf[:4 + n]
            op, rest = payload[:1], payload[1:]
            d, sep, name = rest.partition(b"\0")
            d, name = os.fsdecode(d), os.fsdecode(name)
            if not sep or "/" in name or not os.path.isabs(d) or not self.pattern.fullmatch(name):
                continue  # only names of this group, ever
            if op == b"R":
                self.names.add((d, name))
                self.dirs.add(d)
            elif op == b"U":
                self.names.discard((d, name))
            elif op == b"H":
                holds = self.holds.setdefault(conn, {})
                holds[(d, name)] = holds.get((d, name), 0) + 1
            elif op == b"X":
                holds = self.holds.setdefault(conn, {})
                if holds.get((d, name), 0) > 0:
                    holds[(d, name)] -= 1
                    self._decref(d, name, 1, None)
        return True

    def _release_holds(self, conn: socket.socket) -> None:
        """A client died holding counts: give them back, unlinking what nobody holds any more."""
        for (d, name), n in self.holds.pop(conn, {}).items():
            if n > 0:
                self._decref(d, name, n, "a process died holding it")

    def _decref(self, d: str, name: str, n: int, why: str | None) -> None:
        try:
            seg = shm_core.attach(name, d)
        except (OSError, ValueError):
            return
        try:
            if seg.decref(n) <= 0:
                shm_core.unlink(name, d)
                self.names.discard((d, name))
                if why:
                    _log(self.group, f"{why}; removed {name} ({seg.size:,} bytes)")
        except OSError:
            pass
        finally:
            seg.close()

    def _finish_if_dead(self) -> bool:
        try:
            fd = _paths.take_if_dead(self.rdir, self.group)
        except FileNotFoundError:
            fd = -1  # somebody proved the group dead and cleaned up already
        except OSError as exc:
            _log(self.group, f"cannot check the group lock: {exc}")
            return False
        if fd is None:
            return False
        try:
            removed = _gc.remove_group(self.group, sorted(self.dirs), sorted(self.names))
        finally:
            if fd >= 0:
                _paths.release_dead(fd, self.rdir, self.group)
        if removed:
            total = sum(size for _, size in removed)
            listed = ", ".join(path for path, _ in removed)
            _log(self.group, f"all processes of the group ended; removed {len(removed)} leaked segment(s), "
                             f"{total:,} bytes: {listed}")
        return True


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
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_paths.socket_address(os.getuid(), args.group))
    except OSError:  # EADDRINUSE: the group has its daemon
        os.write(w, b"A")
        os._exit(0)
    listener.listen(128)
    os.write(w, b"L")
    os.close(w)
    try:
        Daemon(listener, args.group, args.runtime_dir, args.dir, linger).serve()
    except Exception as exc:  # pragma: no cover - logged for the user, then the group falls back on gc
        import traceback

        _log(args.group, f"daemon failed: {exc!r}\n{traceback.format_exc()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
