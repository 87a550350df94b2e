"""A Pool or an executor left open when the script ends prints nothing (issue 41): the most common script there is.
Before, a Pool's ``__del__`` at exit woke its worker handler through a channel its finalizer had closed, and every
run printed ``Exception ignored in: <function Pool.__del__> ... OSError: handle is closed``. Each case runs
several times: the noise was intermittent. An executor left open finishes its calls first, as the stdlib's."""

import os
import subprocess
import sys

import _pool_targets as T
import pytest

SCRIPT = """
import sys
import mp_reductions as mpr
import _pool_targets as T

if __name__ == "__main__":
    import multiprocessing
    ctx = multiprocessing.get_context(sys.argv[1])
    if sys.argv[2] == "pool":
        p = mpr.Pool(2, context=ctx)
        print(p.map(T.square, range(10))[-1])
    elif sys.argv[2] == "pool-busy":
        p = mpr.Pool(2, context=ctx)
        print(p.map(T.square, range(10))[-1])
        p.map_async(T.nap, [5] * 4)  # still running at exit: ended with the pool, as the stdlib's
    elif sys.argv[2] == "executor":
        ex = mpr.ProcessPoolExecutor(2, mp_context=ctx)
        print(ex.submit(T.square, 9).result(), list(ex.map(T.square, range(3))))
    else:  # executor-busy: its call finishes before the interpreter exits, as the stdlib's
        ex = mpr.ProcessPoolExecutor(2, mp_context=ctx)
        ex.submit(T.nap_then_print, 0.5, "finished")
"""


@pytest.mark.parametrize("case, out", [("pool", "81"), ("pool-busy", "81"), ("executor", "81 [0, 1, 4]"),
                                       ("executor-busy", "finished")])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_left_open_at_exit_prints_nothing(tmp_path, method, case, out):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(T.__file__), *sys.path])}
    for _ in range(4):
        r = subprocess.run([sys.executable, str(script), method, case], capture_output=True, text=True, timeout=120,
                           env=env)
        assert (r.returncode, r.stderr, r.stdout.strip()) == (0, "", out)
