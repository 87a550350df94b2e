"""The checks of an array handle's fields, each read from another process (shm_core Note [untrusted handles]):
a forged or corrupted field raises SegmentError (a ValueError) before anything is built over shared bytes."""

from __future__ import annotations

import numpy as np
import shm_core


def check_fields(size, offset, shape, strides, dtype, readonly) -> tuple[np.dtype, tuple]:
    """A handle's dtype and strides (C order when None), once every field is checked: each comes from another
    process, and a forged or corrupted one must raise SegmentError (a ValueError), never crash the receiver."""
    try:
        dtype = np.dtype(dtype)
    except Exception as exc:  # TypeError, ValueError, ...: whatever numpy makes of a forged field
        raise shm_core.SegmentError(f"array handle has dtype {dtype!r:.80}, not a numpy dtype ({exc}); "
                                    "forged or corrupted handle") from None
    if dtype.hasobject:
        # the reducer sends such arrays pickled, never as handles: an array of them over shared
        # bytes would dereference whatever those bytes say as object pointers
        raise shm_core.SegmentError(f"array handle has dtype {dtype}, which holds Python objects: such arrays never "
                                    "travel as shared memory; forged or corrupted handle, not rebuilt")
    if dtype.subdtype is not None:
        raise shm_core.SegmentError(f"array handle has subarray dtype {dtype}, which no array has (numpy moves it "
                                    "into the shape); forged or corrupted handle")
    if type(readonly) is not bool or not (size is None or type(size) is int and size >= 0) or type(offset) is not int:
        raise shm_core.SegmentError(f"array handle has readonly={readonly!r:.80}, size={size!r:.80}, offset="
                                    f"{offset!r:.80}: expected a bool, a non-negative int or None, and an int; "
                                    "forged or corrupted handle")
    if not (type(shape) is tuple and len(shape) <= 64 and all(type(n) is int and n >= 0 for n in shape)):
        raise shm_core.SegmentError(f"array handle has shape {shape!r:.80}: not a tuple of at most 64 (numpy's "
                                    "limit) non-negative ints; forged or corrupted handle")
    if too_big(shape, dtype.itemsize):
        raise shm_core.SegmentError(f"array handle has shape {shape!r:.80} of {dtype}: more bytes than an array "
                                    "can hold; forged or corrupted handle")
    if strides is None:
        strides = c_strides(shape, dtype.itemsize)
    if not (type(strides) is tuple and all(type(st) is int and abs(st) < 1 << 63 for st in strides)):
        raise shm_core.SegmentError(f"array handle has strides {strides!r:.80}: not a tuple of 64-bit ints; "
                                    "forged or corrupted handle")
    if len(strides) != len(shape):
        raise shm_core.SegmentError(f"array handle has {len(shape)} dimensions but {len(strides)} strides")
    return dtype, strides


def too_big(shape, itemsize: int) -> bool:
    """More items or bytes than an array can hold (numpy checks bytes, but takes any count of 0-byte items,
    which every loop over them then never ends)."""
    items = 1
    for n in shape:
        items *= max(n, 1)
    return items * max(itemsize, 1) >= 1 << 63


def check_extent(size: int, offset: int, shape, strides, itemsize: int) -> None:
    lo = hi = offset
    if all(n > 0 for n in shape):
        for n, st in zip(shape, strides, strict=True):
            if st < 0:
                lo += st * (n - 1)
            else:
                hi += st * (n - 1)
        hi += itemsize
    if offset < 0 or lo < 0 or hi > size:
        raise shm_core.SegmentError(f"array handle out of bounds: offset {offset}, shape {tuple(shape)}, strides "
                                    f"{tuple(strides)} span bytes [{lo}, {hi}) of a {size}-byte segment "
                                    "(forged or corrupted handle)")


def c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
