"""An array arrives with its dtype (byte order included) and its read-only flag, on every path: inline, copied
into shared memory, already shared; through our channels and through the stdlib's pickling (issue 15)."""

import contextlib
import pickle
from multiprocessing.reduction import ForkingPickler

import mp_reductions as mpr
import numpy as np
import pytest
from mp_reductions import _stats

DTYPES = [">i4", "<i4", ">f8", [("x", ">f4"), ("y", "<i2")]]


def _make(n, dtype, readonly, fortran):
    a = np.zeros((n, 2), dtype) if isinstance(dtype, list) else np.arange(n * 2, dtype=dtype).reshape(n, 2)
    if fortran:
        a = np.asfortranarray(a)
    a.flags.writeable = not readonly
    return a


@pytest.mark.parametrize("n", [4, 100_000])  # inline, and copied into shared memory
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("fortran", [False, True])
def test_dtype_and_writeable_survive_every_path(strategy, n, dtype, readonly, fortran):
    a = _make(n, dtype, readonly, fortran)
    q = mpr.SimpleQueue()
    q.put(a)
    got = q.get()
    # The stdlib's pickling is a channel arraymp does not own: under file_descriptor a large array goes inside the
    # pickle, which the SharingStoppedWarning says (once a process: the warning is let through here, and stays
    # said for the tests after, as when this test was the suite's first to send one so)
    expected = strategy == "file_descriptor" and a.nbytes >= mpr.get_inline_threshold()
    if expected:
        _stats._warned = False
    with pytest.warns(mpr.SharingStoppedWarning, match="on a channel arraymp does not own") if expected \
            else contextlib.nullcontext():
        via_stdlib = pickle.loads(ForkingPickler.dumps(a))
    for b in (got, via_stdlib):
        assert b.dtype == a.dtype and b.dtype.str == a.dtype.str
        assert b.flags.writeable == (not readonly)
        assert b.shape == a.shape and (b == a).all()
    q.close()
