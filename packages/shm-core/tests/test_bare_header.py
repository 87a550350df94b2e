"""pack_array / array_from: the layout of a bare array's header (mp_reductions Note [bare arrays]) and the
checks that a received one names an array; every field comes from another process."""

import random
import struct

import numpy as np
import pytest
import shm_core

READONLY, FORTRAN, STRIDES = 1, 2, 4
BOUNDS = getattr(np.lib, "array_utils", np).byte_bounds  # numpy 2, numpy 1


def arrays():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    yield base
    yield np.asfortranarray(base)
    yield base[::2, ::-3]  # strided, reversed
    yield base.T
    yield np.full((), 7.5)  # 0-d
    yield np.zeros((0, 3), ">i2")
    yield np.arange(6, dtype=">i2").reshape(2, 3)
    yield np.frombuffer(b"abcdefghi", "V3")
    yield np.empty((5, 2), "V0")
    yield np.array(["ab", "c"], "U2")
    yield np.array([b"xy"], "S2")
    yield np.array(["2026-12-01T00:00"], "M8[ns]")
    yield np.array([1 + 2j], "c16")
    yield np.array([True, False])
    ro = np.arange(5, dtype=np.int32)
    ro.flags.writeable = False
    yield ro


def inline(arr, flags=None):
    if flags is None:
        flags = (not arr.flags.writeable) | (FORTRAN if arr.flags.f_contiguous and not arr.flags.c_contiguous else 0)
    return shm_core.pack_array(b"A", arr, arr.dtype.str.encode(), flags, True)


