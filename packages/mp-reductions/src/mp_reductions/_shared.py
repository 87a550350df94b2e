"""Arrays in shared memory: making segments, finding them, attaching them.

Every process keeps one table of the segments it has mapped, keyed by what
identifies the memory (the inode of a memfd, the name of a named segment), so a
segment that arrives a hundred times is mapped once, and a same-process round
trip gives back views of the very memory that was sent. The table holds weak
references: a segment goes when its last array goes.

Note [descriptors]
~~~~~~~~~~~~~~~~~~
Invariant: a shared memfd array is never silently sent as a copy, and making or receiving any number of them (20,000
say) does not run a process out of descriptors: each memfd segment of this process, made here or received, keeps its
descriptor in one LRU (``_Table.fd_lru``) of at most ``fd_budget()`` entries (a quarter of RLIMIT_NOFILE, or all of
it but BUDGET_RESERVE when that is more; 16 to BUDGET_MAX); past it older ones close theirs, and sending one whose
descriptor was closed re-opens the very same file from /proc/self/map_files (checked by inode), or raises with the
remedy.

Why: a mapping needs no descriptor, but sending a memfd segment does, and re-opening it from map_files is not allowed
to every user. So before the LRU first closes a live segment's descriptor, the process raises its soft RLIMIT_NOFILE
toward the hard limit, for itself alone (_nofile Note [open-files limit]): the budget is what lets a process forward
the arrays it holds without re-opening them. A descriptor handed out for sending may be closed by the LRU at the next
segment made or received, so our channels send a dup of it (``Outgoing.fd_ref``).

Note [named segments]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a named segment's header refcount is the number of processes that map it plus the messages in flight
naming it; the holder that takes it to zero unlinks the name and tells shm_manager, and the count of a holder that
dies, even by SIGKILL, is given back exactly once.

How: the sender adds the in-flight count before sending; a receiver that already maps the segment gives it back, one
that does not keeps it as its own. Holders tell shm_manager's daemon (hold), and give their count back through it
(release); that includes a fork child, which holds (and tells the daemon it holds) every named segment it inherits.

Not covered: what a crash can still leak (a message lost in flight) is removed when the group ends; a Pool's tasks
keep their counts in the parent until done with, so none is lost with a worker (_message Note [kept counts]).

Note [arenas]
~~~~~~~~~~~~~
Invariant: an arena block is reused only when no process holds a view of it and no message naming it is in flight:
its count, like the recycling word (``_recycle`` Note [views word]), is above zero while anyone can reach it, and the
allocating process takes the block back, once its own view is gone, by one compare-and-swap of 0 to 1.

Small ``empty_shared`` arrays (up to ``ARENA_ITEM_MAX``) are blocks carved out of per-process arenas (segments of
``ARENA_SIZE``, ``ARENA_MARK`` in the header's user word): one mapping and one descriptor serve thousands of arrays.
Blocks have 64-byte heads::

    arena data:  | head(count, size) | data ... | head(count, size) | data ... |  bump -> free
                 ^ block b                     ^ block b'

A process views a block through one ``block_base`` array (counted once when made, given back when it dies; a fork
child's: Note [fork]); every array over the block is a view of it. A sender counts each array handle it sends; its
receiver gives that back once it views the block. Arenas (at most ``MAX_ARENAS``) are held weakly: one lives while
any of its arrays does, and the recycler keeps it mapped ``_recycle.IDLE`` seconds after each allocation, so a
producer that sends and drops arrays one by one goes on carving the same arena, and an idle program leaves nothing
behind.

Not covered: a block named by a message never received, or held by a killed process, is never reused; its arena goes
when every process has unmapped it.
"""

from __future__ import annotations

import collections
import os
import resource
import threading
import weakref
from multiprocessing import util

import numpy as np
import shm_core
import shm_manager  # before our at-fork hook: a fork child gets its own daemon connection first

from . import _nofile, _stats
from ._strategy import get_sharing_strategy

ALIGN = 64
ARENA_MARK = 0x414E4552_41504D41  # "AMPAREN A" in the header's user word: this segment is an arena
BLOCK_HEAD = ALIGN  # a block's count word and size word (Note [arenas])
BUDGET_MAX = 1 << 18  # memfd descriptors kept open at most (Note [descriptors])
BUDGET_RESERVE = 4096  # descriptors left to the rest of the program under a large limit (Note [descriptors])
_HDR = shm_core.HEADER_SIZE
_VIEWS = shm_core.VIEWS_OFFSET  # the views word (_recycle.REFS)


