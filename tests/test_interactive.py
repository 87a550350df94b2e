"""Functions and classes from an interactive session reach the workers (issue 43): a Jupyter cell, ``python -c``,
and lambdas and closures anywhere in a task, its arguments or its result, go by value (mp_reductions' _byvalue Note
[by value]) to Pool, ProcessPoolExecutor and Process targets under spawn, forkserver and fork; a script read from
stdin, which spawn and forkserver workers cannot import again, gets a message that names that cause. Before, a
cell's function failed at once under spawn and forkserver (3.14's default) with a bare ``AttributeError: Can't get
attribute 'f' on <module '__main__' (built-in)>``, and the stdin script failed inside CPython's fork server."""

import subprocess
import sys

import pytest

METHODS = ["spawn", "forkserver", "fork"]
TIMEOUT = 120

SESSION = """
import arraymp as mp

class Point:
    def __init__(self, x):
        self.x = x

def triple(x):
    return 3 * x

def run(method):
    ctx = mp.get_context(method)
    with ctx.Pool(2) as pool:
        assert pool.map(triple, range(4)) == [0, 3, 6, 9]
        assert pool.map(lambda x: x + 1, range(3)) == [1, 2, 3]
        points = pool.map(Point, range(3))
        assert all(type(p) is Point for p in points) and [p.x for p in points] == [0, 1, 2]
        assert pool.apply(triple, (5,)) == 15 and list(pool.imap(triple, range(4), chunksize=2)) == [0, 3, 6, 9]
        assert pool.apply(len, ([lambda: 1, triple],)) == 2  # in the arguments too
    with ctx.ProcessPoolExecutor(2) as ex:
        assert ex.submit(triple, 2).result() == 6 and list(ex.map(lambda x: -x, range(3))) == [0, -1, -2]
    q = ctx.Queue()
    p = ctx.Process(target=lambda q: q.put("from a lambda"), args=(q,))
    p.start()
    assert q.get(timeout=60) == "from a lambda"
    p.join(60)
    print("ok", method)
"""


@pytest.mark.parametrize("method", METHODS)
def test_python_c(method):
    r = subprocess.run([sys.executable, "-c", SESSION + f"\nrun({method!r})\n"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert (r.returncode, r.stdout.strip()) == (0, f"ok {method}"), r.stderr


@pytest.mark.parametrize("method", METHODS)
def test_a_script_read_from_stdin(method, tmp_path):
    r = subprocess.run([sys.executable, "-"], input=SESSION + f"\nrun({method!r})\n", capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=tmp_path)
    if method == "fork":  # its workers need no import of the main module
        assert (r.returncode, r.stdout.strip()) == (0, "ok fork"), r.stderr
        return
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: this script was read from <stdin>"), r.stderr
    assert "Write the script to a file" in last and "fork start method" in last


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_jupyter_kernel(method, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat, nbclient and ipykernel: nox -s facade")
    nbclient = pytest.importorskip("nbclient", reason="nbclient runs the notebook: nox -s facade installs it")
    pytest.importorskip("ipykernel", reason="a Jupyter kernel: nox -s facade installs ipykernel")
    nb = nbformat.v4.new_notebook()
    # a cell per definition, as a notebook has them; the last runs them all in a real kernel
    nb.cells = [nbformat.v4.new_code_cell(cell) for cell in SESSION.split("\n\n") if cell.strip()]
    nb.cells.append(nbformat.v4.new_code_cell(f"run({method!r})"))
    nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    assert printed.strip() == f"ok {method}", nb.cells[-1].outputs
