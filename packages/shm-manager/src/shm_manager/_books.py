"""The cleanup daemon's books: which process holds which count of which segment, and when a count goes back.

Extends the registry of CPython's ``multiprocessing/resource_tracker.py``
(``cache[rtype]``: a set of names, unlinked when the tracker ends) with the
counts of the segments' header refcounts. What changed: besides the names
registered (``R``, ``U``), the daemon keeps, per connection, the counts its
process holds (``H``, ``X``), those a parent gave a fork child (``G``, ``C``)
and those a sender sent a reader (``T``, ``A``, ``D``, ``V``, ``S``), and
gives each back (taking it off the header, unlinking at zero) when its holder
dies, not when the group ends. ``_daemon`` reads the frames and hands each to
``_apply``; a connection's EOF gives its holds back (``_release_holds``), a
watched child's death what it was given (``_child_ended``).

Note [Booked counts]
~~~~~~~~~~~~~~~~~~~~
Invariant: every count the daemon may give back (take off a header, unlinking at zero) is on its books, and it books
only counts that are in the header and not booked yet: a frame announcing a count nobody added, or one booked
already, books nothing, and its sender's end gives nothing back.

How: a count a process holds on its own word (``H``; ``A`` or ``C`` before their ``T`` or ``G``) is booked when the
name carries its pid (its maker tells before making the file), or when the header holds more counts than the books
(holds and given counts): one per process and name at a time. A ``T`` or ``G`` moves the count of a booked ``A`` or
``C`` that came first; otherwise it is booked (or completes a waiting ``A`` or ``C`` not booked) only for a count
beyond the books; a ``G`` only from the child's parent (its ppid and start time while it lives, or is a zombie; once
it is gone, a process started before it), once per child and name.

Not covered: processes add counts in shared memory, so the daemon cannot tell who added one not yet booked (a
message's in-flight count before its reader takes it over, a Pool's kept count): another process's frame may book it,
and its owner then holds it unbooked (its end gives nothing back, its group's end does). Closing that needs every
count booked by the process that adds it, as it adds it.

Note [Counts given at fork]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: the counts a fork child inherits on named segments go back when it dies, even killed before it ran a line:
the parent gives them to the child by pid (``G pid:start:name``, on its own connection, right after the fork), and
the daemon gives back every given count the child did not claim once the child is dead *and* every connection of it
was read to its end.

Why: the parent takes the child's counts before the fork (mp_reductions Note [fork]); a child that told the daemon
itself (``H``) would leave them up for good if it were killed first (a Pool's replacement worker killed at once). The
daemon watches the child (a pidfd). The child claims its counts on its own connection (``C start:name``, its pid from
the socket's credentials): a claim moves a given count to the connection's holds, which go back at its EOF, as any
hold. The two frames come on two sockets, in either order: a claim that finds nothing given yet waits for its ``G``
(a hold meanwhile where Note [Booked counts] books it), which it then absorbs (kept ``_CLAIM_KEEP`` seconds). Claims
the child sent before its death are taken first::

    parent --G pid:start:name--> daemon: given[child][name] += 1, watch pidfd(child)
    child  --C start:name------> daemon: given -> holds[conn]   (or a claim that waits for G)
    child dies: EOF (holds[conn] back) + pidfd (given back, once no connection of it is left)

Note [Counts sent to a reader]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: an in-flight count (one per message naming a named segment, added by its sender before it sends, taken
over by its reader) that the reader never took goes back once the reader says it will take nothing more from that
sender (dead or gone), but for a sender killed in the microseconds between adding it and its ``send``.::

    sender --T reader:name--> daemon: sent[sender, reader][name] += 1    (or matches a take)
    reader --A sender:name--> daemon: sent -> holds[conn]                (or waits for its T)
    reader --S sender-------> daemon: once no connection of the sender is left, sent[sender, reader] back

A sender whose reader says when it has read all it will ever read from it (a Pool's worker: its pool reads every
result a dead worker sent before settling the death) sends the ``T`` in the call adding the count (the frame ready
and the socket drained first: the count, then one ``send``). ``T`` and ``A`` come on two sockets, in either order:
the second matches the first. ``D`` replaces ``A`` where the reader maps the segment already and gives the count back
itself. ``S`` gives back only once every connection of the sender was read to its end (its ``T`` frames all in); a
``T`` to a reader already done with its sender (connected, told and died between two reads of the daemon's) goes back
at once; a failed message's count, by ``V reader:name``. A ``T`` costs a header read and two dictionary updates.
Pids are reused: Note [Reused pids].

Note [Reused pids]
~~~~~~~~~~~~~~~~~~
Invariant: a reader's ``S`` (done with sender pid P) applies only to processes of pid P that started no later than the
clock tick in which the daemon read it; a process of pid P that started after has its ``T`` frames booked as any.

Why: pids are reused (a long program runs many pools; the counter wraps at pid_max), and the daemon kept every reader's
word for good: a new worker that had a dead one's pid had each result's count given back as it sent it, and its
result's segment was unlinked before its pool could read it.

How: ``S`` records when it was read (clock ticks since boot, the clock of a process's start time). A connection whose
process started in a later tick (``_connected``, at accept) is another process: what its predecessor sent and that
reader never took goes back then, and the reader's word is forgotten for the pid. A late connection of the earlier
process (started in that tick or before, or gone by its accept: no start time) still counts as the one meant.

Not covered: a process with a reused pid that started before the reader said so or in the same tick (within a few
milliseconds of a worker's reap and its pool's ``S``), or that is gone before its connection is accepted.
"""

