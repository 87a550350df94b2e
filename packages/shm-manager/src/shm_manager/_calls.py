"""What a process tells its group's daemons: ``register`` / ``unregister`` / ``hold``, and the counts it gives a
fork child or sends a reader.

Adapts the calls of CPython's ``multiprocessing/resource_tracker.py``
(``register``, ``unregister``: a small frame each, no reply). What changed:
besides names, a process tells the daemon of the header counts it holds,
gives its fork children and sends its readers, which the daemon gives back
when the holder dies (``_books``); each call is fire-and-forget and never
raises (``send_to`` and ``take_back`` say whether a daemon was told). The
connections are ``_client``'s, and so are the calls on all of them
(``release``, ``done_with``): ``_client._lock`` is made again in a fork
child, so it is read through the module, never imported by name.

Frame: ``<u32 length><op><name>``, op ``R`` (register) or ``U``, ``H`` (this
process holds one count of the segment's refcount) or ``X`` (the daemon takes
one count back for it: unlinking at zero); and for the counts a fork child
inherits (Note [Counts given at fork] in _books.py), ``G`` with
``<pid>:<start time>:<name>`` (the parent gave that child one count) and ``C``
with ``<start time>:<name>`` (the child claims one count its parent gave it); for the in-flight counts of a
message whose reader says when it is done with its sender (Note [Counts sent to a reader] in _books.py), ``T``
with ``<reader pid>:<name>`` (this process sent it one count), ``V`` (takes one back, unsent), ``A`` with
``<sender pid>:<name>`` (this process takes over one count that sender sent it), ``D`` (it gives that count back
itself) and ``S`` with ``<sender pid>`` (this process will take nothing more from it).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import TYPE_CHECKING

from . import _client, _group
from ._client import _conn, _connect, _drain, _frame, _my_start, _send_pending, _tell, _token

if TYPE_CHECKING:
    from collections.abc import Callable

_BATCH = 4096  # bytes of frames that need not go at once (drop_from) sent together: one read of the daemon's


def register(name: str, dir: str | os.PathLike | None = None) -> None:
    """Tell the group's daemon about a named segment (fire-and-forget; never raises)."""
    try:
        token = _group.member(dir, _token(name))[0]
        with _client._lock:
            c = _conn(dir, token)
            c.names.add(name)
            _tell(c, b"R", name)
    except Exception:
        pass


def unregister(name: str, dir: str | os.PathLike | None = None) -> None:
    """Tell the daemon a segment was unlinked (fire-and-forget; never raises)."""
    try:
        with _client._lock:
            c = _conn(dir, _token(name))
            c.names.discard(name)
            _tell(c, b"U", name, connect=bool(c.names))
    except Exception:
        pass


def hold(name: str, dir: str | os.PathLike | None = None, count: Callable[[], object] | None = None) -> None:
    """This process now holds one count of the segment's header refcount (fire-and-forget).

    Should this process die holding it, the daemon gives the count back (and
    unlinks the segment when that was the last): a SIGKILLed consumer does not
    pin a segment until its whole group ends. The segment may be of another
    group (Note [Holds across groups] in _group.py). ``count``: the caller's
    increment of the header, for a count it adds now: called once, whatever
    happens, right before the frame's send with this process connected and
    its socket drained first (as :func:`send_to`), so that a process killed
    in between is a matter of microseconds, not of a first connection.
    """
    try:
        token = _group.member(dir, _token(name))[0]
        with _client._lock:
            c = _conn(dir, token)
            if count is None:
                c.holds[name] = c.holds.get(name, 0) + 1
                _tell(c, b"H", name)
                return
            if c.sock is None:
                _connect(c)
            if c.sock is not None:
                _send_pending(c, 1.0)
            with _signals_held():
                add = count
                count = None
                add()
                c.holds[name] = c.holds.get(name, 0) + 1
                _tell(c, b"H", name)
    except Exception:
        pass
    finally:
        if count is not None:  # (failed before it was added: the count is this process's all the same)
            count()


def give(pid: int, start: int, names: list[tuple[str, str | os.PathLike | None]]) -> None:
    """The parent of a fork child ``pid`` (started at ``start``, clock ticks since boot) counted one refcount of
    each named segment of ``names`` ((name, dir) pairs) for it: tell the daemons, which give those counts back if
    the child dies before it claims them (Note [Counts given at fork] in _books.py). Fire-and-forget."""
    try:
        with _client._lock:
            for name, dir in names:
                c = _conn(dir, _group.member(dir, _token(name))[0])
                if c.sock is None:
                    _connect(c)
                if c.sock is not None:
                    c.pending += _frame(b"G", f"{pid}:{start}:{name}")
                    _drain(c)
    except Exception:
        pass


