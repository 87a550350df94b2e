"""Single-process semantics: what arrives, over which memory, and the errors."""

import os
import pickle
import queue
import subprocess
import sys
import textwrap
import threading

import mp_reductions as mpr
import numpy as np
import pytest
import shm_core
from _budget_targets import can_reopen_mappings
from _views import segment_under, via_shared_memory
from mp_reductions._reductions import rebuild_ndarray
from mp_reductions._shared import segment_of

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128,
          "datetime64[ns]", "timedelta64[s]", ">i4", ">f8", [("a", "<i4"), ("b", ">f8", (2,))], "S5", "U3"]


def roundtrip(obj):
    q = mpr.Queue()
    q.put(obj)
    return q.get(timeout=10)


def sample(dtype, shape):
    raw = np.random.default_rng(0).integers(0, 255, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                            dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["inline", "copied", "shared"])
def test_dtypes_roundtrip(dtype, kind, strategy):
    shape = (3, 5) if kind == "inline" else (300, 300)
    a = sample(dtype, shape)
    if kind == "shared":
        a = mpr.share_memory(a)
    b = roundtrip(a)
    # every path keeps the dtype exactly, byte order included (numpy's own pickle of '>i4' gives '<i4')
    assert b.dtype == a.dtype and b.dtype.str == a.dtype.str and b.shape == a.shape
    assert b.tobytes() == a.tobytes()
    # by shared memory unless inline; shared only where the sender's was (a copy is the receiver's own)
    assert via_shared_memory(b) == (kind != "inline") and mpr.is_shared(b) == (kind == "shared")


@pytest.mark.parametrize("make", [
    lambda: np.asfortranarray(np.arange(200_000.0).reshape(400, 500)),
    lambda: np.arange(400_000.0).reshape(400, 1000)[::3, 1::7],
    lambda: np.arange(400_000.0)[::-2],
    lambda: np.float64(3.5) * np.ones(()),
    lambda: np.zeros((0, 7)),
])
def test_layouts_roundtrip(make, strategy):
    a = make()
    for x in (a, mpr.share_memory(a) if a.size else a):
        b = roundtrip(x)
        assert b.shape == x.shape and b.dtype == x.dtype and np.array_equal(b, x)


def test_views_of_one_segment_arrive_aliased_over_one_mapping(strategy):
    x = mpr.share_memory(np.arange(20.0).reshape(4, 5))
    got = roundtrip([x, x[2], x[:, 1]])
    assert [g.tolist() for g in got] == [x.tolist(), x[2].tolist(), x[:, 1].tolist()]
    segs = {id(segment_of(g)[0]) for g in got}
    assert segs == {id(segment_of(x)[0])}  # one mapping, and the sender's own: same memory
    got[1][1] = -5
    assert x[2, 1] == -5 and got[0][2, 1] == -5 and got[2][2] == -5


def test_unshared_large_arrays_of_one_message_share_one_segment(strategy):
    arrays = [np.full(50_000, i, np.float32) for i in range(5)]
    got = roundtrip(arrays)
    assert [int(g[0]) for g in got] == list(range(5))
    assert len({id(segment_under(g)) for g in got}) == 1
    got[0][0] = 99
    assert arrays[0][0] == 0  # a copy was sent


def test_small_arrays_travel_inline_like_the_stdlib():
    a = np.arange(10)
    assert pickle.loads(pickle.dumps(a)).tolist() == roundtrip(a).tolist()
    assert not via_shared_memory(roundtrip(a))
    mpr.set_inline_threshold(0)
    try:
        assert via_shared_memory(roundtrip(a)) and not mpr.is_shared(roundtrip(a))  # a copy, the receiver's own
    finally:
        mpr.set_inline_threshold(64 * 1024)
    with pytest.raises(ValueError):
        mpr.set_inline_threshold(-1)


def test_zero_size_and_0d():
    for a in (np.zeros((0,)), np.zeros((3, 0, 2), np.int8), np.array(7.0)):
        s = mpr.share_memory(a)
        b = roundtrip(s)
        assert b.shape == a.shape and np.array_equal(a, b)
    assert roundtrip(mpr.empty_shared((0,))).shape == (0,)


