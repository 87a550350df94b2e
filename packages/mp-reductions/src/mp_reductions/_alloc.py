"""Arrays born in shared memory: numpy's own allocations placed in recycled segments (NEP 49).

numpy lets an extension choose where array data lives: a data-memory handler,
chosen per context (a ``contextvars`` variable: per thread, per asyncio task).
shm_core's handler (C, ``shm_core.shared_handler``) asks this module for a
segment for every allocation of ``THRESHOLD`` bytes or more and hands smaller
ones to numpy's default handler. An array whose data lies in a segment can
travel as a handle, with no copy, so a Pool worker's fresh result is never
copied into a message segment.

Two kinds of allocation (``_shared.owned`` says which):

- born shared (``shared_allocation()``, ``set_shared_allocation(True)``): the
  user asked for shared memory. Such an array is shared like an
  ``empty_shared`` one: it travels as a handle on every channel, and a fork
  child shares it with its parent (writes seen both ways).
- born private (Pool and executor workers, ``set_shared_allocation(True,
  private=True)``): the user asked for nothing, so the array keeps a plain
  numpy array's semantics. Sent, it is copied as a plain array is (``segment_of``
  does not see it), unless the message *moves* it (Note [moving results]); a
  fork child gets it copy-on-write (Note [private at fork]).

Where it is off: under the ``file_system`` strategy (``_take`` declines and
numpy allocates as usual): a handler segment is an anonymous memfd, which
only arraymp's own channels carry, whereas ``file_system`` is the strategy for
transports and groups we do not own (stdlib queues, Manager proxies, mp-dask
across shm-manager groups); a named segment per allocation would cost a daemon
round trip on every numpy allocation and could outlive its array in another
group. Also off while shared memory is full or out of descriptors (numpy's
memory instead: never an allocation that fails where numpy's would not), and
for allocations made by the policy itself.

Note [shared allocation]
~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: a handler segment is a recycling-pool segment (_recycle Note [recycling]): reused only once its views word
reads zero, and pooled only by the process that made it. numpy's free is this process's last view going, so a
receiver's view or a message in flight keeps the segment out of reuse as for a copy's::

    numpy allocates n >= THRESHOLD  ->  _take: lend(n) a free pooled segment (zeroed for calloc) or a new one;
                                        memoryview(seg) kept in _shared.owned: this process's view (word += 1)
    sent, received, viewed           ->  counted in the same word, as for any shared array
    numpy frees the data             ->  _give: view released (word -= 1), segment given back to the pool,
                                        taken again only once the word reads zero (no message, no view left)

numpy's free may come in any thread, even from a garbage collection under the pool's lock: ``_give`` takes no lock
(``_recycle.give_back`` queues the segment; the next take or the reaper, which runs while any segment is lent, pools
it). A free at interpreter shutdown leaves the segment mapped (the C handler holds ``owned`` for good): at exit, a
memfd has no name to leak.

Fork (_shared Note [fork]): a child inherits the arrays, ``owned`` and the mappings, the parent having counted the
child's views before the fork (the views in ``owned`` are buffer exports). The child's free gives that count back and
drops the segment, never pools it (``_recycle._pool_returned``): a child never hands its parent's memory to a new
array.

Note [private at fork]
~~~~~~~~~~~~~~~~~~~~~~
Invariant: a fork child gets every live born-private array copy-on-write, as numpy's own memory: a helper that
doubles its copy does not double the parent's.

How: before every fork (an at-fork hook, which runs before _shared's: it was registered after it), each live
born-private allocation is *privatized*: its mapping is replaced, at the same address, by private anonymous memory
holding a copy (``Mapping.privatize``: one memcpy and an mremap), the file's views word is given back, the segment
leaves the table in the same step (_shared Note [privatized segments]) and its descriptor is closed. From then on it
is ordinary process memory, in the parent and (copy-on-write) in the child: kind PRIVATIZED, never moved, never
pooled; numpy's free unmaps it.

Not covered: a write made by another thread of the parent between the copy and the mremap is lost (a fork with
threads running is unsafe in any case). Where the copy finds no memory the allocation stays shared with the child.

Note [moving results]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a born-private array goes as a handle with no copy only when it is moved: the sender holds no other
reference to it, so nothing in the sender can write it or read it afterwards (results are snapshots, and the caller's
writes never reach the worker).

How: a Pool worker asks ``moves(result)`` before pickling a task's result. It walks the result (lists, tuples and
dicts, exactly those types, and each array's chain of bases) counting how many references each object gets from
within the walk, and compares that with its reference count, calibrated on a probe object held the same way (so no
interpreter's own counting is assumed). An object referenced from elsewhere (a global, a cache, a view kept, a
container the worker keeps), and everything reachable from it, is held elsewhere; an array moves when it, every array
on its chain of bases and every container above it are not, and its owner is a born-private allocation.
``Outgoing.moves`` carries the ids to ``reduce_ndarray``. After the send the worker drops the result; numpy's free
gives the segment back to the pool, reused only once the receiver's view is gone (Note [shared allocation]).

The walk follows at most ``WALK_MAX`` references, a container's items counted as it is reached, so a list of a
million floats costs one ``len``: walking it item by item, with a born-private array alive elsewhere in the worker,
cost 150 ms a result and made a Pool.map of such results 1.9x the stdlib's.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys

import numpy as np
import shm_core

from . import _recycle, _shared
from ._shared import BORN_PRIVATE, BORN_SHARED, PRIVATIZED
from ._strategy import get_sharing_strategy

THRESHOLD = 1 << 20  # bytes: smaller allocations stay numpy's (a segment costs a mapping and a descriptor)
WALK_MAX = 100_000  # references a result's walk follows at most (Note [moving results]): past it, nothing moves
_CONTAINERS = frozenset((list, tuple, dict))  # the containers a walk follows (Note [moving results])
_NO_MOVES: frozenset = frozenset()
_installed = False
_private = contextvars.ContextVar("arraymp_born_private", default=False)  # the kind this context allocates


def _take(nbytes: int, zero: bool) -> int:
    """The C handler's allocation of ``nbytes``: the address of a segment's data, or 0 for numpy's memory."""
    if get_sharing_strategy() != "file_descriptor":
        return 0
    try:
        seg = _recycle.lend(nbytes, zero)
    except OSError:  # shared memory full, or no descriptor left
        return 0
    view = memoryview(seg)
    address = seg.address + shm_core.HEADER_SIZE
    _shared.owned[address] = (nbytes, view, BORN_PRIVATE if _private.get() else BORN_SHARED)
    return address


