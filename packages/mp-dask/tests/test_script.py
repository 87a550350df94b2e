"""The README's example as a user runs it: a script whose task functions and initializer live in ``__main__``
(Note [Script namespaces] in _script.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import shm_manager

SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np

    try:
        import arraymp as mp

        def get_context(**kwargs):
            return mp.get_context("dask", **kwargs)
    except ImportError:  # mp-dask tested alone
        from mp_dask import get_context

    SCALE = None  # the script's value; the initializer sets the workers'


    def setup(cfg):
        global SCALE, OFFSET  # OFFSET: no value in the script at all
        SCALE, OFFSET = cfg["scale"], cfg["offset"]


    def shifted(a):
        return a * SCALE + OFFSET


    def f(a):
        return shifted(a)  # another function of the script: the same globals


    class Scaler:
        def __call__(self, a):
            return a * SCALE


    def read_scale(_):
        return SCALE


    if __name__ == "__main__":
        arrays = [np.arange(1 << 16, dtype=np.float32) + i for i in range(4)]  # 256 KiB: as handles
        ctx = get_context(n_workers=2, host="127.0.0.1", dashboard_address=None, local_directory=sys.argv[1])
        with ctx.Pool(4, initializer=setup, initargs=({"scale": 3, "offset": 1},)) as p:
            out = p.map(f, arrays)
            by_class = p.map(Scaler(), arrays)
            by_lambda = p.map(lambda a: a * SCALE, arrays, chunksize=1)
            imapped = list(p.imap(f, arrays))
        with ctx.ProcessPoolExecutor(2, initializer=setup, initargs=({"scale": 5, "offset": 2},)) as ex:
            executed = list(ex.map(f, arrays, chunksize=2))
            submitted = ex.submit(f, arrays[1]).result(60)
        with ctx.Pool(2) as p:
            plain = p.map(read_scale, range(4))  # another pool's initializer set nothing here
        ctx.close()
        for a, o, c, lam, i, e in zip(arrays, out, by_class, by_lambda, imapped, executed):
            np.testing.assert_array_equal(o, a * 3 + 1)
            np.testing.assert_array_equal(c, a * 3)
            np.testing.assert_array_equal(lam, a * 3)
            np.testing.assert_array_equal(i, a * 3 + 1)
            np.testing.assert_array_equal(e, a * 5 + 2)
        np.testing.assert_array_equal(submitted, arrays[1] * 5 + 2)
        assert plain == [None] * 4, plain
        print("script ok")
''')


def test_script_functions_see_the_globals_their_initializer_set(tmp_path, scratch):
    shm_manager.group()  # the script joins this group: what it leaves is the leak check's, not its exit's
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), scratch], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0 and "script ok" in run.stdout, run.stderr[-4000:]
