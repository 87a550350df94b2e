"""Note [bare arrays] (_bare): a message that is one array alone goes with no pickle, a small one as its bytes, a
shared one as its handle; what arrives is what the pickled form would rebuild, on every channel of ours."""

import pickle

import hypothesis.extra.numpy as hnp
import mp_reductions as mpr
import numpy as np
import pytest
import shm_core
from _views import via_shared_memory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mp_reductions import _channel, _recycle, _shared

BOUNDS = getattr(np.lib, "array_utils", np).byte_bounds  # numpy 2, numpy 1
SETTINGS = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

DTYPES = st.one_of(hnp.boolean_dtypes(), hnp.integer_dtypes(endianness="="), hnp.unsigned_integer_dtypes(),
                   hnp.floating_dtypes(endianness="="), hnp.complex_number_dtypes(), hnp.datetime64_dtypes(),
                   hnp.timedelta64_dtypes(), hnp.byte_string_dtypes(max_len=4), hnp.unicode_string_dtypes(max_len=3),
                   st.sampled_from([np.dtype("V0"), np.dtype("V3"), np.dtype(">f8"), np.dtype(">i2")]))


@st.composite
def small_arrays(draw):
    """Arrays as users send them: any shape up to 4 dimensions (zeros too), C or Fortran order, strided views,
    read-only or not."""
    dtype = draw(DTYPES)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    if dtype.kind == "V":  # raw bytes (hypothesis draws no elements of these)
        n = int(np.prod(shape)) * dtype.itemsize
        arr = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype).reshape(shape).copy() \
            if dtype.itemsize else np.empty(shape, dtype)
    else:
        arr = draw(hnp.arrays(dtype, shape))
    if draw(st.booleans()):
        arr = np.asfortranarray(arr)
    if arr.ndim and draw(st.booleans()):
        arr = arr[tuple(slice(None, None, draw(st.sampled_from([1, 2, -1]))) for _ in range(arr.ndim))]
    if draw(st.booleans()):
        arr.flags.writeable = False
    return arr


@pytest.fixture(scope="module")
def channels():
    q, sq = mpr.Queue(), mpr.SimpleQueue()
    a, b = mpr.Pipe()  # a stream
    c, d = mpr.Pipe(duplex=False)
    pairs = {"Queue": (q.put, q.get), "SimpleQueue": (sq.put, sq.get), "Pipe": (a.send, b.recv),
             "Pipe(duplex=False)": (d.send, c.recv)}
    yield pairs
    q.close()
    sq.close()
    for conn in (a, b, c, d):
        conn.close()


def same_as_pickled(got, sent) -> None:
    want = pickle.loads(pickle.dumps(sent, 4))
    assert type(got) is np.ndarray and got.dtype == sent.dtype and got.shape == sent.shape
    assert got.tobytes() == sent.tobytes()  # bit for bit (NaNs, NaTs, raw bytes, byte order too)
    assert got.flags.writeable == sent.flags.writeable  # numpy's own pickle loses read-only (and byte order)
    if sent.nbytes:  # (the order of no bytes is numpy's choice)
        assert (got.flags.c_contiguous, got.flags.f_contiguous) == (want.flags.c_contiguous, want.flags.f_contiguous)
    assert not mpr.is_shared(got)


@SETTINGS
@given(arr=small_arrays())
def test_small_arrays_travel_bare_and_arrive_as_their_pickle(channels, arr):
    assert _channel.Packet(arr).buffers[1][:1] == b"A"  # bare: no pickle made
    for send, recv in channels.values():
        send(arr)
        same_as_pickled(recv(), arr)


@st.composite
def shared_arrays(draw):
    """Shared arrays as users send them: in a segment of their own (share_memory) or an arena block (empty_shared
    of a small array), whole or any view (strided, reversed, transposed, Fortran order, a 0-d item), read-only
    or not."""
    dtype = draw(DTYPES.filter(lambda dt: dt.itemsize > 0))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=6))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype).reshape(shape)
    if draw(st.booleans()):
        arr = mpr.share_memory(raw)
    else:
        arr = mpr.empty_shared(shape, dtype)
        arr[...] = raw
    if arr.ndim and draw(st.booleans()):
        arr = arr[tuple(slice(None, None, draw(st.sampled_from([1, 2, -1]))) for _ in range(arr.ndim))]
    if draw(st.booleans()):
        arr = arr.T
    if arr.ndim and draw(st.booleans()):
        arr = arr[(0,) * arr.ndim + (...,)]  # a 0-d view of one item
    if draw(st.booleans()):
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def counts(arr) -> tuple[int, int | None]:
    """The in-flight word of arr's segment and its arena block's count (None: no arena)."""
    seg, _ = _shared.segment_of(arr)
    block = _shared.block_of(arr, seg)
    return seg.load(_recycle.REFS), None if block is None else seg.load(shm_core.HEADER_SIZE + block)


