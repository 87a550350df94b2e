"""How task arguments and results cross Dask's comms: handles within a shared memory, bytes elsewhere.

Dask moves data between the client and its workers over TCP, serializing each
value with the families it knows and a ``context`` naming the peer. The Pool
and the executor of this package wrap every task's arguments and every result
in a ``Shipped``, whose Dask serializer picks the transport per message::

    client --Shipped(args)--> worker          same shared memory: arrays >= the inline threshold as
    client <--Shipped(result)-- worker        named segments (a name, a few dozen bytes); else, or no
                                              recipient (spilling): pickle-5 frames

Arrays under the inline threshold, and everything sent as bytes, go as Dask
sends numpy arrays: pickle protocol 5, frames copied on arrival when
read-only. Received arrays are writable. What a peer sends is unpickled, as
Dask unpickles everything its comms carry (its trust model: every process of
the cluster is the user's). A task's arguments carry its function too, and a
pool's name: the script's functions in them are rebuilt over that pool's
namespace on the worker (Note [Script namespaces] in _script.py); results go
back as cloudpickle sends them. Counters (this process;
``DaskContext.transfer_counters`` sums a cluster): ``handles_sent``,
``inband_array_bytes`` (array data that went as bytes), ``sends`` (messages
with a recipient), ``sends_without_recipient``.

Note [Same-node transport]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: an array travels as a handle only to a recipient whose
shared-memory domain (_domain.py: boot id; the segment directory's device,
inode and path; uid; pid namespace), as that recipient said it in the
handshake of the connection the message goes on, equals its sender's, and
only with ``same_node=True``; everything else goes as Dask's bytes.
``transfer_counters()`` shows it: ``handles_sent`` counts the one,
``inband_array_bytes`` the other.

Why: an address says where a process listens, not what memory it sees. A
container with a /dev/shm of its own on the host's network has the host's
address; a handle names a file, and a count kept by pid, that only a process
of the same directory and pid namespace can open and count. The domain is
read per connection because Dask sends a result on the connection its reader
opened, whose address names no listening process: a table by address (the
scheduler's, ``DaskContext.shm_domains()``; a pool's of the workers of its
domain) could not say who reads it. The receiver trusts nothing it reads: it
checks the domain the message's header says its sender had against its own
before it opens anything, then each handle as mp_reductions checks any
(name, directory, header, size). A handle it still cannot open fails that
task's future with ``DaskHandleError`` and its cause, never the connection.

Note [Counts over Dask]
~~~~~~~~~~~~~~~~~~~~~~~
Invariant: each in-flight count a handle sent over Dask carries is taken over
by its reader or given back once the reader can no longer read it. A task's
arguments are sent *kept*: the pool holds their counts until the task is done
with or lost, and the worker takes counts of its own (Note [kept counts]). A
worker's results are sent *told* (``tell_counts``, to the pid its reader said
in the handshake: Note [results told]), and each pool says
``shm_manager.done_with`` for the workers of its domain it saw die, once none
of its tasks is pending (its reads of what they sent are over) and at its
close. So a worker killed after it counted a result and before its reader
took it leaves nothing once the pool is done with it (it left the count until
the worker's group ended: a LocalCluster's is the program).

How: a handle goes through ``mp_reductions.reduce_ndarray`` under the
``file_system`` strategy (descriptors cannot cross TCP); an array already in
a named segment travels as its handle, any other is copied once into a
recycled segment (``message_copies``), the receiver's own. The receiver holds
its count through the segment's group daemon, also for another program's
segment (Note [Holds across groups]). Dask moving a result makes one count
per copy sent. Not covered:
another pool of the same process reading from a worker as it dies, while
this one says ``done_with``: that read takes a count already given back.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading

import cloudpickle
import numpy as np
import shm_core
from distributed.protocol import dask_deserialize, dask_serialize
from mp_reductions import (
    counts_kept,
    get_inline_threshold,
    get_sharing_strategy,
    keep_counts,
    message_copies,
    reduce_ndarray,
    set_sharing_strategy,
    tell_counts,
)

from . import _domain, _script

_COUNTERS = ("handles_sent", "inband_array_bytes", "sends", "sends_without_recipient")
_counts = dict.fromkeys(_COUNTERS, 0)
_counts_lock = threading.Lock()


class Shipped:
    """A task's arguments or result on its way through Dask (see the module header). ``namespace``: the pool
    whose namespace the script's functions in ``value`` are rebuilt over (Note [Script namespaces]);
    ``copies``: a list, to collect the segments its arrays are copied into when sent (Note [Lost workers] in
    _tasks.py); ``error``: why it arrived without its value (Note [Same-node transport])."""

    __slots__ = ("value", "same_node", "namespace", "copies", "held", "error")

    def __init__(self, value, same_node: bool = True, namespace: str | None = None, copies: list | None = None,
                 error: BaseException | None = None):
        self.value, self.same_node, self.namespace, self.copies = value, same_node, namespace, copies
        # a task's arguments: the in-flight counts of its handles stay ours until the task is done with
        # (mp_reductions' Note [kept counts]); given back by the pool (mp_reductions.give_back_counts)
        self.held: list | None = [] if copies is not None else None
        self.error = error


class DaskHandleError(RuntimeError):
    """Raised when a task's arguments or result reached a process of the Dask cluster as shared-memory handles
    that it could not open (Note [Same-node transport]): that task fails with it, in the caller's future."""

    def __init__(self, receiver: str, sender: str, cause: str):
        super().__init__(receiver, sender, cause)
        self.receiver, self.sender, self.cause = receiver, sender, cause

    def __str__(self) -> str:
        return (f"{self.receiver} could not open the shared-memory handles that {self.sender} sent it: "
                f"{self.cause}. arraymp sends arrays as handles only between processes of one shared-memory domain "
                "(one /dev/shm and pid namespace); give them the same ones (docker: --ipc host, or one /dev/shm "
                "volume, and --pid host; see docs/dask.md), or send bytes: get_context('dask', same_node=False)")

    def __reduce__(self):
        return type(self), (self.receiver, self.sender, self.cause)


