"""How task arguments and results cross Dask's comms: handles on one node, bytes between nodes.

Dask moves data between the client and its workers over TCP, serializing each
value with the families it knows and a ``context`` naming the peer. The Pool
and the executor of this package wrap every task's arguments and every result
in a ``Shipped``, whose Dask serializer picks the transport per message::

    client --Shipped(args)--> worker          same node: arrays >= the inline threshold as named
    client <--Shipped(result)-- worker        segments (a name, a few dozen bytes); other node,
                                              or no recipient (spilling): pickle-5 frames

Note [Same-node transport]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A recipient is on this node when its address is a loopback address or one of
this host's. An array sent to it goes through ``mp_reductions.reduce_ndarray``
under the ``file_system`` strategy: one already in a named segment travels as
its handle, any other is copied once into a named segment, an arena block or
a recycled segment (``mp_reductions.message_copies``: a Pool's next map
copies into memory already faulted in, which is most of its speed), since
descriptors cannot cross TCP: a process that sends handles over Dask uses
``file_system`` from then on. The handle carries one in-flight count of the
segment that the receiver takes over (Note [named segments] in mp_reductions'
_shared.py); a task's arguments are the exception: the pool keeps their counts
until the task is done with or lost with its worker, and the worker takes
counts of its own (Note [kept counts] in mp_reductions' _reductions.py: a
worker killed before it unpickled them left them until the group ended). The
receiver holds its count through the segment's group daemon even when the
segment belongs to another program's group (Note [Holds across groups] in
shm_manager's _group.py): a segment lives while any process of the node holds
it and goes with its last holder, SIGKILL included. Received arrays are
writable views, as on the local contexts. Arrays under the inline threshold,
and everything sent to another node, go as Dask sends numpy arrays: pickle
protocol 5 with the array data as separate frames, copied on arrival when a
frame is read-only.

What a peer sends is unpickled, as Dask unpickles everything its comms carry
(its trust model: every process of the cluster is the user's); the handles in
it are checked like any other by mp_reductions (the segment's name, its
directory being this process's, its header and size).

A Shipped is serialized once per send: Dask replicating or moving a result
makes one handle (one in-flight count) per copy sent. A result that is lost
(its recipient killed before reading it) leaves its count until the creating
group ends.

A task's arguments carry its function too, and a pool's name: the script's
functions in them are rebuilt over that pool's namespace on the worker (Note
[Script namespaces] in _script.py); results go back as cloudpickle sends them.

Counters (this process; ``DaskContext.transfer_counters`` sums a cluster):
``handles_sent``, ``inband_array_bytes`` (array data that went as bytes),
``sends`` (messages with a recipient), ``sends_without_recipient``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import ipaddress
import pickle
import socket
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
)

from . import _script

_COUNTERS = ("handles_sent", "inband_array_bytes", "sends", "sends_without_recipient")
_counts = dict.fromkeys(_COUNTERS, 0)
_counts_lock = threading.Lock()


class Shipped:
    """A task's arguments or result on its way through Dask (see the module header). ``namespace``: the pool
    whose namespace the script's functions in ``value`` are rebuilt over (Note [Script namespaces]);
    ``copies``: a list, to collect the segments its arrays are copied into when sent (Note [Lost workers] in
    _tasks.py)."""

    __slots__ = ("value", "same_node", "namespace", "copies", "held")

    def __init__(self, value, same_node: bool = True, namespace: str | None = None, copies: list | None = None):
        self.value, self.same_node, self.namespace, self.copies = value, same_node, namespace, copies
        # a task's arguments: the in-flight counts of its handles stay ours until the task is done with
        # (mp_reductions' Note [kept counts]); given back by the pool (mp_reductions.give_back_counts)
        self.held: list | None = [] if copies is not None else None


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


@functools.lru_cache(maxsize=1)
def _local_addresses() -> frozenset:
    import psutil  # a dependency of distributed

    found = {socket.gethostname(), "localhost"}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return frozenset(found)


def recipient_host(context) -> str | None:
    """The host of the peer a message goes to, from the ``context`` Dask serializes it with; None: unknown."""
    try:
        address = context["recipient"]["address"]
    except (TypeError, KeyError):
        return None
    from distributed.comm.addressing import get_address_host, parse_address

    try:
        if parse_address(address)[0] == "inproc":
            return "localhost"
        return get_address_host(address)
    except (TypeError, ValueError):
        return None


def same_node(host: str | None) -> bool:
    """Note [Same-node transport]."""
    if host is None:
        return False
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in _local_addresses()


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


@dask_serialize.register(Shipped)
def _dumps(obj: Shipped, context=None):
    host = recipient_host(context)
    _count(**{"sends" if host is not None else "sends_without_recipient": 1})
    handles = obj.same_node and same_node(host)
    if handles and get_sharing_strategy() != "file_system":
        set_sharing_strategy("file_system")  # Note [Same-node transport]
    buffers: list = []
    f = io.BytesIO()
    held = obj.held if handles else None
    with message_copies() if handles else contextlib.nullcontext() as copy, \
            keep_counts(held) if held is not None else contextlib.nullcontext():
        pickler = _Pickler(f, buffers, copy, obj.namespace)
        pickler.dump(obj.value)
    if obj.copies is not None:
        obj.copies += pickler.copies
    frames = [f.getbuffer(), *(b.raw() for b in buffers)]
    return {"same_node": obj.same_node, "handles": handles, "namespace": obj.namespace, "kept": held is not None}, \
        frames


@dask_deserialize.register(Shipped)
def _loads(header, frames):
    buffers = [b if not memoryview(b).readonly else bytearray(b) for b in frames[1:]]
    namespace = header.get("namespace")
    with counts_kept() if header.get("kept") is True else contextlib.nullcontext():
        value = pickle.loads(frames[0], buffers=buffers)
    return Shipped(value, bool(header.get("same_node", True)), namespace if isinstance(namespace, str) else None)
