"""Counter-slot registry: producer-side lifetime of exported CUDA blocks.

Adapts the ref-counter files of torch (``torch/csrc/CudaIPCTypes.cpp``), which
count a block's consumers in shared memory and cannot notice a consumer that
died. Here every word has one writer, so a dead writer's share can be taken
back exactly.

Actors::

    producer ── put(arr) ──▶ message ──▶ consumer C1 ── put(view) ──▶ consumer C2
       │  sent[s] += 1                   │ word[s][C1] += (1<<32)+1      │ word[s][C2] += ...
       │                                 │ sent[s] += 1 (forward)        │
       └── collector thread: frees slot s when no message is in flight and no row holds it;
           clears the rows of consumers that died (pid + start time, pidfd)

One shared segment (a memfd by default; see RegistryRef for how it travels)::

    data offset   what
    0             magic "CUDAREG1", producer pid, producer start time, nslots, nrows
    64            rows:  nrows × (pid, start time)           consumers claim a row by CAS on pid
    64+16·R       slots: nslots × (generation, sent)         sent: messages made for the slot
    ...           words: nslots × nrows int64                word[s][r] = recv << 32 | held

Note [one writer per word]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: ``word[s][r]`` is written only by the consumer owning row r while it lives,
and by the producer only after that consumer is provably dead. Receiving a
message is one atomic add of ``(1 << 32) + 1`` (or ``1 << 32`` when the
process already holds the block), so "the message arrived" and "this process
holds the block" change together: there is no window where a crash loses or
double-counts a reference. Releasing is one add of -1. ``sent`` is added to by
the producer and by consumers forwarding an array they hold.

Slot s is free iff, reading sent before (s1) and after (s2) one pass over the
rows, s1 == s2, s1 - retired[s] - Σ recv ≡ 0 (mod 2**32) and Σ held == 0.
Every new reference to s is made by someone who holds one (the producer's own
array, or a consumer's held count) and adds to ``sent`` first, so a pass that
sees no held count and no message in flight with an unchanged ``sent`` proves
nobody can reach the block any more. ``retired[s]`` (producer memory) adds up
the recv counts of rows whose consumer died; the producer folds a dead row
(under its lock) before it gives the row back.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import shm_core

from ._errors import ProducerGoneError, RegistryFullError, ShmCudaError, StaleHandleError
from ._proc import Watch, start_time

MAGIC = int.from_bytes(b"CUDAREG1", "little")
_D = shm_core.HEADER_SIZE
_HEAD_WORDS = 8
_ROW_BYTES = 16
_SLOT_BYTES = 16
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
RECV_AND_HOLD = (1 << 32) + 1
RECV_ONLY = 1 << 32

DEFAULT_SLOTS = int(os.environ.get("ARRAYMP_CUDA_SLOTS", "1024"))
DEFAULT_ROWS = int(os.environ.get("ARRAYMP_CUDA_CONSUMERS", "64"))


@dataclass(frozen=True)
class RegistryRef:
    """How a consumer finds a producer's registry: picklable, small.

    ``name`` set: a named segment in ``dir``. Otherwise the producer's memfd,
    reopened through ``/proc/<pid>/fd/<fd>`` (same user, same pid namespace);
    ``seg_id`` (the segment header's random id) proves it is still the same file.
    """

    pid: int
    start: int
    seg_id: int
    fd: int = -1
    name: str | None = None
    dir: str | None = None


class _Layout:
    def __init__(self, nslots: int, nrows: int):
        self.nslots, self.nrows = nslots, nrows
        self.rows = _D + 8 * _HEAD_WORDS
        self.slots = self.rows + _ROW_BYTES * nrows
        self.words = self.slots + _SLOT_BYTES * nslots
        self.size = self.words + 8 * nslots * nrows - _D

    def row_pid(self, r: int) -> int:
        return self.rows + _ROW_BYTES * r

    def gen(self, s: int) -> int:
        return self.slots + _SLOT_BYTES * s

    def sent(self, s: int) -> int:
        return self.slots + _SLOT_BYTES * s + 8

    def word(self, s: int, r: int) -> int:
        return self.words + 8 * (s * self.nrows + r)


def _check_index(name: str, i: int, n: int) -> None:
    if not 0 <= i < n:
        raise ShmCudaError(f"{name} {i} is out of range 0..{n - 1}; the handle is corrupted")


class Registry:
    """The producer's side: takes, counts and frees slots; reclaims dead consumers' counts.

    ``on_free(slot)`` is called (from the caller of :meth:`collect`, often the
    collector thread) for each slot found free, after it was made reusable.
    """

    seg = None
    #: seconds take() waits for a slot to be released before RegistryFullError
    full_timeout = float(os.environ.get("ARRAYMP_CUDA_FULL_TIMEOUT", "30"))

    def __init__(self, nslots: int = DEFAULT_SLOTS, nrows: int = DEFAULT_ROWS, *, named: bool = False,
                 dir: str | None = None, on_free=None):
        if nslots < 1 or nrows < 1:
            raise ValueError(f"a registry needs at least one slot and one row, got {nslots} and {nrows}")
        self.layout = lay = _Layout(nslots, nrows)
        self.seg = shm_core.create(lay.size, dir=dir, prefix="arraymp_cuda_") if named else \
            shm_core.create_anonymous(lay.size)
        self.pid = os.getpid()
        self.start = start_time(self.pid)
        for i, v in enumerate((MAGIC, self.pid, self.start, nslots, nrows)):
            self.seg.store(_D + 8 * i, v)
        self.on_free = on_free
        self.lock = threading.RLock()
        self.in_use = [False] * nslots
        self.retired = [0] * nslots
        self._free = list(range(nslots - 1, -1, -1))
        self._watches: dict[int, Watch] = {}
        self.ref = RegistryRef(self.pid, self.start, self.seg.id, fd=self.seg.fd if not named else -1,
                               name=self.seg.name, dir=self.seg.dir)

    # -- producer operations -------------------------------------------------
    def take(self) -> tuple[int, int]:
        """A free slot and its generation, counted as holding one message (see :meth:`send`)."""
        deadline = time.monotonic() + self.full_timeout
        while True:  # backpressure: wait (bounded) for consumers to release slots
            with self.lock:
                if not self._free:
                    self.collect()
                if self._free or time.monotonic() >= deadline:
                    break
            time.sleep(0.005)
        with self.lock:
            if not self._free:
                raise RegistryFullError(
                    f"all {self.layout.nslots} CUDA IPC counter slots are held by consumers or by messages not "
                    "yet received; receive or delete the arrays sent earlier, or raise ARRAYMP_CUDA_SLOTS")
            s = self._free.pop()
            self.in_use[s] = True
            self.seg.fetch_add(self.layout.sent(s), 1)
            return s, self.seg.load(self.layout.gen(s))

    def send(self, s: int) -> int:
        """Count one more message for the in-use slot ``s``; returns its generation."""
        with self.lock:
            if not self.in_use[s]:
                raise StaleHandleError(f"slot {s} is not in use")
            self.seg.fetch_add(self.layout.sent(s), 1)
            return self.seg.load(self.layout.gen(s))

    def is_free(self, s: int) -> bool:
        lay, seg = self.layout, self.seg
        s1 = seg.load(lay.sent(s))
        recv, held = self.retired[s], 0
        for r in range(lay.nrows):
            u = seg.load(lay.word(s, r)) & _MASK64
            recv += u >> 32
            held += u & _MASK32
        s2 = seg.load(lay.sent(s))
        return s1 == s2 and (s1 - recv) & _MASK32 == 0 and held == 0

    def reap_rows(self) -> list[int]:
        """Fold and give back the rows of consumers that died; returns their pids."""
        lay, seg = self.layout, self.seg
        dead = []
        with self.lock:
            for r in range(lay.nrows):
                off = lay.row_pid(r)
                pid = seg.load(off)
                if pid == 0:
                    self._drop_watch(r)
                    continue
                start = seg.load(off + 8)
                if start == 0:  # being claimed right now, or its claimer died mid-claim
                    if start_time(pid) is not None:
                        continue
                else:
                    w = self._watches.get(r)
                    if w is None or (w.pid, w.start) != (pid, start):
                        self._drop_watch(r)
                        w = self._watches[r] = Watch(pid, start)
                    if w.alive():
                        continue
                for s in range(lay.nslots):
                    u = seg.load(lay.word(s, r)) & _MASK64
                    if u:
                        self.retired[s] = (self.retired[s] + (u >> 32)) & _MASK32
                        seg.store(lay.word(s, r), 0)
                self._drop_watch(r)
                seg.store(off + 8, 0)
                seg.store(off, 0)
                dead.append(pid)
        return dead

    def _drop_watch(self, r: int) -> None:
        w = self._watches.pop(r, None)
        if w is not None:
            w.close()

    def collect(self) -> list[int]:
        """Reap dead consumers, then free every in-use slot nobody holds; returns the freed slots."""
        freed = []
        with self.lock:
            self.reap_rows()
            for s in range(self.layout.nslots):
                if self.in_use[s] and self.is_free(s):
                    self.in_use[s] = False
                    self.seg.fetch_add(self.layout.gen(s), 1)
                    self._free.append(s)
                    freed.append(s)
            for s in freed:
                if self.on_free is not None:
                    self.on_free(s)
        return freed

    def busy(self) -> int:
        return sum(self.in_use)

    def close(self) -> None:
        seg, self.seg = self.seg, None
        if seg is not None:
            for r in list(self._watches):
                self._drop_watch(r)
            seg.unlink()
            seg.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Consumer:
    """A consumer's view of one producer's registry: its row and its counts."""

    def __init__(self, ref: RegistryRef):
        self.ref = ref
        self.seg = _attach(ref)
        seg = self.seg
        if seg.load(_D) != MAGIC or (seg.load(_D + 8), seg.load(_D + 16)) != (ref.pid, ref.start):
            seg.close()
            raise ShmCudaError("the CUDA registry segment does not match its handle; the handle is corrupted")
        self.layout = _Layout(seg.load(_D + 24), seg.load(_D + 32))
        if self.layout.size != seg.size:
            seg.close()
            raise ShmCudaError(f"the CUDA registry segment holds {seg.size} bytes, its header implies "
                               f"{self.layout.size}; the segment is corrupted")
        self.producer = Watch(ref.pid, ref.start)
        self.pid = os.getpid()
        self.row = self._claim()

    def _claim(self) -> int:
        lay, seg, me = self.layout, self.seg, os.getpid()
        st = start_time(me)
        for r in range(lay.nrows):
            ok, _ = seg.compare_exchange(lay.row_pid(r), 0, me)
            if ok:
                seg.store(lay.row_pid(r) + 8, st)
                return r
        raise RegistryFullError(
            f"the producer (pid {self.ref.pid}) already serves {lay.nrows} consumer processes; start the producer "
            "with a larger ARRAYMP_CUDA_CONSUMERS")

    def check_producer(self) -> None:
        if not self.producer.alive():
            raise ProducerGoneError(
                f"the process that exported this CUDA array (pid {self.ref.pid}) has exited, so its device memory "
                "is gone; keep producers alive until consumers are done with what they sent")

    def _check(self, s: int, gen: int) -> None:
        self.check_producer()
        _check_index("counter slot", s, self.layout.nslots)
        seen = self.seg.load(self.layout.gen(s))
        if seen != gen:
            raise StaleHandleError(
                f"counter slot {s} is at generation {seen}, the handle says {gen}: it was released and reused, so "
                "this handle was used after its message had been received; send the array again")

    def receive(self, s: int, gen: int, hold: bool) -> None:
        """Take over one message's reference; ``hold`` adds this process's hold of the block."""
        self._check(s, gen)
        self.seg.fetch_add(self.layout.word(s, self.row), RECV_AND_HOLD if hold else RECV_ONLY)

    def release(self, s: int) -> None:
        """Drop this process's hold of slot ``s`` (its last array over the block died)."""
        if self.seg is not None and not self.seg.closed:
            self.seg.fetch_add(self.layout.word(s, self.row), -1)

    def forward(self, s: int, gen: int) -> None:
        """Count a message made from an array this process holds (sent to a third process)."""
        self._check(s, gen)
        self.seg.fetch_add(self.layout.sent(s), 1)


def _attach(ref: RegistryRef) -> shm_core.Segment:
    try:
        if ref.name:
            seg = shm_core.attach(ref.name, ref.dir)
        else:
            fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                seg = shm_core.attach_fd(fd)
            finally:
                os.close(fd)
    except FileNotFoundError:
        raise ProducerGoneError(
            f"the CUDA registry of pid {ref.pid} is gone: that process has exited; keep producers alive until "
            "consumers are done with what they sent") from None
    except PermissionError as exc:
        raise ShmCudaError(
            f"cannot open the CUDA registry of pid {ref.pid} ({exc}); the producer must run as the same user in the "
            "same pid namespace, or set ARRAYMP_CUDA_REGISTRY=named in the producer") from None
    if seg.id != ref.seg_id:
        seg.close()
        raise ProducerGoneError(f"the CUDA registry of pid {ref.pid} is not the one the handle names; the "
                                "producer has exited or closed it; send the array again from a live producer")
    return seg


_consumers: dict[int, Consumer] = {}
_consumers_lock = threading.Lock()


def consumer_for(ref: RegistryRef) -> Consumer:
    """This process's (cached) Consumer for a registry."""
    with _consumers_lock:
        c = _consumers.get(ref.seg_id)
        if c is None or c.pid != os.getpid():
            c = _consumers[ref.seg_id] = Consumer(ref)
        return c


def _after_fork() -> None:
    global _consumers_lock
    _consumers_lock = threading.Lock()
    _consumers.clear()


os.register_at_fork(after_in_child=_after_fork)
