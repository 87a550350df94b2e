"""Arrays born in shared memory: numpy's own allocations placed in recycled segments (NEP 49).

numpy lets an extension choose where array data lives: a data-memory handler,
chosen per context (a ``contextvars`` variable: per thread, per asyncio task).
shm_core's handler (C, ``_native.shared_handler``) asks this module for a
segment for every allocation of ``THRESHOLD`` bytes or more and hands smaller
ones to numpy's default handler. An array whose data lies in a segment travels
as a handle, with no copy (``_shared.segment_of`` finds it), so a Pool worker's
fresh result is never copied into a message segment.

Note [shared allocation]: the handler's segments are the recycling pool's
(_recycle Note [recycling]) and obey its one invariant: a segment is reused
only when its views word reads zero::

    numpy allocates n >= THRESHOLD  ->  _take: lend(n) a free pooled segment (zeroed for calloc) or a new one;
                                        memoryview(seg) kept in _shared.owned: this process's view (word += 1)
    sent, received, viewed           ->  counted in the same word, as for any shared array
    numpy frees the data             ->  _give: view released (word -= 1), segment given back to the pool,
                                        taken again only once the word reads zero (no message, no view left)

So numpy's free and the recycling word compose as one invariant: numpy's free
is this process's last view going, nothing more; a receiver's view or a
message in flight keeps the segment out of reuse exactly as for a copy's
segment. numpy's free may come in any thread, and from a garbage collection
run while this thread holds the pool's lock: ``_give`` takes no lock
(``_recycle.give_back`` queues the segment; the next take or the reaper pools
it, and the reaper runs while any segment is lent). A free while the
interpreter shuts down leaves the segment mapped (the C handler holds
``owned`` for good): the process is ending, and a memfd has no name to leak.

Fork (_shared Note [fork]): a fork child inherits the arrays, ``owned`` and the
mappings, and the parent counted the child's view of each segment before the
fork (the views in ``owned`` are buffer exports). The child's free gives that
count back and drops the segment; only the process that made a segment pools
it (``_recycle._pool_returned``), so a child never hands its parent's memory to
a new array. The mappings are shared, as for ``empty_shared`` arrays: a fork
child's writes to an inherited array are seen by its parent (not
copy-on-write).

Where it is off: under the ``file_system`` strategy (``_take`` declines and
numpy allocates as usual): a handler segment is an anonymous memfd, which
only arraymp's own channels carry, whereas ``file_system`` is the strategy for
transports and groups we do not own (stdlib queues, Manager proxies, mp-dask
across shm-manager groups); a named segment per allocation would cost a daemon
round trip on every numpy allocation and could outlive its array in another
group. Also off while shared memory is full or out of descriptors (numpy's
memory instead: never an allocation that fails where numpy's would not), and
for allocations made by the policy itself.
"""

from __future__ import annotations

import contextlib

import shm_core
from shm_core import _native

from . import _recycle, _shared
from ._strategy import get_sharing_strategy

THRESHOLD = 1 << 20  # bytes: smaller allocations stay numpy's (a segment costs a mapping and a descriptor)
_installed = False


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
    _shared.owned[address] = (nbytes, view)
    return address


def _give(address: int) -> None:
    """The C handler's free of a segment allocation (no lock: Note [shared allocation])."""
    _, view = _shared.owned.pop(address)
    seg = view.obj
    view.release()
    _recycle.give_back(seg)


def _install() -> None:
    global _installed
    if not _installed:
        _native.set_allocator(THRESHOLD, _shared.owned, _take, _give)
        _installed = True


@contextlib.contextmanager
def shared_allocation():
    """Inside the block, numpy arrays of 1 MiB or more made in this context (this thread, or this asyncio task)
    are born in shared memory: sending one sends a handle, with no copy (``is_shared`` is true); other threads
    and tasks are untouched. Off under the ``file_system`` strategy. The arrays stay shared after the block;
    a fork child shares them with its parent (its writes are seen), as ``empty_shared`` arrays."""
    _install()
    old = _native.swap_handler(_native.shared_handler)
    try:
        yield
    finally:
        _native.swap_handler(old)


def set_shared_allocation(on: bool) -> None:
    """Turn shared allocation (see ``shared_allocation``) on or off until told otherwise, in this thread's
    context: called from the main thread, for the program's code and the asyncio tasks it starts later (threads
    started later get numpy's default, as numpy's handler is per context). A Pool worker calls it at start for
    its results (``set_shared_allocation(True)``); nothing is needed at exit. Turning it off leaves a handler
    another library installed."""
    if on:
        _install()
    old = _native.swap_handler(_native.shared_handler if on else None)
    if not on and old is not _native.shared_handler:
        _native.swap_handler(old)