@pytest.mark.parametrize("arr", list(arrays()), ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_an_array_and_its_bytes_round_trip(arr):
    got = shm_core.array_from(inline(arr), 1, None, 0)
    assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes()
    assert got.flags.writeable == arr.flags.writeable and got.flags.owndata
    if arr.flags.f_contiguous and not arr.flags.c_contiguous:
        assert got.flags.f_contiguous


def test_a_view_round_trips_over_the_same_memory():
    seg = shm_core.create_anonymous(4096)
    mv = memoryview(seg)
    whole = np.frombuffer(mv, np.float64).reshape(32, 16)
    for arr in (whole, whole[3:9:2, ::-2], whole.T, whole[5, 7:8], whole[1:1]):
        offset = shm_core.address(arr) - shm_core.address(whole)
        flags = 0 if arr.flags.c_contiguous else STRIDES
        head = shm_core.pack_array(b"xyz", arr, b"<f8", flags, False)
        assert head[:3] == b"xyz" and len(head) == 3 + 3 + 3 + 8 * arr.ndim * (2 if flags else 1)
        got = shm_core.array_from(head, 3, mv, offset)
        assert got.base is mv and got.shape == arr.shape and got.flags.writeable
        assert BOUNDS(got) == BOUNDS(arr) or not arr.size
        np.testing.assert_array_equal(got, arr)
        ro = shm_core.array_from(shm_core.pack_array(b"", arr, b"<f8", flags | READONLY, False), 0, mv, offset)
        assert not ro.flags.writeable
        del got, ro
    del whole, arr
    mv.release()
    seg.close()


def test_a_view_of_an_ndarray_keeps_it_as_its_base():
    base = np.zeros(100, np.uint8)
    got = shm_core.array_from(shm_core.pack_array(b"", np.zeros(3, "<i4"), b"<i4", 0, False), 0, base, 8)
    assert got.base is base and shm_core.address(got) == shm_core.address(base) + 8
    with pytest.raises(TypeError, match="memoryview or an ndarray"):
        shm_core.array_from(shm_core.pack_array(b"", np.zeros(3, "<i4"), b"<i4", 0, False), 0, b"x" * 100, 0)


def header(code: bytes, shape, strides=(), flags=0, ndim=None, tail=b"") -> bytes:
    return (struct.pack("<BBB", flags, len(code), len(shape) if ndim is None else ndim) + code
            + struct.pack(f"<{len(shape)}q", *shape) + struct.pack(f"<{len(strides)}q", *strides) + tail)


@pytest.mark.parametrize("data, match", [
    (header(b"|O8", (1,), tail=bytes(8)), "Python objects"),
    (header(b"f8,O", (1,), tail=bytes(16)), "Python objects"),
    (header(b"i4,f8", (1,), tail=bytes(12)), "fields"),
    (header(b"(2,)i4", (1,), tail=bytes(8)), "subarray"),
    (header(b"<U0", (3,)), "unsized"),
    (header(b"T", (1,), tail=bytes(16)), "Python objects"),
    (header(b"zz9", (1,), tail=bytes(8)), "names no dtype"),
    (header(b"\xff", (1,), tail=bytes(1)), "not ASCII"),
    (header(b"<f8", (-1,)), "negative"),
    (header(b"<f8", (1 << 40, 1 << 40)), "more items"),
    (header(b"V0", (1 << 40, 1 << 40)), "more items"),
    (header(b"<f8", (2,), tail=bytes(15)), "not the array's"),
    (header(b"<f8", (2,), tail=bytes(17)), "not the array's"),
    (header(b"<f8", (1,), flags=STRIDES, tail=bytes(8)), "flags"),
    (header(b"<f8", (1,), flags=8, tail=bytes(8)), "flags"),
    (header(b"<f8", (1,) * 65, tail=bytes(8)), "dimensions"),
    (header(b"<f8", (1,), ndim=3, tail=bytes(8)), "cut short"),
])
def test_a_header_that_names_no_array_is_refused(data, match):
    if b"T" == data[3:4] and not hasattr(np, "dtypes"):
        pytest.skip("numpy 1 has no string dtype")
    with pytest.raises(ValueError, match=match):
        shm_core.array_from(data, 0, None, 0)


@pytest.mark.parametrize("shape, strides, offset", [
    ((8,), (8,), 4040),  # past the end
    ((8,), (8,), -8),
    ((2,), (-8,), 0),  # before the start
    ((2, 2), (1 << 62, 8), 0),
    ((2,), (-(1 << 63),), 8),
    ((3,), (1 << 62,), 0),
])
def test_a_view_outside_its_buffer_is_refused(shape, strides, offset):
    mv = memoryview(bytearray(4096))
    with pytest.raises(ValueError, match="out of bounds|stride"):
        shm_core.array_from(header(b"<f8", shape, strides, flags=STRIDES), 0, mv, offset)
    with pytest.raises(ValueError, match="flags"):  # Fortran order: for an array's bytes only
        shm_core.array_from(header(b"<f8", (1,), flags=FORTRAN), 0, mv, 0)


def test_every_prefix_of_a_header_is_refused():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]
    mv = memoryview(bytearray(64))
    for data, buffer in [(inline(arr), None), (shm_core.pack_array(b"A", arr, b"<i2", STRIDES, False), mv)]:
        shm_core.array_from(data, 1, buffer, 0)
        for n in range(len(data)):
            with pytest.raises(ValueError):
                shm_core.array_from(data[:n], 1, buffer, 0)


def test_random_corruptions_give_an_array_inside_its_buffer_or_a_value_error():
    """Random bytes flipped in good headers: never a crash, never an array past its buffer."""
    rng = random.Random(2026)
    mv = memoryview(bytearray(512))
    goods = [(inline(a), None) for a in arrays()]
    goods += [(shm_core.pack_array(b"", a, b"<f8", STRIDES, False), mv)
              for a in (np.zeros((4, 4))[::2, ::-1], np.zeros(3))]
    made = refused = 0
    for _ in range(20000):
        data, buffer = rng.choice(goods)
        data = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        try:
            got = shm_core.array_from(bytes(data), 0, buffer, rng.choice([0, 8, 64]))
        except ValueError:
            refused += 1
            continue
        made += 1
        if buffer is not None and got.size:
            lo, hi = BOUNDS(got)
            start = shm_core.address(np.frombuffer(mv, np.uint8))
            assert start <= lo <= hi <= start + len(mv)
        else:
            got.tobytes()
    assert made and refused