from __future__ import annotations

import os
import selectors
import socket
import stat
import time

import shm_core

from . import _paths

_CLAIM_KEEP = 60.0  # seconds a claim that came before its G waits for it (Note [Counts given at fork])


class Books:
    """The counts one daemon has on its books, and the frames that change them (Note [Booked counts])."""

    def __init__(self, group: str, rdir: str, dfd: int, sel: selectors.BaseSelector):
        self.group, self.rdir, self.dfd = group, rdir, dfd
        self.sel = sel  # the daemon's: watched children's pidfds go on it
        self.uid = os.getuid()
        self.names: set[str] = set()
        self.holds: dict[socket.socket, dict[str, int]] = {}  # counts each client holds
        self.peers: dict[socket.socket, int] = {}  # each client's pid
        # (pid, name) -> the connection of the one count that process holds on its own word (Note [Booked counts])
        self.own: dict[tuple[int, str], socket.socket] = {}
        # (pid, start time) -> counts given; claims ahead of their G, since when: Note [Counts given at fork]. A
        # claim waiting is (its connection, booked: a hold already), Note [Booked counts]
        self.given: dict[tuple[int, int], dict[str, int]] = {}
        self.early: dict[tuple[int, int], tuple[float, dict[str, list[tuple[socket.socket, bool]]]]] = {}
        self.watched: dict[tuple[int, int], int] = {}  # child -> its pidfd
        self.dead: set[tuple[int, int]] = set()  # children seen dead, their given counts not back yet
        # (sender, reader) -> counts sent not taken yet, takes ahead of their T; readers done with a sender:
        # Note [Counts sent to a reader]
        self.sent: dict[tuple[int, int], dict[str, int]] = {}
        # takes ahead of their T, as claims wait (a D's connection is None: the reader gave that count back itself)
        self.taken_early: dict[tuple[int, int], dict[str, list[tuple[socket.socket | None, bool]]]] = {}
        # sender -> {reader done with it: when it said so, clock ticks since boot} (kept: one of a dead sender's
        # connections may be accepted late; forgotten when another process has its pid: Note [Reused pids])
        self.done: dict[int, dict[int, int]] = {}
        self.pattern = _paths.group_pattern(self.uid, group)

    def _apply(self, conn: socket.socket, op: bytes, name: str) -> None:
        """One frame (``op``, ``name``) from ``conn``'s process."""
        if op == b"S":  # Note [Counts sent to a reader]
            sender = _number(name)
            if sender is not None:
                self.done.setdefault(sender, {})[self.peers[conn]] = _paths.now_ticks()
                self._settle_sent(sender)
            return
        peer = None
        if op in (b"T", b"A", b"D", b"V"):  # Note [Counts sent to a reader]
            number, _, name = name.partition(":")
            peer = _number(number)
            if peer is None:
                return
        child = None
        if op in (b"G", b"C"):  # Note [Counts given at fork]
            *numbers, name = name.split(":", 2) if op == b"G" else [str(self.peers[conn]), *name.split(":", 1)]
            if len(numbers) != 2 or None in (pid := _number(numbers[0]), start := _number(numbers[1])):
                return
            child = (pid, start)
        if not self.pattern.fullmatch(name):
            return  # only names of this group, ever (Note [Daemon input])
        if op in b"TV" and peer in self.done.get(self.peers[conn], ()):
            # its reader was done with it first: its message never came, and never will
            if op == b"T" and self._unbooked(name):
                self._decref(name, 1, "a pool worker died before it sent the result that named it")
            return
        if op == b"T":
            self._told(conn, peer, name)
        elif op == b"A":
            self._took(conn, peer, name)
        elif op == b"D":
            key = (peer, self.peers[conn])
            if not _take(self.sent, key, name):  # its T is still on the way: it forgets that count
                self.taken_early.setdefault(key, {}).setdefault(name, []).append((None, True))
        elif op == b"V":
            if _take(self.sent, (self.peers[conn], peer), name):
                self._decref(name, 1, None)
        elif op == b"G":
            self._given(conn, child, name)
        elif op == b"C":
            self._claimed(conn, child, name)
        elif op == b"R":
            self.names.add(name)
        elif op == b"U":
            self.names.discard(name)
        elif op == b"H":
            if self._on_its_word(conn, name):
                self._hold(conn, name, own=True)
        elif op == b"X":
            self._released(conn, name)

    def _hold(self, conn: socket.socket, name: str, own: bool = False) -> None:
        """``conn``'s process holds one more count of ``name``, given back at its EOF (``own``: on its word)."""
        holds = self.holds.setdefault(conn, {})
        holds[name] = holds.get(name, 0) + 1
        if own:
            self.own[self.peers[conn], name] = conn

    def _released(self, conn: socket.socket, name: str) -> None:
        """X: ``conn``'s process gives back one count it holds (none: nothing happens)."""
        holds = self.holds.get(conn, {})
        n = holds.get(name, 0)
        if n > 0:
            holds[name] = n - 1
            if n == 1:
                self._disown(conn, name)
            self._decref(name, 1, None)

    def _disown(self, conn: socket.socket | None, name: str) -> None:
        """What ``conn``'s process held of ``name`` on its word is now a count given to it, or gone."""
        key = (self.peers.get(conn, -1), name)
        if conn is not None and self.own.get(key) is conn:
            del self.own[key]

    def _on_its_word(self, conn: socket.socket, name: str) -> bool:
        """May ``conn``'s process hold a count of ``name`` that no other frame vouches for (Note [Booked counts])?"""
        pid = self.peers[conn]
        if (pid, name) in self.own:
            return False  # one at a time
        maker = _paths.parse(name)
        return maker is not None and maker[3] == pid or self._unbooked(name)

    def _unbooked(self, name: str) -> bool:
        """The header of ``name`` holds more counts than this daemon has on its books (Note [Booked counts])."""
        booked = sum(h.get(name, 0) for h in self.holds.values()) + sum(g.get(name, 0) for g in self.given.values())
        try:
            seg = self._attach(name)
        except ValueError:
            return False
        if seg is None:
            return False
        try:
            return seg.refcount > booked
        finally:
            seg.close()

    def _told(self, conn: socket.socket, reader: int, name: str) -> None:
        """T: ``conn``'s process sent ``reader`` one count of ``name`` (Note [Counts sent to a reader])."""
        key = (self.peers[conn], reader)
        waiting = self.taken_early.get(key)
        taker = _first(waiting, name, booked=True)
        if taker is not None:  # its reader's take came first, booked (or a D: given back by the reader)
            self._disown(taker[0], name)  # now a count it was sent
        elif self._unbooked(name):
            taker = _first(waiting, name, booked=False)
            if taker is not None:  # a take that waited for its T
                self._hold(taker[0], name)
            else:
                counts = self.sent.setdefault(key, {})
                counts[name] = counts.get(name, 0) + 1

    def _took(self, conn: socket.socket, sender: int, name: str) -> None:
        """A: ``conn``'s process takes over the count ``sender`` sent it (Note [Counts sent to a reader])."""
        key = (sender, self.peers[conn])
        if _take(self.sent, key, name):
            self._hold(conn, name)
            return
        booked = self._on_its_word(conn, name)  # its T is still on the way, or never comes
        if booked:
            self._hold(conn, name, own=True)
        self.taken_early.setdefault(key, {}).setdefault(name, []).append((conn, booked))

    def _given(self, conn: socket.socket, child: tuple[int, int], name: str) -> None:
        """G: ``conn``'s process gave its fork child ``child`` one count of ``name`` (Note [Counts given at fork])."""
        if not self._parent_of(self.peers[conn], child) or self.given.get(child, {}).get(name):
            return  # not its child, or given twice (Note [Booked counts])
        waiting = self.early[child][1] if child in self.early else None
        claimant = _first(waiting, name, booked=True)
        if claimant is not None:  # claimed already, booked: that claim was this count
            self._disown(claimant[0], name)
            return
        if not self._unbooked(name):
            return
        claimant = _first(waiting, name, booked=False)
        if claimant is not None:  # a claim that waited for its G
            self._hold(claimant[0], name)
            return
        given = self.given.setdefault(child, {})
        given[name] = given.get(name, 0) + 1
        if child not in self.watched and child not in self.dead:
            self._watch(child)

    def _parent_of(self, pid: int, child: tuple[int, int]) -> bool:
        """``pid`` forked ``child`` (pid, start time): its parent while it lives (a zombie too); once it is gone, a
        process that started before it (Note [Booked counts])."""
        got = _paths.parent_and_start(child[0])
        if got is not None and got[1] == child[1]:
            return got[0] == pid
        born = _paths.start_time(pid)
        return born is not None and born <= child[1] <= _paths.ticks_now()

    def _claimed(self, conn: socket.socket, child: tuple[int, int], name: str) -> None:
        """C: ``child`` (on ``conn``) holds a count its parent gave it: a hold of the connection from now on."""
        given = self.given.get(child, {})
        if given.get(name, 0) > 0:
            given[name] -= 1
            self._hold(conn, name)
            return
        booked = self._on_its_word(conn, name)  # its G is still on the way, or never comes
        if booked:
            self._hold(conn, name, own=True)
        self.early.setdefault(child, (time.monotonic(), {}))[1].setdefault(name, []).append((conn, booked))

    def _settle_sent(self, pid: int) -> None:
        """Give back what ``pid`` sent that its readers, done with it, never took, once no connection of it is
        left unread (Note [Counts sent to a reader])."""
        if pid in self.peers.values():
            return  # its T frames may still be in that socket: settled at its EOF
        for reader in self.done.get(pid, ()):
            self._give_back_sent(pid, reader)

    def _give_back_sent(self, pid: int, reader: int) -> None:
        self.taken_early.pop((pid, reader), None)
        for name, n in self.sent.pop((pid, reader), {}).items():
            self._decref(name, n, "a pool worker died before it sent the result that named it")

    def _connected(self, conn: socket.socket, pid: int) -> None:
        """A new client, process ``pid``. One that started after a reader said it was done with an earlier process of
        that pid is another process: what that reader never took of the earlier one goes back now, and the reader's
        word no longer applies to this pid (Note [Reused pids])."""
        self.peers[conn] = pid
        done = self.done.get(pid)
        start = _paths.start_time(pid) if done else None
        if start is None:  # (gone already: a late connection of the process the readers were done with, most often)
            return
        for reader in [reader for reader, when in done.items() if start > when]:
            del done[reader]
            self._give_back_sent(pid, reader)
        if not done:
            del self.done[pid]

    def _watch(self, child: tuple[int, int]) -> None:
        """Give ``child``'s given counts back when it dies (its pidfd turns readable; a zombie's is)."""
        pid, start = child
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone (ESRCH), or no pidfds (then its counts go when the group ends)
            fd = None
        if fd is not None and _paths.start_time(pid) == start:
            self.watched[child] = fd
            self.sel.register(fd, selectors.EVENT_READ, child)
            return
        if fd is not None:
            os.close(fd)
        if _paths.start_time(pid) != start:  # another process has its pid now: it is dead
            self.dead.add(child)
            self._settle_dead(pid)

    def _child_ended(self, child: tuple[int, int]) -> None:
        fd = self.watched.pop(child)
        self.sel.unregister(fd)
        os.close(fd)
        self.dead.add(child)
        self._settle_dead(child[0])

    def _settle_dead(self, pid: int) -> None:
        """Give back what was given to the dead children of pid ``pid`` once no connection of it is left unread."""
        if pid in self.peers.values():
            return  # its claims may still be in that socket: settled at its EOF
        for child in [c for c in self.dead if c[0] == pid]:
            self.dead.discard(child)
            for name, n in self.given.pop(child, {}).items():
                if n > 0:
                    self._decref(name, n, "a fork child died before it claimed it")

    def _release_holds(self, conn: socket.socket) -> None:
        """A client died holding counts: give them back, unlinking what nobody holds any more; its claims and takes
        that wait unbooked for their G or T are dropped (a G or T that comes is then given back as ever)."""
        for name, n in self.holds.pop(conn, {}).items():
            self._disown(conn, name)
            if n > 0:
                self._decref(name, n, "a process died holding it")
        waiting: list[dict[str, list]] = [got[1] for got in self.early.values()]
        for names in [*waiting, *self.taken_early.values()]:
            for entries in names.values():
                entries[:] = [e for e in entries if e[1] or e[0] is not conn]

    def _attach(self, name: str) -> shm_core.Segment | None:
        """``name`` mapped, when it is a regular file of our uid in our directory, else None; ValueError when the
        file holds no segment (yet)."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.dfd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self.uid:
                return None
            return shm_core.attach_fd(fd, sealed=False)  # a named file (named files cannot be sealed)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _decref(self, name: str, n: int, why: str | None) -> None:
        try:
            seg = self._attach(name)
        except ValueError:  # no segment yet: its maker died making it (the count was told first), no one saw it
            if why:
                os.unlink(name, dir_fd=self.dfd)
                self.names.discard(name)
                _paths.log(self.rdir, self.group, f"{why}; removed {name}, which it died making")
            return
        if seg is None:
            return
        try:
            if seg.decref(n) <= 0:
                os.unlink(name, dir_fd=self.dfd)
                self.names.discard(name)
                if why:
                    _paths.log(self.rdir, self.group, f"{why}; removed {name} ({seg.size:,} bytes)")
        except OSError:
            pass
        finally:
            seg.close()


def _number(text: str) -> int | None:
    """A pid or a start time as a frame writes it (ASCII digits: ``str.isdigit`` takes others ``int`` refuses)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 20 else None


def _first(waiting: dict | None, name: str, booked: bool):
    """The first claim or take of ``name`` waiting in ``waiting`` (name -> entries) that is ``booked`` (or not),
    taken off; or None."""
    entries = waiting.get(name) if waiting else None
    for i, entry in enumerate(entries or ()):
        if entry[1] == booked:
            del entries[i]
            if not entries:
                del waiting[name]
            return entry
    return None


def _take(counts: dict, key: tuple[int, int], name: str) -> bool:
    """Take one count of ``name`` off ``counts[key]`` if it has one (dropping what reaches zero)."""
    have = counts.get(key)
    if not have or not have.get(name):
        return False
    have[name] -= 1
    if not have[name]:
        del have[name]
        if not have:
            del counts[key]
    return True