def strides(arr) -> list[int]:
    """The strides that matter (numpy's contiguity ignores those of dimensions of one item)."""
    return [st for st, n in zip(arr.strides, arr.shape, strict=True) if n > 1]


@SETTINGS
@given(arr=shared_arrays())
def test_shared_arrays_travel_as_bare_handles_and_arrive_as_views_of_them(channels, arr):
    before = counts(arr)
    packet = _channel.Packet(arr)
    assert packet.buffers[0] == b"H" and packet.buffers[1][:1] == b"B" and len(packet.fds) == 1  # bare: no pickle
    assert counts(arr)[0] == before[0] + 1  # in flight
    packet.discard()
    assert counts(arr) == before
    for send, recv in channels.values():
        send(arr)
        got = recv()
        assert type(got) is np.ndarray and got.dtype == arr.dtype and got.shape == arr.shape
        assert strides(got) == strides(arr) and got.tobytes() == arr.tobytes()
        assert BOUNDS(got) == BOUNDS(arr) and mpr.is_shared(got)  # a view of the same memory, no copy
        assert got.flags.writeable == arr.flags.writeable
        if got.flags.writeable:
            saved = arr.copy()
            got[...] = np.zeros((), got.dtype)
            assert arr.tobytes() == np.zeros(arr.shape, arr.dtype).tobytes()  # written through
            arr[...] = saved
        else:
            with pytest.raises(ValueError, match="read-only"):
                got[...] = np.zeros((), got.dtype)
            if before[1] is None:  # a segment of its own: read-only for good (an arena block's base is writable)
                with pytest.raises(ValueError, match="WRITEABLE"):
                    got.flags.writeable = True
        del got
        assert counts(arr) == before  # each message's in-flight counts given back once


def test_bare_arrays_are_copies_taken_at_send():
    q = mpr.Queue()
    try:
        a = np.arange(8.0)
        q.put(a)
        a[:] = -1  # after put: the message holds what a was then
        b = q.get(timeout=10)
        assert b.tolist() == list(range(8)) and b.flags.writeable
        b[0] = 5  # writable and its own memory
        assert a[0] == -1
    finally:
        q.close()


class Sub(np.ndarray):
    pass


@pytest.mark.parametrize("make", [
    lambda: np.array([1, None], dtype=object),  # Python objects: pickled
    lambda: np.zeros(2, [("a", "i4"), ("b", "f8")]),  # fields: the dtype string would lose them
    lambda: np.zeros(2, np.dtype("f8", metadata={"unit": "m"})),  # metadata: the string would lose it
    lambda: np.arange(4.0).view(Sub),  # a subclass: pickled as itself
    lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]),
    lambda: np.zeros(64 * 1024, np.uint8),  # at the inline threshold: by shared memory
    lambda: mpr.share_memory(np.arange(10)),  # shared already: a handle
], ids=["object", "fields", "metadata", "subclass", "masked", "threshold", "shared"])
def test_what_is_not_bare_is_pickled_and_arrives_whole(make):
    arr = make()
    packet = _channel.Packet(arr)
    assert not (packet.buffers[0] == b"P" and bytes(packet.buffers[1][:1]) == b"A")  # not bare
    packet.discard()
    q = mpr.Queue()
    try:
        q.put(arr)
        got = q.get(timeout=10)
        assert type(got) is type(arr) and got.dtype == arr.dtype and np.array_equal(got, arr)
        if isinstance(arr, np.ma.MaskedArray):
            assert got.mask.tolist() == arr.mask.tolist()
    finally:
        q.close()


def test_the_inline_threshold_decides_for_bare_arrays_too():
    a = np.arange(100, dtype=np.uint8)
    mpr.set_inline_threshold(0)
    try:
        q = mpr.Queue()
        q.put(a)
        assert via_shared_memory(q.get(timeout=10))  # every non-empty array by shared memory, as pickled ones
        q.close()
    finally:
        mpr.set_inline_threshold(64 * 1024)


def _as_list(arr):
    return list, (arr.tolist(),)


def test_a_reducer_registered_in_place_of_ours_is_honoured():
    from multiprocessing.reduction import ForkingPickler

    from mp_reductions._reductions import reduce_ndarray

    ForkingPickler.register(np.ndarray, _as_list)
    q = mpr.Queue()
    try:
        q.put(np.arange(3))
        assert q.get(timeout=10) == [0, 1, 2]  # the user's reduction, not a bare array
    finally:
        ForkingPickler.register(np.ndarray, reduce_ndarray)
        q.close()
