"""The facade's Pool and executors: our Pool through every context, concurrent.futures over our context."""

import concurrent.futures
import os
import signal
import time

import _work
import mp_reductions
import numpy as np
import pytest

import arraymp as mp

METHODS = ["spawn", "fork", "forkserver"]


def _pid_then_sleep(slots, seconds):  # run by fork workers: found in this module
    slots[0] = os.getpid()
    time.sleep(seconds)


@pytest.mark.parametrize("method", METHODS)
def test_context_pool_is_ours_and_equals_serial(method):
    with mp.get_context(method).Pool(2) as pool:
        assert isinstance(pool, mp_reductions.Pool) and pool._ctx.get_start_method() == method
        xs = [np.full(20_000, i, np.float64) for i in range(10)]
        got = pool.map(_work.double, xs)
        assert all((g == _work.double(x)).all() and _work.via_shared_memory(g) for g, x in zip(got, xs, strict=True))
        assert sorted(float(r[0][0, 0]) for r in pool.imap_unordered(_work.make, range(6))) == list(range(6))
    pool.join()


def test_default_pool_follows_the_start_method():
    with mp.Pool(1) as pool:
        assert isinstance(pool, mp_reductions.Pool)
        assert pool._ctx.get_start_method() == mp.get_start_method()
    pool.join()


def test_dead_worker_raises_the_exported_error():
    slots = mp.zeros_shared((1,), np.int64)
    with mp.get_context("fork").Pool(2) as pool:
        r = pool.apply_async(_pid_then_sleep, (slots, 60))
        deadline = time.monotonic() + 30
        while slots[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(int(slots[0]), signal.SIGKILL)
        with pytest.raises(mp.WorkerLostError, match="SIGKILL"):
            r.get(5)
        assert pool.apply(_work.double, (3,)) == 6
    pool.join()


@pytest.mark.parametrize("method", METHODS)
def test_stdlib_executor_over_our_context_moves_arrays_by_shared_memory(method):
    xs = [np.full((200, 200), i, np.float64) for i in range(6)]  # 320 KB each
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        got = list(ex.map(_work.double, xs))
        assert all((g == 2 * x).all() for g, x in zip(got, xs, strict=True))
        assert all(_work.via_shared_memory(g) for g in got)  # results came through our SimpleQueue
        assert ex.submit(_work.double, np.ones(3)).result(30).tolist() == [2, 2, 2]
    del got


def test_short_form_executor():
    with mp.ProcessPoolExecutor(max_workers=2) as ex:
        assert ex._mp_context is mp.get_context()
        got = list(ex.map(_work.make, range(4)))
        assert [float(r[0][0, 0]) for r in got] == [0, 1, 2, 3]
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        big = ex.submit(_work.double, np.zeros((300, 300), np.float32)).result(60)
        assert _work.via_shared_memory(big) and not mp.is_shared(big) and big.shape == (300, 300)


UNGUARDED = """
import sys
import arraymp as mp

with mp.get_context(sys.argv[1]).Pool(2) as pool:  # no `if __name__ == "__main__":`
    print(pool.map(abs, [-1, -2]))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_pool_made_when_the_main_module_is_imported_names_the_guard(method, tmp_path):
    # issue 32: under spawn and forkserver (3.14's default) this is a newcomer's first error; it said "the initializer
    # raised, or a worker could not unpickle its initargs"
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    r = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert 'if __name__ == "__main__":' in last, last
    if method == "forkserver" and last.startswith("RuntimeError: the fork server exited"):
        # the fork server imports the main module itself and died there (3.13.x and 3.14 authenticate the connection
        # to it, which then breaks; on 3.11 the workers die instead)
        assert "before it could start a pool worker" in last, last
    else:
        assert last.startswith("mp_reductions.WorkerStartError"), last
        assert "most likely while importing the main module" in last