def test_is_shared_before_and_after_share_memory():
    a = np.ones((100, 100))
    assert not mpr.is_shared(a)
    s = mpr.share_memory(a)
    assert mpr.is_shared(s) and mpr.is_shared(s[3:, ::2]) and np.array_equal(a, s)
    assert mpr.share_memory(s) is s
    given = {"w": a, "b": [np.zeros(3), (np.ones(2), "x")], "n": 1}
    inner = given["b"]
    d = mpr.share_memory(given)
    assert mpr.is_shared(d["w"]) and mpr.is_shared(d["b"][0]) and mpr.is_shared(d["b"][1][0])
    assert d["n"] == 1 and d["b"][1][1] == "x"
    assert segment_of(d["w"])[0] is segment_of(d["b"][0])[0]  # one segment for the whole dict
    # the dict and the list are updated in place (only the caller's references keep the originals: a Hogwild
    # program that shares its parameters holds one copy of them, not two); the tuple is new
    assert d is given and d["b"] is inner and mpr.is_shared(given["w"])


def test_share_memory_lets_the_originals_go():
    import weakref

    params = {"w": np.ones(100_000), "layers": [np.zeros(50_000), np.zeros(50_000)]}
    refs = [weakref.ref(params["w"]), *map(weakref.ref, params["layers"])]
    mpr.share_memory(params)
    assert all(r() is None for r in refs)  # nothing but the dict held them: gone, with no collection needed
    assert all(mpr.is_shared(x) for x in (params["w"], *params["layers"]))


def test_readonly_stays_readonly(strategy):
    a = mpr.share_memory(np.arange(100_000))
    a.flags.writeable = False
    b = roundtrip(a)
    assert not b.flags.writeable
    c = np.arange(100_000)
    c.flags.writeable = False
    assert not roundtrip(c).flags.writeable
    assert roundtrip(mpr.share_memory(np.arange(100_000))).flags.writeable


def test_object_dtype_and_subclasses_pickle_as_stdlib():
    o = np.array([{"a": 1}, None, "x"] * 30_000, dtype=object)
    assert roundtrip(o).tolist() == o.tolist()
    m = np.ma.masked_array(np.arange(100_000.0), mask=np.arange(100_000) % 2 == 0)
    r = roundtrip(m)
    assert isinstance(r, np.ma.MaskedArray) and (r.mask == m.mask).all()
    rec = np.rec.array([(1, 2.0)] * 10_000, dtype=[("x", "i4"), ("y", "f8")])
    assert isinstance(roundtrip(rec), np.recarray)


def test_unpicklable_fails_like_pickle():
    q = mpr.Queue()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        q.put(threading.Lock())
    assert q.qsize() == 0 and q.empty()
    q.put(lambda: 1)  # a lambda goes by value (_byvalue Note [by value])
    assert q.get(timeout=5)() == 1
    q.put(1)  # still usable
    assert q.get(timeout=5) == 1


def test_sharing_strategies_api():
    assert mpr.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert mpr.get_sharing_strategy() == "file_descriptor"
    with pytest.raises(ValueError, match="file_descriptor, file_system"):
        mpr.set_sharing_strategy("cuda_ipc")


@pytest.mark.parametrize("bad, message", [
    (dict(offset=-8), "out of bounds"),
    (dict(offset=4096), "out of bounds"),
    (dict(shape=(100, 100), strides=(800, 8)), "out of bounds"),
    (dict(strides=(-8,)), "out of bounds"),
    (dict(strides=(8, 8)), "dimensions"),
])
def test_forged_handles_raise_clearly(bad, message):
    x = mpr.share_memory(np.zeros(512))
    seg, off = segment_of(x)
    args = dict(ref=("n", "nope", "/dev/shm"), size=seg.size, offset=off, shape=(512,), strides=(8,),
                dtype=np.dtype("f8"), readonly=False)
    args["ref"] = ("d", _FakeDup(os.dup(seg.fd)))
    args.update(bad)
    with pytest.raises(shm_core.SegmentError, match=message):
        rebuild_ndarray(**args)


class _FakeDup:
    def __init__(self, fd):
        self.fd = fd

    def detach(self):
        return self.fd


