"""Any payload through every channel and start method (_pickling Note [spills], _reductions Note [small arrays]):
nested containers of arrays, bytes, bytearrays, strings and out-of-band buffers arrive identical, pickles past the
socket's message size and protocol-5 buffers through recycled segments, and nothing is left behind (the autouse
leak check: segments in /dev/shm, descriptors, children)."""

import gc
import multiprocessing
import pickle
import time

import _payload_targets as targets
import mp_reductions as mpr
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

METHODS = ["fork", "spawn", "forkserver"]
EXAMPLES = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(["<f8", ">i4", "u1", "<c16", "?", ">f2", "M8[s]"]))
    n = draw(st.sampled_from([0, 1, 7, 100, 3000, 70_000]))
    arr = (np.arange(n) % 251).astype(dtype)
    if draw(st.booleans()) and n % 7 == 0 and n:
        arr = np.asfortranarray(arr.reshape(7, -1))
    if draw(st.booleans()):
        arr = arr[::2]  # neither C nor Fortran contiguous when 2-D
    if draw(st.booleans()):
        arr.flags.writeable = False
    return arr


big = st.sampled_from([1000, 70_000, 300_000]).map(lambda n: bytes(range(256)) * (n // 256))
leaves = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=50), arrays(), big,
    big.map(bytearray), big.map(targets.ZeroCopy), st.integers(0, 200_000).map(lambda n: "é" * n))
payloads = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                        max_leaves=12)