def send_to(reader: int, name: str, dir: str | os.PathLike | None, count: Callable[[], object]) -> bool:
    """Add one in-flight count of ``name`` for a message to process ``reader`` (``count()``, the caller's increment
    of the header) and tell the daemon, which gives it back if ``reader``, done with this process
    (:func:`done_with`), never took it over (:func:`take_from`): Note [Counts sent to a reader] in _books.py. The
    count is added right before the frame's ``send``, with this process's socket drained first (waiting up to a
    second for room, as :func:`release` does), so that a process killed in between is a matter of microseconds;
    send the message only after. False: no daemon can be told, and nothing was counted."""
    return _tell_peer(b"T", reader, name, dir, count)


def take_back(reader: int, name: str, dir: str | os.PathLike | None = None) -> bool:
    """Give back, through the daemon, a count added with :func:`send_to` whose message was not sent. False: no
    daemon was told (one gone forgot what it was told: the caller takes the count off itself)."""
    return _tell_peer(b"V", reader, name, dir)


def _tell_peer(op: bytes, peer: int, name: str, dir, count: Callable[[], object] | None = None) -> bool:
    try:
        with _client._lock:
            c = _conn(dir, _group.member(dir, _token(name))[0])
            if c.sock is None:
                _connect(c)
            frame = _frame(op, f"{peer}:{name}")
            if c.sock is None or not _send_pending(c, 1.0):
                if count is None and c.sock is not None:  # (a take-back may wait in the buffer)
                    c.pending += frame
                    return True
                return False
            with _signals_held():
                if count is not None:
                    count()
                c.pending += frame
                _drain(c)
            return c.sock is not None
    except Exception:
        return False


# A count added and the frame that tells it are sent with the signals a program is ended by held (SIGKILL cannot be):
# a Pool's terminate (SIGTERM), Ctrl-C or a hangup arriving between the two would leave a count no daemon knows of,
# until the group ends (and SIGINT's KeyboardInterrupt raised there, one this process keeps). Held, they come after.
# Held in this thread only: where another thread takes the signal (its default action, or Python's handler run in the
# main thread) it is as before, a matter of microseconds.
_ENDING = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@contextlib.contextmanager
def _signals_held():
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def take_from(sender: int, name: str, dir: str | os.PathLike | None = None) -> None:
    """This process holds the in-flight count that ``sender`` told with :func:`send_to`; as :func:`hold`, but no
    new count (Note [Counts sent to a reader] in _books.py). Unconnected, the hold goes as ``H`` when connected:
    a new daemon knows of no count sent."""
    _hold_given(name, dir, _frame(b"A", f"{sender}:{name}"), keep_claim=False)


def drop_from(sender: int, name: str, dir: str | os.PathLike | None = None) -> None:
    """As :func:`take_from`, for a reader that maps the segment already and gives the count back itself: the
    daemon only forgets it (Note [Counts sent to a reader] in _books.py). Fire-and-forget, and sent with the next
    frames (by :func:`done_with` at the latest): it only has to come before that."""
    try:
        with _client._lock:
            c = _conn(dir, _group.member(dir, _token(name))[0])
            if c.sock is not None:
                c.pending += _frame(b"D", f"{sender}:{name}")
                if len(c.pending) >= _BATCH:
                    _drain(c)
    except Exception:
        pass


def claim(name: str, dir: str | os.PathLike | None = None) -> None:
    """In a fork child: this process holds the count of the segment its parent took for it before the fork (and
    told the daemon of with :func:`give`); as :func:`hold`, but no new count (Note [Counts given at fork])."""
    _hold_given(name, dir, _frame(b"C", f"{_my_start()}:{name}"), keep_claim=True)


def _hold_given(name: str, dir, frame: bytes, keep_claim: bool) -> None:
    """This process holds a count another process added (claim, take_from), told by ``frame``; unconnected, one
    to ``keep_claim`` is kept to be sent as ``C`` once connected. Fire-and-forget."""
    try:
        token = _group.member(dir, _token(name))[0]
        with _client._lock:
            c = _conn(dir, token)
            c.holds[name] = c.holds.get(name, 0) + 1
            if c.sock is None:
                if keep_claim:
                    c.claims[name] = c.claims.get(name, 0) + 1
                _connect(c)
            else:
                c.pending += frame
            _drain(c)
    except Exception:
        pass
