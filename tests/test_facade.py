import contextlib
import importlib.util
import multiprocessing
import os
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import _work
import mp_reductions
import numpy as np
import pytest
from mp_reductions import _stats

import arraymp as mp


def test_every_stdlib_name_is_there():
    missing = [n for n in multiprocessing.__all__ if not hasattr(mp, n)]
    assert missing == []
    assert set(multiprocessing.__all__) <= set(mp.__all__)
    assert mp.Process is multiprocessing.Process and mp.cpu_count() == multiprocessing.cpu_count()


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_contexts_are_ours(method):
    ctx = mp.get_context(method)
    assert ctx.get_start_method() == method
    assert isinstance(ctx.Queue(), mp_reductions.Queue)
    assert isinstance(ctx.JoinableQueue(), mp_reductions.JoinableQueue)
    q = ctx.SimpleQueue()
    assert isinstance(q, mp_reductions.SimpleQueue)
    q.close()
    a, b = ctx.Pipe()
    assert isinstance(a, mp_reductions.Connection)
    a.close()
    b.close()
    assert ctx.get_context() is ctx and mp.get_context(method) is ctx
    with pytest.raises(ValueError):
        mp.get_context("threads")


def test_default_context_follows_the_stdlib_start_method():
    assert mp.get_start_method() == multiprocessing.get_start_method()
    assert mp.get_context().get_start_method() == multiprocessing.get_start_method()
    assert isinstance(mp.Queue(), mp_reductions.Queue)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_reductions_registered_once_with_forkingpickler(strategy):
    # outside our channels (a bare ForkingPickler, the stdlib's Queue and Pipe) a named segment travels by name,
    # an array of a memfd one as a copy: its descriptor would be served by a sender that may be gone (issue 24)
    assert ForkingPickler._extra_reducers[np.ndarray] is mp_reductions.reduce_ndarray
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        x = mp.zeros_shared((10_000,))
        # (the copy says so: SharingStoppedWarning, once a process, let through here and left said for the tests after)
        if strategy == "file_descriptor":
            _stats._warned = False
        with pytest.warns(mp.SharingStoppedWarning, match="on a channel arraymp does not own") \
                if strategy == "file_descriptor" else contextlib.nullcontext():
            y = ForkingPickler.loads(ForkingPickler.dumps(x))
        y[0] = 1
        assert x[0] == (1 if strategy == "file_system" else 0)
    finally:
        mp.set_sharing_strategy(old)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                    reason="cupy is not installed (the facade's cuda12 extra; cupy-cuda12x has no wheel for 3.15 yet)")