def same(a, b) -> bool:
    """Identical: same types all the way down, equal values, arrays with equal dtype, shape and read-only flag."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (a.dtype == b.dtype and a.shape == b.shape and a.flags.writeable == b.flags.writeable
                and np.array_equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Echo:
    """A child of ``method`` that sends back what it gets over ``channel``."""

    def __init__(self, method: str, channel: str):
        ctx = multiprocessing.get_context(method)
        self.channel = channel
        if channel == "Pool":
            self.pool = mpr.Pool(1, context=ctx)
            return
        if channel == "Pipe":
            self.mine, theirs = mpr.Pipe()
            args = (theirs, theirs)
        else:
            make = mpr.Queue if channel == "Queue" else mpr.SimpleQueue
            self.out, self.back = make(), make()
            args = (self.out, self.back)
        self.proc = ctx.Process(target=targets.echo, args=args)
        self.proc.start()

    def __call__(self, obj):
        if self.channel == "Pool":
            return self.pool.apply_async(targets.identity, (obj,)).get(timeout=60)
        if self.channel == "Pipe":
            self.mine.send(obj)
            assert self.mine.poll(60), "no answer"
            return self.mine.recv()
        self.out.put(obj)
        return self.back.get(timeout=60) if self.channel == "Queue" else self.back.get()

    def close(self) -> None:
        if self.channel == "Pool":
            self.pool.close()
            self.pool.join()
            return
        (self.mine.send if self.channel == "Pipe" else self.out.put)(None)
        self.proc.join(60)
        assert self.proc.exitcode == 0


@pytest.mark.parametrize("channel", ["Queue", "SimpleQueue", "Pipe", "Pool"])
@pytest.mark.parametrize("method", METHODS)
def test_payloads_arrive_identical(method, channel):
    echo = Echo(method, channel)
    try:
        @EXAMPLES
        @given(payloads)
        def round_trip(obj):
            got = echo(obj)
            assert same(got, obj), (obj, got)
        round_trip()
    finally:
        echo.close()


@pytest.mark.parametrize("method", METHODS)
def test_arrow_tables_and_frames_arrive_identical(method):
    pa = pytest.importorskip("pyarrow")
    pd = pytest.importorskip("pandas")
    n = 200_000
    table = pa.table({"x": np.arange(n, dtype=np.float64), "s": [f"row {i}" for i in range(n)]})
    frame = pd.DataFrame({"x": np.arange(n, dtype=np.float64), "s": [f"row {i}" for i in range(n)],
                          "a": pd.array(np.arange(n), dtype="int64[pyarrow]")})
    batch = table.to_batches()[0]
    echo = Echo(method, "Queue")
    try:
        assert echo(table).equals(table)
        assert echo(batch).equals(batch)
        pd.testing.assert_frame_equal(echo(frame), frame)
        got = echo(frame)
        assert got["a"].dtype == frame["a"].dtype
    finally:
        echo.close()


def test_a_kept_arrow_column_outlives_its_table():
    """The receiver keeps a column of a received table and drops the table: the column reads what was sent while
    the sender sends more tables (which would take the column's segment back if the column did not hold it)."""
    pa = pytest.importorskip("pyarrow")
    rows = 100_000
    q = mpr.Queue()
    p = multiprocessing.get_context("spawn").Process(target=targets.send_tables, args=(q, 40, rows))
    p.start()
    try:
        table = q.get(timeout=60)
        column = table.column("a")
        del table
        gc.collect()
        time.sleep(2 * float(mpr._recycle.IDLE))  # past the sender's idle time: its pool may drop or reuse
        later = [q.get(timeout=60) for _ in range(39)]
        assert [t.column("a")[0].as_py() for t in later] == [float(k) for k in range(1, 40)]
        del later
        assert column.to_numpy().tolist() == list(np.arange(rows, dtype=np.float64))
        assert isinstance(column, pa.ChunkedArray)
    finally:
        p.join(60)
    assert p.exitcode == 0


@pytest.mark.parametrize("channel", ["Queue", "Pipe", "Pool"])
@pytest.mark.parametrize("method", METHODS)
def test_a_buffers_rebuild_gets_the_same_type_at_every_size(method, channel):
    """Issue 42 item 3 (_pickling Note [buffer rebuilds]): a user type whose __reduce_ex__(5) hands out a
    PickleBuffer is rebuilt from what pickle gives in band, a bytearray (writable) or bytes (read-only), at 1 KiB
    and at 1 MiB alike (at 1 MiB it got a memoryview of the segment, and bytearray's methods failed); numpy's
    buffers keep their zero-copy rebuild."""
    echo = Echo(method, channel)
    try:
        for n in (1 << 10, 1 << 20):
            for readonly in (False, True):
                sent = targets.Seen(bytes(range(256)) * (n // 256), readonly)
                got = echo(sent)
                assert got.kind == ("bytes" if readonly else "bytearray"), (n, readonly, got.kind)
                assert got.data == sent.data
        # a PickleBuffer sent alone: as pickle.loads(pickle.dumps(PickleBuffer(x), 5)) gives it
        for x, kind in ((bytearray(b"w" * 100_000), bytearray), (b"r" * 100_000, bytes)):
            got = echo(pickle.PickleBuffer(x))
            assert type(got) is kind and got == x
            assert type(pickle.loads(pickle.dumps(pickle.PickleBuffer(x), protocol=5))) is kind
    finally:
        echo.close()


def test_numpy_and_arrow_buffers_are_views_of_shared_memory_read_only_as_sent():
    """Out of band, numpy's and pyarrow's buffers are rebuilt over the segment (no copy on the receiver), read-only
    where the sender's was; a same-process round trip shows it."""
    pa = pytest.importorskip("pyarrow")
    q = mpr.Queue()
    a = np.arange(100_000.0)
    q.put([pickle.PickleBuffer(a), pickle.PickleBuffer(pa.py_buffer(b"r" * 100_000))])
    x, y = q.get(timeout=60)
    assert isinstance(x, memoryview) and not x.readonly and x.tobytes() == a.tobytes()
    assert isinstance(y, memoryview) and y.readonly and bytes(y) == b"r" * 100_000
    assert type(x.obj).__name__ == "Segment" and type(y.obj).__name__ == "Segment"
    del x, y
    q.close()
