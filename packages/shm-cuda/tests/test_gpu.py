"""CUDA multiprocessing tests, ported from torch's test/test_multiprocessing.py (cupy terms).

Marked ``gpu``: skipped with the reason when cupy sees no device. All use the
'spawn' start method (a forked child cannot use CUDA).
"""

import multiprocessing as mp
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
ctx = mp.get_context("spawn")


@pytest.fixture(scope="module")
def cp():
    import cupy
    import shm_cuda
    assert shm_cuda.init_reductions(ForkingPickler.register)
    return cupy


def start(target, *args):
    import _gpu_targets
    p = ctx.Process(target=getattr(_gpu_targets, target), args=args, daemon=True)
    p.start()
    return p


@pytest.mark.parametrize("queues", ["stdlib", "arraymp"])
def test_simple_sharing(cp, queues):
    if queues == "stdlib":
        Queue = ctx.Queue
    else:  # mp-reductions' queues register the cupy reducer in every process that receives them
        Queue = pytest.importorskip("mp_reductions", reason="mp-reductions is not installed beside shm-cuda").Queue
    q_in, q_out = Queue(), Queue()
    p = start("echo_sum", q_in, q_out)
    arr = cp.arange(1000, dtype=cp.float32)
    q_in.put(arr)
    assert q_out.get(timeout=120) == float(arr.sum())
    p.join(60)
    assert p.exitcode == 0


def test_producer_deletes_after_put(cp):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("echo_sum", q_in, q_out)
    arr = cp.full(1 << 20, 2, dtype=cp.int64)
    q_in.put(arr)
    del arr  # the slot keeps the block alive until the consumer released it
    cp.get_default_memory_pool().free_all_blocks()
    assert q_out.get(timeout=120) == 2.0 * (1 << 20)
    p.join(60)


def test_chain_of_three_exact_sum(cp):
    n = 100_000
    q1, q2, q3, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [start("chain_stage", q1, q2, n), start("chain_stage", q2, q3, n), start("chain_sink", q3, out, n)]
    expected = 0
    for i in range(n):
        a = cp.full(4, i % 1000, dtype=cp.int64)
        expected += 4 * (i % 1000)
        q1.put(a)
    assert out.get(timeout=400) == expected
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


def test_event_orders_producer_and_consumer_streams(cp):
    # a SimpleQueue pickles in put's thread, on this thread's stream (Note [pickling thread])
    q_in, q_out = ctx.SimpleQueue(), ctx.Queue()
    p = start("stream_reader", q_in, q_out, 1)
    assert q_out.get(timeout=120) == "ready"
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        arr = cp.zeros(1 << 24, dtype=cp.float32)
        for _ in range(50):  # long pending work on a side stream
            arr += 1
        q_in.put(arr[:4])  # the event is recorded on s after the additions
    assert q_out.get(timeout=120) == [50.0] * 4
    p.join(60)


def test_events_per_stream(cp):
    # one block sent from two streams: the first message's consumer must wait for
    # the first stream, though the second stream recorded after it
    q_in, q_out = ctx.SimpleQueue(), ctx.Queue()
    p = start("stream_reader", q_in, q_out, 2)
    assert q_out.get(timeout=120) == "ready"
    arr = cp.zeros(8, dtype=cp.float32)
    big = cp.zeros(1 << 26, dtype=cp.float32)
    cp.cuda.Device().synchronize()  # the side streams do not wait for the default one
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with s1:
        for _ in range(1000):  # ~0.1 s of work queued on s1
            big += 1
        arr[:4] = big[:4]
        q_in.put(arr[:4])
    with s2:
        q_in.put(arr[4:])
    assert q_out.get(timeout=120) == [1000.0] * 4
    assert q_out.get(timeout=120) == [0.0] * 4
    p.join(60)