def _give(address: int) -> None:
    """The C handler's free of a segment allocation (no lock: Note [shared allocation])."""
    _, view, kind = _shared.owned.pop(address)
    seg = view.obj
    view.release()
    if kind != PRIVATIZED:  # (a privatized one is this process's memory: it goes with ``seg``)
        _recycle.give_back(seg)


def _privatize_before_fork() -> None:
    """Note [private at fork]."""
    owned = _shared.owned
    for address, (nbytes, view, kind) in list(owned.items()):
        if kind == BORN_PRIVATE:
            if _shared.privatize(view.obj):  # (no memory for the copy: the child shares it)
                owned[address] = (nbytes, view, PRIVATIZED)


os.register_at_fork(before=_privatize_before_fork)


def moves(holder) -> frozenset:
    """The ids of the born-private arrays in ``holder``'s items that may travel with no copy: referenced only from
    within ``holder`` (a tuple or list of the caller's own, which no one else holds). Note [moving results]."""
    if not _shared.owned or not _reaches_a_candidate(holder):
        return _NO_MOVES
    walked = _walk(holder)
    if walked is None:
        return _NO_MOVES
    nodes, holders, parents = walked
    elsewhere = _held_elsewhere(nodes, holders)
    children: dict[int, list[int]] = {}
    for key, ps in parents.items():
        for p in ps:
            children.setdefault(p, []).append(key)
    todo = list(elsewhere)
    while todo:  # what a reference from elsewhere reaches is held elsewhere too
        for child in children.get(todo.pop(), ()):
            if child not in elsewhere:
                elsewhere.add(child)
                todo.append(child)
    return frozenset(key for key, o in nodes.items() if type(o) is np.ndarray and _movable(o, elsewhere))


def _reaches_a_candidate(holder) -> bool:
    """Whether ``holder``'s items reach, within WALK_MAX references, an array that may move (``_may_move``): a
    scan with no bookkeeping, so that a result of small arrays and atoms costs a worker that keeps a born-private
    array alive no walk (it cost 1.2 ms a chunk of 250 small tuples, more than its pickling)."""
    todo, seen, followed = [holder], set(), 0
    while todo:
        o = todo.pop()
        items = o.values() if type(o) is dict else o
        followed += len(items)
        if followed > WALK_MAX:
            return False
        for v in items:
            kind = type(v)
            if kind is np.ndarray:
                if _may_move(v):
                    return True
            elif kind in _CONTAINERS and id(v) not in seen:
                seen.add(id(v))
                todo.append(v)
    return False


