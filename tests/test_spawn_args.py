"""Arrays as ``mp.start_processes`` arguments (issue 24): the canonical torch.multiprocessing program. A plain array
of 64 KiB or more killed every spawn / forkserver child ("process 0 terminated with exit code 1 before it could run its
function"): its temporary segment's descriptor was closed before the launcher passed it."""

import _work
import numpy as np
import pytest

import arraymp as mp


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("n", [16, 1 << 20], ids=["small", "8MiB"])
def test_arrays_as_spawn_arguments(method, strategy, shared, n):
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        a = mp.empty_shared(n) if shared else np.empty(n)
        a[:] = np.arange(n)
        out = mp.get_context(method).SimpleQueue()
        mp.start_processes(_work.train, args=(a, shared, out), nprocs=2, start_method=method)
        got = sorted(out.get() for _ in range(2))
        total = float(n * (n - 1) // 2)
        assert got == [(0, total, shared), (1, total, shared)]
        assert a[0] == (-1 if shared else 0)  # a shared array's writes are seen here; a plain one went as a copy
        out.close()
    finally:
        mp.set_sharing_strategy(old)