def test_event_handle_export_import(cp):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("event_waiter", q_in, q_out)
    ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    ev.record()
    q_in.put(cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
    assert q_out.get(timeout=120) == "synced"
    p.join(60)


def test_empty_arrays(cp):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("bytes_back", q_in, q_out, 3)
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        q_in.put(cp.empty(shape, cp.float64))
        assert q_out.get(timeout=120) == b""
    p.join(60)


def test_mixed_dtypes_one_block(cp):
    raw = cp.arange(4096, dtype=cp.uint8)
    views = [raw[:1024].view(cp.float32), raw[1024:2048].view(cp.int16), raw[2048:].view(cp.complex64)]
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("bytes_back", q_in, q_out, len(views))
    for v in views:
        q_in.put(v)
        assert q_out.get(timeout=120) == cp.asnumpy(v).tobytes()
    p.join(60)


def test_random_slices_bit_exact(cp):
    rng = np.random.default_rng(0)
    base = cp.asarray(rng.integers(0, 2**31, size=(64, 64), dtype=np.int32))
    n = 10_000
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("bytes_back", q_in, q_out, n)
    for _ in range(n):
        a, b = sorted(rng.integers(0, 64, 2))
        c, d = sorted(rng.integers(0, 64, 2))
        step = int(rng.integers(1, 4))
        view = base[a:b + 1:step, d:c:-1] if rng.random() < 0.5 else base.T[c:d + 1, a:b + 1:step]
        q_in.put(view)
        assert q_out.get(timeout=120) == cp.asnumpy(view).tobytes()
    p.join(60)


def test_same_process_round_trip_returns_original(cp):
    q = ctx.Queue()
    arr = cp.arange(10)
    q.put(arr)
    assert q.get(timeout=60) is arr


def test_killed_consumer_frees_memory(cp):
    import shm_cuda
    pool = cp.get_default_memory_pool()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("hold_and_wait", q_in, q_out)
    big = cp.ones(1 << 28, dtype=cp.float32)  # 1 GiB
    q_in.put(big)
    q_out.get(timeout=120)
    del big
    used = pool.used_bytes()
    assert used >= 1 << 30 and shm_cuda.busy_slots() >= 1  # held by the consumer
    p.kill()
    p.join()
    deadline = time.monotonic() + 2.0
    while pool.used_bytes() > used - (1 << 30) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.used_bytes() <= used - (1 << 30)


def test_consumer_suicide_after_receive(cp):
    import shm_cuda
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("suicide", q_in, q_out)
    q_in.put(cp.ones(1000, dtype=cp.int32))
    assert q_out.get(timeout=120) == 1000
    p.join(60)
    deadline = time.monotonic() + 2.0
    while shm_cuda.busy_slots() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm_cuda.busy_slots() == 0


@pytest.mark.parametrize("alloc", ["async", "managed"])
def test_unsupported_allocators_fail_fast(cp, alloc):
    import shm_cuda
    if alloc == "async":
        if not cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMemoryPoolsSupported, 0):
            pytest.skip("this device has no stream-ordered memory pools")
        allocator, words = cp.cuda.MemoryAsyncPool().malloc, "MemoryAsyncPool"
    else:
        allocator, words = cp.cuda.malloc_managed, "managed"
    with cp.cuda.using_allocator(allocator):
        arr = cp.arange(100)
    with pytest.raises(shm_cuda.UnsupportedAllocatorError, match=words):
        shm_cuda.reduce_cupy_array(arr)


def test_default_pool_and_plain_malloc_work(cp):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("bytes_back", q_in, q_out, 1)
    with cp.cuda.using_allocator(None):  # no pool: a bare cudaMalloc per array
        arr = cp.arange(100, dtype=cp.int16)
    q_in.put(arr)
    assert q_out.get(timeout=120) == cp.asnumpy(arr).tobytes()
    p.join(60)


def test_two_devices(cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = start("to_device", q_in, q_out, 1)
    with cp.cuda.Device(1):
        arr = cp.ones(100, dtype=cp.float32)
    q_in.put(arr)
    assert q_out.get(timeout=120) == (1, 100.0)
    p.join(60)


def test_memory_flat_over_many_messages(cp):
    import resource

    import shm_cuda
    q = ctx.Queue()
    arr = cp.arange(16)
    rss = []
    for i in range(200_000):
        q.put(arr)
        q.get()
        if i % 50_000 == 0:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    shm_cuda.collect()
    assert rss[-1] - rss[1] < 50_000  # KiB