def test_wrong_size_and_missing_segment_raise_clearly(tmp_path, monkeypatch):
    x = mpr.share_memory(np.zeros(512))
    seg, _ = segment_of(x)
    with pytest.raises(shm_core.SegmentError, match="handle says"):
        rebuild_ndarray(("d", _FakeDup(os.dup(seg.fd))), seg.size + 8, 0, (1,), None, "f8", False)
    monkeypatch.setenv("ARRAYMP_SHM_DIR", str(tmp_path))  # handles name segments in this process's shm dir only
    with pytest.raises(FileNotFoundError, match="no longer exists"):
        rebuild_ndarray(("n", shm_core.segment_name(), str(tmp_path)), 8, 0, (1,), None, "f8", False)
    foreign = shm_core.segment_name()
    (tmp_path / foreign).write_bytes(b"x" * 200)
    with pytest.raises(shm_core.SegmentError, match="bad magic"):
        rebuild_ndarray(("n", foreign, str(tmp_path)), 136, 0, (1,), None, "f8", False)


def test_queue_api_like_stdlib():
    q = mpr.Queue(maxsize=2)
    q.put(1)
    q.put_nowait(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get() == 1 and q.get_nowait() == 2
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.close()
    q.join_thread()
    with pytest.raises(ValueError, match="is closed"):
        q.put(1)


def test_feeder_thread_carries_a_full_socket():
    q = mpr.Queue()
    blobs = [os.urandom(60_000) for _ in range(200)]  # more than the socket holds
    for b in blobs:
        q.put(b)
    assert [q.get(timeout=10) for _ in blobs] == blobs
    q.close()
    q.join_thread()


def test_joinable_queue():
    import threading

    q = mpr.JoinableQueue()
    for i in range(5):
        q.put(i)

    def work():
        for _ in range(5):
            q.get()
            q.task_done()
    t = threading.Thread(target=work)
    t.start()
    q.join()
    t.join()
    with pytest.raises(ValueError, match="too many"):
        q.task_done()


def test_simple_queue_and_big_pickles():
    q = mpr.SimpleQueue()
    assert q.empty()
    big = {"k": list(range(200_000))}  # a pickle larger than one socket message
    q.put(big)
    assert not q.empty() and q.get() == big
    q.close()


def test_pipe_api():
    a, b = mpr.Pipe(duplex=False)
    assert a.readable and not a.writable and b.writable and not b.readable
    with pytest.raises(OSError):
        a.send(1)
    b.send_bytes(b"hello world", 6, 5)
    assert a.poll(1) and a.recv_bytes() == b"world"
    b.send_bytes(b"toolong")
    with pytest.raises(OSError, match="bad message length"):
        a.recv_bytes(3)
    b.send_bytes(b"abc")
    buf = bytearray(5)
    assert a.recv_bytes_into(buf, 1) == 3 and buf == b"\0abc\0"
    b.close()
    with pytest.raises(EOFError):
        a.recv()
    a.close()
    assert a.closed


DESCRIPTOR_SCRIPT = """
import os, resource, sys
import numpy as np
import multiprocessing as mp
import mp_reductions as mpr

def produce(q, n):
    mpr.init_reductions()
    for i in range(n):
        a = mpr.empty_shared((16,), np.int64)
        a[:] = i
        q.put(a)
    q.put(None)
    q.close(); q.join_thread()

if __name__ == "__main__":
    mpr.init_reductions()
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    q = mpr.Queue()
    base = len(os.listdir("/proc/self/fd"))
    p = mp.get_context("spawn").Process(target=produce, args=(q, 20_000))
    p.start()
    kept = []
    while (a := q.get(timeout=120)) is not None:
        kept.append(a)
    p.join()
    fds = len(os.listdir("/proc/self/fd"))
    assert len(kept) == 20_000 and all(int(a[0]) == i for i, a in enumerate(kept)), "wrong data"
    q2 = mpr.Queue()
    q2.put(kept[0]); q2.put(kept[-1])
    r0, r1 = q2.get(timeout=10), q2.get(timeout=10)
    r0[1] = -1
    assert kept[0][1] == -1 and int(r1[0]) == 19_999
    print(base, fds, p.exitcode)
"""


def test_no_descriptor_exhaustion_with_20000_live_received_arrays(tmp_path):
    if not can_reopen_mappings():
        pytest.skip("under ulimit -n 256, re-sending the oldest of 20,000 received arrays re-opens it from "
                    "/proc/self/map_files, which this process may not (CAP_CHECKPOINT_RESTORE)")
    script = tmp_path / "fds.py"
    script.write_text(textwrap.dedent(DESCRIPTOR_SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    base, fds, code = map(int, out.stdout.split())
    assert code == 0 and fds < base + 32, (base, fds)


class SendsWhilePickled:
    """Pickling it sends a message of its own on ``q``: the thread's reused pickler is busy (Note [reused
    pickler]); the nested message must get a pickler of its own and both must arrive whole."""

    def __init__(self, q, payload):
        self.q, self.payload = q, payload

    def __reduce__(self):
        self.q.put(("nested", self.payload))
        return tuple, (("outer", self.payload),)


def test_a_message_pickled_while_another_is_keeps_both_whole():
    q, side = mpr.Queue(), mpr.Queue()
    big = np.arange(100_000.0)  # shared memory in both messages
    q.put([SendsWhilePickled(side, big), np.arange(5), "after"])
    got = q.get(timeout=10)
    assert got[0][0] == "outer" and np.array_equal(got[0][1], big)
    assert np.array_equal(got[1], np.arange(5)) and got[2] == "after"
    nested = side.get(timeout=10)
    assert nested[0] == "nested" and np.array_equal(nested[1], big)
    q.put(("plain", 1))  # the reused pickler is whole afterwards
    assert q.get(timeout=10) == ("plain", 1)


def test_a_sent_object_is_not_kept_alive_by_the_pickler():
    # the reused pickler's memo holds what it pickled until cleared: an array sent must go when dropped
    import gc
    import weakref

    q = mpr.Queue()
    for n in (10, 100_000):  # inline, and in shared memory
        a = np.arange(float(n))
        ref = weakref.ref(a)
        q.put([a, a])  # twice: the memo holds it between the two
        del a
        gc.collect()
        assert ref() is None, "the array outlived its message in the sender"
        q.get(timeout=10)


def test_a_large_pickle_retires_the_threads_pickler():
    # Note [reused pickler]: the C pickler's memo table never shrinks and clearing it writes all of it, so the
    # thread's pickler is kept across small messages only; after one of 100,000 objects, the next is a new one
    from mp_reductions import _pickling

    a, b = mpr.Pipe()
    a.send([1])
    first = _pickling._reused.pickler
    a.send([2, "two"])
    assert _pickling._reused.pickler is first, "a small message's pickler was not reused"
    a.send([str(i) for i in range(100_000)])
    assert _pickling._reused.pickler is None, "the pickler of a large message was kept"
    a.send([3])
    assert _pickling._reused.pickler not in (None, first)
    assert [b.recv() for _ in range(4)] == [[1], [2, "two"], [str(i) for i in range(100_000)], [3]]
    a.close()
    b.close()


@pytest.mark.parametrize("duplex", [True, False])
def test_a_send_to_a_closed_pipe_gives_back_what_it_held(duplex):
    """A send that raises (the peer closed) leaves no descriptor open and no count in flight: a shared array's
    handle, one inside a pickle, and a fresh array's copy."""
    from mp_reductions import _recycle

    shared = mpr.share_memory(np.arange(100.0))
    seg = segment_of(shared)[0]
    a, b = mpr.Pipe(duplex=duplex)
    reader, writer = (a, b) if not duplex else (b, a)
    reader.close()
    fds, refs = len(os.listdir("/proc/self/fd")), seg.load(_recycle.REFS)
    for obj in (shared, [shared, 1], np.zeros(1 << 18)):
        for _ in range(5):
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                writer.send(obj)
    assert seg.load(_recycle.REFS) == refs
    assert len(os.listdir("/proc/self/fd")) <= fds + 1  # (the fresh array's copy segment, kept for reuse)
    writer.close()


def test_a_pool_results_done_flag_sets_once_and_wakes_every_waiter():
    """_pool.results.Done (an apply_async result's Event): set any number of times from several threads while others
    wait, with and without timeouts; every waiter returns True once set, none raises, a later wait is at once."""
    import threading

    from mp_reductions._pool.results import Done as _Done

    def call(errors, out, fn, *args):
        try:
            out.append(fn(*args))
        except BaseException as e:  # (a second set that released a waiter's hold: RuntimeError)
            errors.append(e)

    for _ in range(200):
        done, errors, woke = _Done(), [], []
        assert not done.is_set() and done.wait(0) is False and done.wait(0.001) is False
        threads = [threading.Thread(target=call, args=(errors, woke, done.wait, t)) for t in (None, 30, None, 30)]
        threads += [threading.Thread(target=call, args=(errors, [], done.set)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and woke == [True] * 4 and done.is_set() and done.wait() and done.wait(0)