def fd_budget() -> int:
    """How many memfd descriptors this process keeps open (Note [descriptors])."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(BUDGET_MAX, max(soft // 4, soft - BUDGET_RESERVE)))


class _Table:
    """This process's mapped segments, and the LRU of its memfd segments' descriptors."""

    def __init__(self):
        self.lock = threading.Lock()
        self.segments: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.fd_lru: collections.OrderedDict = collections.OrderedDict()  # key -> weakref(Segment)

    def add(self, key, seg: shm_core.Segment) -> None:
        _ensure_exit_hook()
        seg.key = key
        self.segments[key] = seg

    def keep_fd(self, seg: shm_core.Segment) -> None:
        """Remember that ``seg`` holds a descriptor; close the oldest beyond fd_budget() (lock held)."""
        lru = self.fd_lru
        lru[seg.key] = weakref.ref(seg)
        lru.move_to_end(seg.key)
        budget = fd_budget()
        if len(lru) > budget and _nofile.raise_for_budget():  # Note [open-files limit]
            budget = fd_budget()
        while len(lru) > budget:
            _, ref = lru.popitem(last=False)
            old = ref()
            if old is not None:
                old.close_fd()


table = _Table()
# (segment key, block) -> weakref of this process's base array of an arena block (Note [arenas])
_blocks: dict = {}
# (segment id, block, size) of blocks whose view in this process is gone: candidates for the allocator's reuse
dropped_blocks: collections.deque = collections.deque()


# Note [fork]
# ~~~~~~~~~~~
# Invariant: the parent takes a fork child's counts of what it inherits (views words: _recycle Note [views word];
# arena block counts: Note [arenas]; named refcounts: Note [named segments]) *before* the fork, while its own views
# keep every word above zero: no word reads zero while the parent or the child can reach the memory.
#
# Why: the child gives each back when it drops what it inherited, so it must have counted them first, or it would
# uncount its parent's view and the producer would recycle memory the parent still reads; counting in the child after
# the fork would leave a window in which the parent drops its view and the word reads zero::
#
#     parent, before fork:  +1 in each word it would hand down   (the child's counts)
#     child, after fork:    keep them; reconcile with what it holds now (other threads
#                           may run between the snapshot and the fork)
#
# A process gives back what it still holds when it exits (``_release_all``, also in a fork child, which exits without
# a garbage collection): its views word through ``Segment.disown()``, its block counts, its named counts.
#
# Not covered: a process killed by SIGKILL keeps a views word or block count up: that memory is never reused (named
# counts go back through the daemon: shm_manager Note [Counts given at fork]). So does a failed fork (the hooks
# cannot tell), and a subprocess with ``preexec_fn`` (it runs the hooks, then exec drops the views; its named counts
# go back when it ends).
_fork_counted: tuple = ((), (), ())


def _held() -> tuple[set, set, set]:
    """What a fork child would inherit: segments with live views, named segments this process counts, and
    arena blocks it views (as (segment, block))."""
    views, named, blocks = set(), set(), set()
    with table.lock:  # another thread may be adding one
        segments = list(table.segments.items())
    for key, seg in segments:
        if seg.exports > 0:
            views.add(seg)
        if key[0] == "n" and seg.release_hook is not None:
            named.add(seg)
    for (_, block), ref in list(_blocks.items()):
        base = ref()
        if base is not None:
            blocks.add((segment_of(base)[0], block))
    return views, named, blocks


def _count(held: tuple, n: int) -> None:
    views, named, blocks = held
    for seg in views:
        seg.fetch_add(_VIEWS, n)
    for seg in named:
        if seg.fetch_add(shm_core.REFCOUNT_OFFSET, n) + n == 0:
            _unlink_named(seg)  # its last other holder let go while the child was being made
    for seg, block in blocks:
        seg.fetch_add(_HDR + block, n)


_fork_children: frozenset = frozenset()  # the forking thread's children before the fork


def _before_fork() -> None:
    global _fork_counted, _fork_children
    _privatize_own()  # (Note [own arrays]: what the child must get copy-on-write counts nothing)
    _fork_counted = _held()
    _count(_fork_counted, 1)
    _fork_children = _thread_children() if _fork_counted[1] else frozenset()


def _after_fork_in_parent() -> None:
    global _fork_counted
    named, _fork_counted = _fork_counted[1], ((), (), ())  # the counts are the child's
    if named:  # given to the child by pid: the daemon takes them back if it dies before it claims them
        new = _thread_children() - _fork_children
        if len(new) == 1:
            (pid,) = new
            start = shm_manager.start_time(pid)
            if start is not None:
                shm_manager.give(pid, start, [(seg.name, seg.dir) for seg in named])


def _thread_children() -> frozenset:
    """The pids of the children the calling thread forked (Linux's /proc/thread-self/children), or none."""
    try:
        with open("/proc/thread-self/children") as f:
            return frozenset(map(int, f.read().split()))
    except (OSError, ValueError):
        return frozenset()


def _after_fork_in_child():
    global _fork_counted
    # Same segments, fresh lock; the parent's arenas must not be carved twice (_arrays makes the child a fresh
    # allocator, and the blocks dropped here are the parent's to reuse); the counts taken before the fork are this
    # child's (Note [fork]).
    table.lock = threading.Lock()
    dropped_blocks.clear()
    counted, _fork_counted = _fork_counted, ((), (), ())
    now = _held()
    gone = tuple(c - h for c, h in zip(counted, now, strict=True))  # dropped by another thread before the fork
    made = tuple(h - c for c, h in zip(counted, now, strict=True))  # made by another thread before the fork
    for seg in counted[1]:
        shm_manager.claim(seg.name, seg.dir)  # the count the parent took, and gave us (Note [Counts given at fork])
    _count((gone[0], (), gone[2]), -1)
    for seg in gone[1]:
        _release_named(seg)
    _count(made, 1)
    for seg in made[1]:
        shm_manager.hold(seg.name, seg.dir)  # the daemon gives the child's count back if it is killed


def _release_all() -> None:
    """At process exit: give back this process's counts (a fork child exits without a garbage collection,
    Note [fork])."""
    global _blocks
    blocks, _blocks = _blocks, {}  # _block_gone gives back only what is still in _blocks
    for (_, block), ref in blocks.items():
        base = ref()
        if base is not None:
            segment_of(base)[0].fetch_add(_HDR + block, -1)
    for key, seg in list(table.segments.items()):
        seg.disown()
        if key[0] == "n":
            hook, seg.release_hook = seg.release_hook, None
            if hook is not None:
                hook(seg)


_exit_hook_pid = None


def _ensure_exit_hook(again: bool = False) -> None:
    global _exit_hook_pid
    # again: multiprocessing clears the finalizers of a new child before running it
    if again or _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        # after every queue's feeder has flushed (their joins run at -5): a stdlib Queue pickles, and so counts, a
        # named array in flight only then
        util.Finalize(None, _release_all, exitpriority=-10)


# ---------------------------------------------------------------- named segments
def _release_named(seg: shm_core.Segment) -> None:
    if not shm_manager.release(seg.name, seg.dir):  # (else the daemon takes the count back, and unlinks at zero)
        give_back_named(seg)


def _unlink_named(seg: shm_core.Segment) -> None:
    try:
        seg.unlink()
        shm_manager.unregister(seg.name)
    except FileNotFoundError:
        pass


def give_back_named(seg: shm_core.Segment) -> None:
    """Give back one count of the named segment ``seg`` that no daemon holds for this process (a message's
    in-flight count that its sender kept: _message Note [kept counts]); the last one unlinks it."""
    if seg.decref() == 0:
        _unlink_named(seg)


def adopt_named(seg: shm_core.Segment, sender: int | None = None, count=None) -> shm_core.Segment:
    """This process holds one count of ``seg`` (the one ``sender`` told the daemon of, _message Note [results
    told], or one it adds now: ``count``, see shm_manager.hold); the daemon gives it back if we die."""
    if sender is None:
        shm_manager.hold(seg.name, seg.dir, count)
    else:
        shm_manager.take_from(sender, seg.name, seg.dir)
    seg.release_hook = _release_named
    table.add(("n", seg.name), seg)
    return seg


# ---------------------------------------------------------------------- creating
def fd_key(fd: int) -> tuple:
    return ("f", *shm_core.file_id(fd))


def create_segment(size: int, strategy: str | None = None, name: str | None = None) -> shm_core.Segment:
    """A fresh segment of ``size`` data bytes under the current (or given) strategy (file_system: ``name``, from
    shm_manager.new_name(), or a new one); SharedMemoryFullError where it does not fit (_recycle.new_segment
    gives back the segments kept for reuse first)."""
    if (strategy or get_sharing_strategy()) == "file_system":
        # The daemon hears of the name and of our count before the file exists: killed anywhere from here on, its
        # give-back removes a segment no one else has seen (in the other order, the count or the file would stay).
        # Heard means in its socket: a busy daemon (the counts given at a fork) leaves frames in ours for a while,
        # and a process killed then takes them with it.
        name = name or shm_manager.new_name()
        shm_manager.register(name)
        shm_manager.hold(name)
        shm_manager.flush()
        try:
            seg = shm_core.create(size, name=name)
        except BaseException:
            shm_manager.release(name)
            shm_manager.unregister(name)
            raise
        seg.release_hook = _release_named
        with table.lock:
            table.add(("n", seg.name), seg)
        seg.incref()
        _stats.counts[_stats.SEGMENTS_MADE] += 1
        return seg
    seg = shm_core.create_anonymous(size)
    _stats.counts[_stats.SEGMENTS_MADE] += 1
    with table.lock:
        table.add(fd_key(seg.fd), seg)
        table.keep_fd(seg)
    return seg


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
util.register_after_fork(table, lambda table: _ensure_exit_hook(again=True))


def aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _block_gone(seg: shm_core.Segment, block: int, size: int, key, ref) -> None:
    if _blocks.get(key) is not ref:
        return  # given back at exit (_release_all)
    del _blocks[key]
    seg.fetch_add(_HDR + block, -1)
    dropped_blocks.append((seg.id, block, size))  # taken up by the allocator (_arrays), under its lock


def block_base(seg: shm_core.Segment, block: int, size: int, *, counted: bool) -> np.ndarray:
    """This process's base array over an arena block's data (``counted``: the caller counted it)."""
    key = (seg.key, block)
    ref = _blocks.get(key)
    base = ref() if ref is not None else None
    if base is None:
        lo = block + BLOCK_HEAD
        base = np.frombuffer(memoryview(seg)[lo:lo + size], np.uint8)
        if not counted:
            seg.fetch_add(_HDR + block, 1)
        ref = weakref.ref(base, lambda r, key=key: _block_gone(seg, block, size, key, r))
        _blocks[key] = ref
    return base


def is_arena(seg: shm_core.Segment) -> bool:
    return seg.load(shm_core.USER_OFFSET) == ARENA_MARK


def block_view(seg: shm_core.Segment, block) -> np.ndarray:
    """This process's base array over block ``block`` of the arena ``seg``, named by a handle (untrusted)."""
    if not is_arena(seg):
        raise shm_core.SegmentError("array handle names an arena block of a segment that is not an arena "
                                    "(forged or corrupted handle)")
    if type(block) is not int or block < 0 or block % ALIGN or block + BLOCK_HEAD > seg.size:
        raise shm_core.SegmentError(f"array handle names arena block {block!r}, not a block start of a "
                                    f"{seg.size}-byte arena (forged or corrupted handle)")
    size = seg.load(_HDR + block + 8)
    if not 0 < size <= seg.size - block - BLOCK_HEAD or size % ALIGN:
        raise shm_core.SegmentError(f"arena block {block} claims {size} bytes, past its {seg.size}-byte arena "
                                    "(forged or corrupted handle)")
    return block_base(seg, block, size, counted=False)


# ------------------------------------------------------------------------ finding
#: data address of each numpy allocation the shared handler placed in a segment -> (bytes, this process's view of
#: the segment, its kind: BORN_SHARED, BORN_PRIVATE or PRIVATIZED): filled by _alloc (Note [shared allocation]); the
#: C handler looks up numpy's frees here
owned: dict[int, tuple[int, memoryview, int]] = {}
BORN_SHARED, BORN_PRIVATE, PRIVATIZED = 0, 1, 2


# Note [own arrays]
# ~~~~~~~~~~~~~~~~~
# Invariant: an array this process received as a copy (of an unshared array, for a message, a launch or a transport)
# or as a moved result (_alloc Note [moving results]) is its own, as from the stdlib's unpickling: ``segment_of``
# sees neither it nor its views, so sending it on sends a copy, and a fork child gets it copy-on-write. Only memory
# shared on purpose (empty_shared, share_memory, shared_allocation, and what arrives from those) travels as a handle.
#
# Why: such an array is a view of a segment no other process writes, but a handle to it would let the next receiver
# write into it (a Pool result handed to a later task came back changed).
#
# How: the receiver's rebuild (``own``) records the buffer export at the root of the array's bases (a memoryview of
# the segment made for that array or block: numpy collapses chains of bases, so no marker array could stay between),
# where ``segment_of`` stops. Before a fork (``_before_fork``, ahead of Note [fork]'s counts) each segment under a
# live own export moves into private memory at the same address and leaves the table (Note [privatized segments]; a
# named one gives its count back first, through the file, the views word keeping it from reuse): the child inherits
# it copy-on-write and counts nothing.
#
# Not covered, shared with a fork child: an own array in an arena block (a lowered inline threshold: the arena may
# hold shared blocks too), one whose copy found no memory.
_own: dict[int, weakref.ref] = {}  # id -> the root exports of own arrays alive in this process


def own(arr: np.ndarray) -> np.ndarray:
    """``arr`` (a view of a received segment) as this process's own array (Note [own arrays])."""
    root = arr
    while isinstance(root, np.ndarray):
        root = root.base
    if not isinstance(root, memoryview):  # (never: every rebuild views a memoryview) a private copy is never wrong
        return arr.copy(order="K")
    key = id(root)
    _own[key] = weakref.ref(root, lambda _, key=key: _own.pop(key, None))  # (called before the id is free)
    return arr


def _privatize_own() -> None:
    """Before a fork: the segments under live own arrays into private memory (Note [own arrays])."""
    for ref in list(_own.values()):
        view = ref()
        seg = None if view is None else view.obj
        if not isinstance(seg, shm_core.Segment) or seg.closed or getattr(seg, "privatized", False) or is_arena(seg):
            continue
        if seg.name:  # its count goes back through the file while it is mapped here (the views word still keeps it)
            hook, seg.release_hook = seg.release_hook, None
            if hook is not None:
                hook(seg)
        # its own arrays stay recorded (still no handle to send); with no memory for the copy, the child shares
        # it, uncounted, as its view keeps it
        privatize(seg)


def segment_of(arr: np.ndarray, born: int = BORN_SHARED) -> tuple[shm_core.Segment, int] | None:
    """The segment ``arr`` views (or, numpy's own data, lies in) and the byte offset of its first element, or None
    (also for this process's own arrays: Note [own arrays]). ``born``: the kind of handler allocation that counts
    (a BORN_PRIVATE one is a plain array's memory except to a message that moves it, _alloc Note [moving
    results])."""
    base = owner = arr
    while isinstance(base, np.ndarray):
        owner, base = base, base.base
    if isinstance(base, memoryview):
        if _own and id(base) in _own:  # Note [own arrays]
            return None
        base = base.obj
    if isinstance(base, shm_core.Segment):
        return base, shm_core.address(arr) - base.address - _HDR
    if base is None and owned:  # data numpy allocated: the shared handler's? (any dtype: no buffer export)
        entry = owned.get(owner.__array_interface__["data"][0])
        if entry is not None and entry[2] == born:
            seg = entry[1].obj
            return seg, arr.__array_interface__["data"][0] - seg.address - _HDR
    return None


def block_of(arr: np.ndarray, seg: shm_core.Segment) -> int | None:
    """The arena block ``arr`` lies in (None: ``seg`` is not an arena)."""
    if not is_arena(seg):
        return None
    base = arr
    while not isinstance(base.base, memoryview):
        base = base.base
    return shm_core.address(base) - seg.address - _HDR - BLOCK_HEAD


def is_shared(arr: object) -> bool:
    """True when ``arr`` is a view of shared memory (sending it sends no copy)."""
    return isinstance(arr, np.ndarray) and segment_of(arr) is not None


# ---------------------------------------------------------------------- leaving the table
# Note [privatized segments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Invariant: no thread finds a privatized segment (Note [own arrays]; _alloc Note [private at fork]) in the table:
# the segment leaves the table in the same step as its mapping goes private, under the table's lock, which every
# lookup (_attach) holds.
#
# Why: privatizing gives the file's views word back (_recycle Note [views word]), so the sender may reuse the segment
# for its next message at once. A receiving thread that found the old object in the table between the privatizing and
# its removal viewed the private copy, the old contents, as the new message's: the soak (file_system, fork) got Pool
# results holding another task's values, in 18 of 60 runs of 30 s with a kill every 0.05-0.3 s (0 of 39 after).
#
# Not covered: a thread that found the segment before it was privatized and views it after sees the private copy,
# which holds its message's data (the message's count kept the sender from writing), but gives that count back to the
# copy: the file's word stays up, and its sender does not reuse it (_recycle Note [idle segments]).
def privatize(seg: shm_core.Segment) -> bool:
    """Move ``seg``'s mapping into private memory at the same address (``Mapping.privatize``: the file's views word
    given back) and ``seg`` out of the table, its descriptor closed, as one step under the table's lock; False (and
    nothing changed) where there is no memory for the copy. Note [privatized segments]."""
    with table.lock:
        try:
            seg.privatize()
        except OSError:
            return False
        seg.privatized = True
        key = getattr(seg, "key", None)
        if table.segments.get(key) is seg:
            del table.segments[key]
        table.fd_lru.pop(key, None)
        seg.close_fd()
    return True


def release_fd(seg: shm_core.Segment) -> None:
    """Close ``seg``'s descriptor now (the mapping stays); sending it later re-opens it."""
    with table.lock:
        table.fd_lru.pop(getattr(seg, "key", None), None)
        seg.close_fd()