def transfer_counters() -> dict[str, int]:
    """This process's transfer counters (Note [Same-node transport])."""
    with _counts_lock:
        return dict(_counts)


def reset_transfer_counters() -> None:
    with _counts_lock:
        for k in _counts:
            _counts[k] = 0


def _count(**kw) -> None:
    with _counts_lock:
        for k, n in kw.items():
            _counts[k] += n


class _Pickler(cloudpickle.Pickler):
    """Dask's pickler (cloudpickle: lambdas in arguments work as on plain Dask), arrays as Note [Same-node
    transport] says, the script's functions over the namespace of the pool ``namespace`` (Note [Script
    namespaces]); ``buffers`` None: everything in band, uncounted."""

    def __init__(self, file, buffers: list | None, copy=None, namespace: str | None = None):
        super().__init__(file, protocol=5, buffer_callback=None if buffers is None else buffers.append)
        self.copy = copy  # a message_copies() copier when arrays go as handles, else None
        self.copies: list[shm_core.Segment] = []  # the segments it copied into
        self.counted = buffers is not None
        self.threshold = get_inline_threshold()
        self.namespace = namespace
        self.namespace_ref = None if namespace is None else _script.NamespaceRef(namespace)  # one per pickle

    def reducer_override(self, obj):
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            if self.copy is not None and obj.nbytes >= max(self.threshold, 1):
                own = _named_segment(obj) is None
                if own:  # a memfd one cannot cross TCP: copied like any other, the receiver's own
                    obj = self.copy(obj)
                    self.copies.append(_named_segment(obj))
                _count(handles_sent=1)
                return reduce_ndarray(obj, own=own)
            if self.counted:
                _count(inband_array_bytes=obj.nbytes)
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func):
        if self.namespace is not None and _script.is_script_function(func, self.namespace):
            return _script.reduce_in_namespace(self, func, self.namespace_ref)
        return super()._dynamic_function_reduce(func)


def dumps_for_pool(obj, namespace: str) -> bytes:
    """``obj`` (a pool's initializer and its arguments, or a batch's task function) as one pickle, loaded by
    every worker that runs it, also those that start later: arrays in band, the script's functions over the
    pool's namespace."""
    f = io.BytesIO()
    _Pickler(f, None, namespace=namespace).dump(obj)
    return f.getvalue()


def _named_segment(arr: np.ndarray) -> shm_core.Segment | None:
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, shm_core.Segment) and base.name else None


def receiver() -> str:
    """This process, for a message: the worker's address where it is one (in a task's thread)."""
    try:
        from distributed import get_worker

        return f"worker {get_worker().address} (pid {os.getpid()})"
    except ValueError:
        return f"process {os.getpid()}"


@dask_serialize.register(Shipped)
def _dumps(obj: Shipped, context=None):
    recipient = isinstance(context, dict) and "recipient" in context
    _count(**{"sends" if recipient else "sends_without_recipient": 1})
    theirs, reader = _domain.peer(context)
    mine = _domain.domain()
    handles = obj.same_node and mine is not None and theirs == mine  # Note [Same-node transport]
    if handles and get_sharing_strategy() != "file_system":
        set_sharing_strategy("file_system")  # descriptors cannot cross TCP: named segments from now on
    buffers: list = []
    f = io.BytesIO()
    held = obj.held if handles else None
    if held is not None:
        counts = keep_counts(held)  # a task's arguments (Note [Counts over Dask])
    elif handles and reader is not None:
        counts = tell_counts(reader)  # a result
    else:
        counts = contextlib.nullcontext()
    with message_copies() if handles else contextlib.nullcontext() as copy, counts:
        pickler = _Pickler(f, buffers, copy, obj.namespace)
        pickler.dump(obj.value)
    if obj.copies is not None:
        obj.copies += pickler.copies
    frames = [f.getbuffer(), *(b.raw() for b in buffers)]
    header = {"same_node": obj.same_node, "handles": handles, "namespace": obj.namespace, "kept": held is not None}
    if handles:
        address = context["sender"].get("address") if isinstance(context.get("sender"), dict) else None
        header["domain"], header["from"] = mine, f"{address or 'a process'} (pid {os.getpid()})"
    return header, frames


@dask_deserialize.register(Shipped)
def _loads(header, frames):
    same, namespace = bool(header.get("same_node", True)), header.get("namespace")
    namespace = namespace if isinstance(namespace, str) else None
    handles = header.get("handles") is True
    if handles:  # checked before anything is opened (Note [Same-node transport])
        sender = header.get("from")
        sender = sender[:200] if isinstance(sender, str) else "a process"
        theirs, mine = header.get("domain"), _domain.domain()
        if mine is None or theirs != mine:
            cause = (f"its sender's shared-memory domain is {_domain.describe(theirs)}, and this process's "
                     f"{_domain.describe(mine)}")
            return Shipped(None, same, namespace, error=DaskHandleError(receiver(), sender, cause))
    buffers = [b if not memoryview(b).readonly else bytearray(b) for b in frames[1:]]
    try:
        with counts_kept() if header.get("kept") is True else contextlib.nullcontext():
            value = pickle.loads(frames[0], buffers=buffers)
    except (OSError, shm_core.SegmentError) as exc:
        if not handles:
            raise
        cause = f"{type(exc).__name__}: {exc}"
        return Shipped(None, same, namespace, error=DaskHandleError(receiver(), sender, cause))
    return Shipped(value, same, namespace)