def test_cupy_reducer_registered_when_cupy_is_imported_not_before():
    # importing arraymp must not import cupy (slow) nor initialise CUDA (breaks CUDA in fork children)
    code = ("import sys, arraymp\n"
            "from multiprocessing.reduction import ForkingPickler as F\n"
            "print(sys.modules.get('cupy') is not None)\n"
            "import cupy, shm_cuda\n"
            "print(F._extra_reducers.get(cupy.ndarray) is shm_cuda.reduce_cupy_array)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_sharing_strategy_api():
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert mp.get_sharing_strategy() == "file_descriptor"
    with pytest.raises(ValueError, match="valid ones are: file_descriptor, file_system"):
        mp.set_sharing_strategy("nope")


def test_shared_constructors():
    a = mp.empty_shared((3, 4), np.int32)
    z = mp.zeros_shared((3, 4), np.int32, order="F")
    assert mp.is_shared(a) and mp.is_shared(z) and (z == 0).all() and z.flags.f_contiguous
    assert not mp.is_shared(np.zeros(3)) and not mp.is_shared([1, 2])
    with pytest.raises(TypeError, match="Python objects"):
        mp.empty_shared(3, object)


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_pool_moves_arrays_like_serial(method):
    with mp.get_context(method).Pool(2) as pool:
        got = pool.map(_work.double, [np.full(50_000, i, np.float64) for i in range(8)])
        assert [float(g[0]) for g in got] == [2.0 * i for i in range(8)]
        assert all(_work.via_shared_memory(g) and not mp.is_shared(g) for g in got)  # by shared memory, own
        assert [r[0][0, 0] for r in pool.imap(_work.make, range(6))] == list(range(6))
        assert pool.apply_async(_work.double, (np.ones(3),)).get(30).tolist() == [2, 2, 2]
    pool.join()


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_process_interrupt_on_every_version(method):
    """3.14's Process.interrupt(): SIGINT, on 3.11-3.13 too (added to the stdlib's class, which mp.Process is)."""
    ctx = mp.get_context(method)
    ready = ctx.Event()
    p = ctx.Process(target=_work.wait_for_sigint, args=(ready,))
    with pytest.raises((ValueError, AttributeError)):  # ours says "not been started"; 3.14's has no popen yet
        p.interrupt()
    p.start()
    assert ready.wait(60)
    p.interrupt()
    p.join(60)
    assert p.exitcode == 7  # the target's SIGINT handler ran
    p.interrupt()  # exited: nothing to do, as terminate()
    p.close()
    with pytest.raises(ValueError, match="closed"):
        p.interrupt()


def test_spawn_is_reexported():
    import mp_spawn

    assert mp.spawn is mp_spawn.spawn and mp.start_processes is mp_spawn.start_processes
    assert mp.ProcessRaisedException is mp_spawn.ProcessRaisedException


def test_main_module_runs():
    out = subprocess.run([sys.executable, "-m", "arraymp", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "doctor" in out.stdout and "demo" in out.stdout and "bench" in out.stdout
    out = subprocess.run([sys.executable, "-m", "arraymp", "bench", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "torch" in out.stdout
    out = subprocess.run([sys.executable, "-m", "arraymp", "doctor", "--nope"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr


def test_demo_quick_runs():
    out = subprocess.run([sys.executable, "-m", "arraymp", "demo", "--quick"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "speed-up" in out.stdout and "pipeline" in out.stdout and "pool" in out.stdout


_IMPORT_ONLY = """
import os, numpy as np
import arraymp as mp
d = os.environ["ARRAYMP_SHM_DIR"]
seen = sorted(os.listdir(d)) if os.path.isdir(d) else None
q = mp.Queue()  # the default strategy (file_descriptor) names nothing: it works whatever the shm dir
q.put(np.arange(100_000.0))
assert q.get().sum() == sum(range(100_000)) and mp.is_shared(mp.empty_shared(1000))
try:
    mp.set_sharing_strategy("file_system")  # the first use of the directory: it says what to do
    mp.empty_shared(100_000)
except OSError as exc:
    print("error:", exc)
print("seen:", seen)
"""


def test_import_leaves_nothing_in_the_shm_dir(tmp_path):
    # issue 12: `import arraymp` wrote a lock file; only a named segment may touch the shm dir
    env = {k: v for k, v in os.environ.items() if k != "ARRAYMP_GROUP"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], capture_output=True, text=True, timeout=120,
                         env=dict(env, ARRAYMP_SHM_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "seen: []" in out.stdout and "error:" not in out.stdout
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []  # the group ended: no segment,
    assert set(os.listdir(tmp_path / f".arraymp-{os.getuid()}")) <= {"manager.log"}  # no lock, no socket


def test_import_survives_a_bad_shm_dir_and_file_system_says_what_to_do():
    # issue 12: ARRAYMP_SHM_DIR=/nonexistent/shm made `import arraymp` raise FileNotFoundError
    env = {k: v for k, v in os.environ.items() if k != "ARRAYMP_GROUP"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], capture_output=True, text=True, timeout=120,
                         env=dict(env, ARRAYMP_SHM_DIR="/nonexistent/shm"))
    assert out.returncode == 0, out.stderr
    error = out.stdout.split("error:")[1]
    assert "/nonexistent/shm" in error and "ARRAYMP_SHM_DIR" in error and "file_descriptor" in error