def _walk(holder):
    """(objects by id, references each gets from within the walk, the ids of those that hold it) of the
    containers and arrays reachable from ``holder``'s items (0: ``holder``), or None past WALK_MAX references. The
    returned dict is the only reference the walk keeps to each object."""
    nodes: dict = {}
    holders: dict[int, int] = {}
    parents: dict[int, list[int]] = {}
    followed = len(holder)  # counted as a container's items are taken, before any is looked at
    if followed > WALK_MAX:
        return None
    todo = [(0, o) for o in holder if type(o) in _CONTAINERS or type(o) is np.ndarray and _may_move(o)]
    while todo:
        parent, o = todo.pop()
        kind = type(o)
        key = id(o)
        holders[key] = holders.get(key, 0) + 1
        parents.setdefault(key, []).append(parent)
        if key in nodes:
            continue
        nodes[key] = o
        if kind is np.ndarray:
            if type(o.base) is np.ndarray:
                todo.append((key, o.base))
        else:
            items = o.values() if kind is dict else o
            followed += len(items)
            if followed > WALK_MAX:  # (a list of a million floats: not one tuple made for it)
                return None
            todo.extend((key, v) for v in items  # atoms, and arrays that cannot move, are leaves: not kept
                        if type(v) in _CONTAINERS or type(v) is np.ndarray and _may_move(v))
    return nodes, holders, parents


def _may_move(arr: np.ndarray) -> bool:
    """Whether ``arr`` may be born private or view such an array: one that owns data under THRESHOLD bytes was
    numpy's allocation (or one shrunk in place, which then is copied: never wrong)."""
    return arr.base is not None or arr.nbytes >= THRESHOLD


def _held_elsewhere(nodes: dict, holders: dict) -> set:
    """The ids of the objects in ``nodes`` with more references than the walk counted (plus its own in ``nodes``),
    measured against a probe held by ``nodes`` alone."""
    nodes[0] = object()
    counts = {key: sys.getrefcount(o) for key, o in nodes.items()}
    del nodes[0]
    probe = counts.pop(0)
    return {key for key, n in counts.items() if n - probe != holders[key]}


def _movable(arr: np.ndarray, elsewhere: set) -> bool:
    """``arr`` and every array on its chain of bases are held nowhere else, and its owner is born private."""
    while id(arr) not in elsewhere:
        base = arr.base
        if base is None:
            entry = _shared.owned.get(arr.__array_interface__["data"][0])
            return entry is not None and entry[2] == BORN_PRIVATE
        if type(base) is not np.ndarray:
            return False
        arr = base
    return False


def _install() -> None:
    global _installed
    if not _installed:
        shm_core.set_allocator(THRESHOLD, _shared.owned, _take, _give)
        _installed = True


@contextlib.contextmanager
def shared_allocation():
    """Inside the block, numpy arrays of 1 MiB or more made in this context (this thread, or this asyncio task)
    are born in shared memory: sending one sends a handle, with no copy (``is_shared`` is true); other threads
    and tasks are untouched. Off under the ``file_system`` strategy. The arrays stay shared after the block;
    a fork child shares them with its parent (its writes are seen), as ``empty_shared`` arrays."""
    _install()
    old = shm_core.swap_handler(shm_core.shared_handler)
    token = _private.set(False)
    try:
        yield
    finally:
        _private.reset(token)
        shm_core.swap_handler(old)


def set_shared_allocation(on: bool, *, private: bool = False) -> None:
    """Turn shared allocation (see ``shared_allocation``) on or off until told otherwise, in this thread's
    context: called from the main thread, for the program's code and the asyncio tasks it starts later (threads
    started later get numpy's default, as numpy's handler is per context). Turning it off leaves a handler
    another library installed.

    ``private``: the arrays keep a plain numpy array's semantics (what Pool and executor workers use): sending
    one copies it, except a Pool result the worker keeps no reference to, which moves with no copy; a fork
    child gets it copy-on-write; ``is_shared`` is false."""
    if on:
        _install()
    old = shm_core.swap_handler(shm_core.shared_handler if on else None)
    if not on and old is not shm_core.shared_handler:
        shm_core.swap_handler(old)
    _private.set(bool(on and private))
