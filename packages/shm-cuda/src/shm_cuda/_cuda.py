"""CUDA IPC export and import of cupy arrays (adapts torch/multiprocessing/reductions.py).

The only module that imports cupy, always inside functions, so ``import
shm_cuda`` works without cupy or a device.

Export (``reduce_cupy_array``): the IPC handle of the whole cudaMalloc block
holding the array, the array's offset from the block's base (cuMemGetAddressRange),
shape, strides, dtype, the device UUID, an interprocess event recorded on the
current stream after the producer's work (see Note [pickling thread]), and a counter slot of this
process's Registry that keeps the block's memory alive until every consumer
released it (see _registry). A block keeps one slot while it is held; its
chunk memories (cupy pool pieces) are kept with the slot.

Import (``rebuild_cupy_array``): one ipcOpenMemHandle per (device, block) per
process (ImportCache); every received array owns the mapping through an
``UnownedMemory``; the last one closes it and drops this process's hold.
Sending a received array on counts a forward in the original producer's
registry and re-exports the producer's handle: no clone, no new allocation.

Note [pickling thread]
~~~~~~~~~~~~~~~~~~~~~~
Invariant: the interprocess event a cupy array's handle carries is recorded on the current stream of the thread that
pickles the array, so a consumer that waits on it sees all work queued on that stream before the pickle.

arraymp's queues, Pipe and the stdlib's SimpleQueue and Connection pickle in the caller of ``put``/``send``, so the
caller's stream is ordered before the consumer's. The stdlib's ``Queue`` pickles later, in its feeder thread, whose
stream is the legacy default stream: that covers work on blocking streams, not on ``Stream(non_blocking=True)`` ones,
whose work must be synchronized before such a ``put``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from collections import OrderedDict

from . import _registry
from ._cache import ImportCache
from ._errors import HandleError, NoDeviceError, UnsupportedAllocatorError
from ._fork import check_fork, forked_error, mark_initialised, was_forked
from ._handle import CudaArrayHandle
from ._lazy import when_imported

_INIT_ERROR = 3  # cudaErrorInitializationError: what CUDA says in a child forked after its parent initialised it
_KEEP_ORIGINALS = 64  # per slot: arrays a same-process get can return as themselves
_COLLECT_EVERY = 0.25  # seconds between the collector's passes while slots are busy
_lock = threading.RLock()
_cupy_mod = None


def _cupy():
    """cupy, with a device; NoDeviceError with the remedy otherwise."""
    global _cupy_mod
    check_fork()
    if _cupy_mod is not None:
        return _cupy_mod
    try:
        import cupy
    except ImportError as exc:
        raise NoDeviceError(f"shm_cuda needs cupy to share CUDA arrays, and it does not import ({exc}); install "
                            "cupy-cuda12x (pip install cupy-cuda12x) on a machine with an NVIDIA driver") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device, insufficient driver
        if was_forked() and getattr(exc, "status", None) == _INIT_ERROR:
            raise forked_error() from None  # the parent initialised CUDA itself (not through shm_cuda)
        raise NoDeviceError(f"no CUDA device is visible to this process ({exc}); run on a machine with an NVIDIA "
                            "GPU and driver, and check CUDA_VISIBLE_DEVICES") from None
    mark_initialised()
    if n == 0:
        raise NoDeviceError("no CUDA device is visible to this process; check CUDA_VISIBLE_DEVICES")
    _cupy_mod = cupy
    return cupy


def device_available() -> bool:
    """True when cupy imports and sees at least one device (initialises CUDA when it does)."""
    try:
        _cupy()
    except NoDeviceError:
        return False
    return True


# -- devices -------------------------------------------------------------------
# The driver API through ctypes, for what cupy does not wrap: the allocation
# holding a pointer, and the device UUID (cupy's getDeviceProperties()["uuid"]
# is a C string conversion that stops at the first zero byte, so about one
# device in sixteen would get a short UUID).
@functools.lru_cache(maxsize=1)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size_t, i32 = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
    for name, args in (("cuMemGetAddressRange_v2", [ctypes.POINTER(u64), ctypes.POINTER(size_t), u64]),
                       ("cuDeviceGet", [ctypes.POINTER(i32), i32]),
                       ("cuDeviceGetUuid_v2", [ctypes.c_char_p, i32]),
                       ("cuDriverGetVersion", [ctypes.POINTER(i32)])):
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _call(name: str, *args) -> None:
    lib = _driver()
    if lib is None:
        raise NoDeviceError("libcuda.so.1 (the NVIDIA driver library, CUDA >= 11.4) cannot be loaded; install or "
                            "update the NVIDIA driver")
    rc = getattr(lib, name)(*args)
    if rc != 0:
        raise _DriverError(name, rc)


def driver_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (12040 for 12.4), or None without a driver; initialises nothing."""
    lib, version = _driver(), ctypes.c_int()
    if lib is None or lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


class _DriverError(Exception):
    def __init__(self, name: str, rc: int):
        super().__init__(f"{name} failed with CUresult {rc}")


@functools.cache
def device_uuid(index: int) -> bytes:
    """The UUID of device ``index``: needs the driver initialised (``_cupy()``), no context, so looking
    through the devices does not create a context (hundreds of MiB) on each."""
    _cupy()
    dev, uuid = ctypes.c_int(), ctypes.create_string_buffer(16)
    _call("cuDeviceGet", ctypes.byref(dev), index)
    _call("cuDeviceGetUuid_v2", uuid, dev.value)
    return uuid.raw


def device_index(uuid: bytes) -> int:
    cp = _cupy()
    for i in range(cp.cuda.runtime.getDeviceCount()):
        if device_uuid(i) == uuid:
            return i
    raise HandleError(f"the device with UUID {uuid.hex()} that holds this array is not visible in process "
                      f"{os.getpid()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                      "make it visible to the consumer")


def block_range(cp, dev: int, ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding ``ptr`` (cuMemGetAddressRange); call inside Device(dev)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    cp.cuda.runtime.setDevice(dev)  # makes the primary context current (CUDA >= 12), e.g. in a feeder thread
    try:
        _call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
    except _DriverError as exc:
        raise UnsupportedAllocatorError(f"{exc} for pointer {ptr:#x}; the array's memory is not a device "
                                        "allocation CUDA IPC can export") from None
    return base.value, size.value


def _record(cp, events: dict) -> bytes:
    """Record this thread's current stream in an interprocess event; its IPC handle.

    One event per (stream, thread) and not one per block: a consumer waits on
    an event's latest record, which covers the earlier records of the same
    stream but not those of another stream.
    """
    stream = cp.cuda.get_current_stream()
    key = (stream.ptr, threading.get_ident())
    got = events.get(key)
    if got is None:
        ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
        got = events[key] = (ev, cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
    got[0].record(stream)
    return got[1]


# -- producer side ---------------------------------------------------------------
class _Slot:
    __slots__ = ("slot", "key", "mems", "events", "originals", "ipc_handle", "base", "size")

    def __init__(self, slot, key, ipc_handle, base, size):
        self.slot, self.key = slot, key
        self.ipc_handle, self.base, self.size = ipc_handle, base, size
        self.mems: dict = {}
        self.events: dict = {}  # (stream, thread) -> (interprocess event, its IPC handle): see _record
        self.originals: OrderedDict = OrderedDict()


class _Producer:
    """This process's exports: a Registry, the slot of each held block, and the collector thread."""

    def __init__(self):
        named = os.environ.get("ARRAYMP_CUDA_REGISTRY", "memfd") == "named"
        self.registry = _registry.Registry(named=named, on_free=self._on_free)
        self.by_block: dict = {}
        self.slots: dict[int, _Slot] = {}
        self.tokens = itertools.count(1)
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._collector, name="shm_cuda-collector", daemon=True)
        self.thread.start()

    def _on_free(self, s: int) -> None:
        st = self.slots.pop(s, None)
        if st is not None:
            self.by_block.pop(st.key, None)
            st.mems.clear()  # the memory goes back to the pool once the producer's own arrays are gone
            st.originals.clear()

    def _collector(self) -> None:
        while True:
            self.wake.wait(_COLLECT_EVERY)
            self.wake.clear()
            if os.getpid() != self.registry.pid:
                return
            if self.registry.busy():
                try:
                    self.registry.collect()
                except Exception:  # the registry was closed at exit
                    return

    def export(self, cp, arr, dev: int) -> CudaArrayHandle:
        mem = arr.data.mem
        ptr = arr.data.ptr
        _check_allocator(cp, mem, ptr)
        with cp.cuda.Device(dev):
            base, size = block_range(cp, dev, ptr)
            with self.registry.lock:
                key = (dev, base)
                st = self.slots.get(self.by_block.get(key, -1))
                if st is not None and st.size == size:
                    gen = self.registry.send(st.slot)
                else:
                    try:
                        ipc = cp.cuda.runtime.ipcGetMemHandle(base)
                    except cp.cuda.runtime.CUDARuntimeError as exc:
                        raise UnsupportedAllocatorError(
                            f"cudaIpcGetMemHandle refused memory from {type(mem).__name__} ({exc}); only cudaMalloc "
                            "memory can be shared: use cupy's default MemoryPool "
                            "(cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc))") from None
                    s, gen = self.registry.take()
                    st = self.slots[s] = _Slot(s, key, ipc, base, size)
                    self.by_block[key] = s
                st.mems[id(mem)] = mem
                event_handle = _record(cp, st.events)
                token = next(self.tokens)
                st.originals[token] = arr
                while len(st.originals) > _KEEP_ORIGINALS:
                    st.originals.popitem(last=False)
            return CudaArrayHandle(st.ipc_handle, size, ptr - base, tuple(arr.shape), tuple(arr.strides),
                                   arr.dtype.str, device_uuid(dev), event_handle, os.getpid(),
                                   self.registry.ref, st.slot, gen, token)

    def same_process(self, cp, h: CudaArrayHandle, dtype):
        """The array for a handle this process made: the original if still known, else a view."""
        _registry.consumer_for(h.registry).receive(h.slot, h.generation, hold=False)
        with self.registry.lock:
            st = self.slots.get(h.slot)
            if st is None:
                raise HandleError(f"slot {h.slot} of this process holds no block; the handle is corrupted")
            arr = st.originals.pop(h.token, None)
            if arr is not None:
                return arr
            owner = tuple(st.mems.values())  # keeps the chunks, and so the block, alive
            dev = st.key[0]
        mem = cp.cuda.UnownedMemory(st.base, st.size, owner, dev)
        return cp.ndarray(h.shape, dtype, cp.cuda.MemoryPointer(mem, h.offset), h.strides)


def _check_allocator(cp, mem, ptr: int) -> None:
    if isinstance(mem, cp.cuda.memory.MemoryAsync):
        raise UnsupportedAllocatorError(
            "arrays from cupy.cuda.MemoryAsyncPool (cudaMallocAsync) cannot be shared: their memory needs "
            "cudaMemPoolExportPointer, which shm_cuda does not support yet; allocate arrays to share from cupy's "
            "default MemoryPool (cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc))")
    rt = cp.cuda.runtime
    if isinstance(mem, cp.cuda.memory.ManagedMemory):
        kind = rt.memoryTypeManaged
    else:
        kind = rt.pointerGetAttributes(ptr).type
    if kind == rt.memoryTypeManaged:
        raise UnsupportedAllocatorError(
            "managed (unified) memory (cupy.cuda.malloc_managed) cannot be exported with cudaIpcGetMemHandle; "
            "copy the array into memory from cupy's default MemoryPool before sending it")
    if kind != rt.memoryTypeDevice:
        raise UnsupportedAllocatorError(
            f"memory of CUDA type {kind} from {type(mem).__name__} is not device memory and cannot travel by CUDA "
            "IPC; use cupy's default MemoryPool")


_producer: _Producer | None = None


def _the_producer() -> _Producer:
    global _producer
    with _lock:
        if _producer is None or _producer.registry.pid != os.getpid():
            _producer = _Producer()
        return _producer


# -- consumer side ---------------------------------------------------------------
_caches: dict[int, ImportCache] = {}
_by_ptr: dict[int, object] = {}  # mapping base -> weakref(Mapping): finds the mapping of a received array


def _cache_for(cp, dev: int) -> ImportCache:
    with _lock:
        c = _caches.get(dev)
        if c is None:
            def opener(key, dev=dev):
                with cp.cuda.Device(dev):
                    return cp.cuda.runtime.ipcOpenMemHandle(key[1])

            def closer(ptr, dev=dev):
                _by_ptr.pop(ptr, None)
                try:
                    with cp.cuda.Device(dev):
                        cp.cuda.runtime.deviceSynchronize()  # our kernels may still read the block
                        cp.cuda.runtime.ipcCloseMemHandle(ptr)
                except Exception:  # interpreter shutdown or a dead context: the driver unmaps at exit
                    pass

            c = _caches[dev] = ImportCache(opener, closer)
        return c


def _destroy_event(cp, ptr: int) -> None:
    try:
        cp.cuda.runtime.eventDestroy(ptr)
    except Exception:
        pass


def rebuild_cupy_array(h: CudaArrayHandle):
    """The cupy array for a received handle (see the module docstring)."""
    import weakref

    cp = _cupy()
    dtype = h.validate()
    if h.producer_pid == os.getpid() and _producer is not None and _producer.registry.ref == h.registry:
        return _producer.same_process(cp, h, dtype)
    dev = device_index(h.device_uuid)
    consumer = _registry.consumer_for(h.registry)
    consumer.check_producer()
    mapping, opened = _cache_for(cp, dev).get(h.key, h.block_size)
    if opened:
        mapping.info["handle"] = h
        mapping.info["events"] = {}  # opened: IPC handle -> event
        mapping.info["sent"] = {}  # forwarded: see _record
        _by_ptr[mapping.ptr] = weakref.ref(mapping)
        with cp.cuda.Device(dev):
            base, size = block_range(cp, dev, mapping.ptr)
            if size < h.block_size:
                raise HandleError(f"the handle says its allocation holds {h.block_size} bytes, CUDA says {size}; "
                                  "the handle is corrupted")
    hold_key = (h.registry.seg_id, h.slot, h.generation)
    hold = hold_key not in mapping.holds
    consumer.receive(h.slot, h.generation, hold)
    if hold:
        mapping.holds.add(hold_key)
        mapping.on_close.append(functools.partial(consumer.release, h.slot))
    with cp.cuda.Device(dev):
        if h.event_handle is not None:
            events = mapping.info["events"]
            ev = events.get(h.event_handle)
            if ev is None:
                try:
                    ev = events[h.event_handle] = cp.cuda.runtime.ipcOpenEventHandle(h.event_handle)
                    # before the releases: the exporter may destroy its event once released
                    mapping.on_close.insert(0, functools.partial(_destroy_event, cp, ev))
                except cp.cuda.runtime.CUDARuntimeError:
                    ev = None  # its exporter (a forwarder) exited: its work is finished or lost
            if ev is not None:
                cp.cuda.runtime.streamWaitEvent(cp.cuda.get_current_stream().ptr, ev, 0)
        mem = cp.cuda.UnownedMemory(mapping.ptr, mapping.size, mapping, dev)
        return cp.ndarray(h.shape, dtype, cp.cuda.MemoryPointer(mem, h.offset), h.strides)


def _rebuild_empty(shape, dtype, uuid):
    cp = _cupy()
    with cp.cuda.Device(device_index(uuid)):
        return cp.empty(shape, dtype)


def _received_mapping(arr):
    ref = _by_ptr.get(getattr(arr.data.mem, "ptr", None))
    m = ref() if ref is not None else None
    if m is not None and arr.data.mem.size == m.size:
        return m
    return None


def export_handle(arr) -> CudaArrayHandle | tuple:
    """The handle that sends ``arr``; for empty arrays ``("empty", shape, dtype, uuid)``."""
    cp = _cupy()
    if not isinstance(arr, cp.ndarray):
        raise TypeError(f"reduce_cupy_array takes a cupy.ndarray, got {type(arr).__name__}")
    dev = arr.device.id
    if arr.size == 0:
        return ("empty", tuple(arr.shape), arr.dtype.str, device_uuid(dev))
    m = _received_mapping(arr)
    if m is not None:  # forward: the original producer's handle, counted in its registry
        h0: CudaArrayHandle = m.info["handle"]
        _, slot, gen = next(iter(m.holds))
        _registry.consumer_for(h0.registry).forward(slot, gen)
        with cp.cuda.Device(dev):
            event_handle = _record(cp, m.info["sent"])
        return CudaArrayHandle(h0.ipc_handle, h0.block_size, arr.data.ptr - m.ptr, tuple(arr.shape),
                               tuple(arr.strides), arr.dtype.str, h0.device_uuid, event_handle,
                               h0.producer_pid, h0.registry, slot, gen, 0)
    return _the_producer().export(cp, arr, dev)


def reduce_cupy_array(arr):
    """The ``ForkingPickler`` reducer of cupy.ndarray: ``(rebuild, args)``."""
    h = export_handle(arr)
    if isinstance(h, tuple):
        return _rebuild_empty, h[1:]
    return rebuild_cupy_array, (h,)


def collect() -> int:
    """Run one collection pass now (reap dead consumers, free released slots); returns slots freed."""
    p = _producer
    if p is None or p.registry.pid != os.getpid():
        return 0
    return len(p.registry.collect())


def busy_slots() -> int:
    """Counter slots of this process still held by consumers or messages in flight."""
    p = _producer
    return 0 if p is None or p.registry.pid != os.getpid() else p.registry.busy()


_registers: list = []  # the register functions init_reductions was given


def _register_all(cupy) -> None:
    for register in _registers:
        register(cupy.ndarray, reduce_cupy_array)


def init_reductions(register) -> bool:
    """Register ``reduce_cupy_array`` for cupy.ndarray with ``register(cls, reducer)``.

    Registers now when cupy is imported, else when the program imports it
    (see _lazy): never imports cupy nor touches CUDA itself, so importing
    arraymp costs no cupy import and a later fork can still use CUDA. Returns
    whether it registered now. mp-reductions calls
    ``shm_cuda.init_reductions(multiprocessing.reduction.ForkingPickler.register)``.
    """
    if register not in _registers:
        _registers.append(register)
    return when_imported("cupy", _register_all)
