"""progress= through the facade: ``mp.ProcessPoolExecutor.map`` and ``mp.Pool.map`` draw a tqdm bar on a terminal
and nothing into a pipe, under every start method; a lambda given to the executor's submit or map goes by value
(the Pool's own maps are tested in packages/mp-reductions/tests/_progress_suite.py)."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest

import arraymp as mp

METHODS = ["spawn", "forkserver", "fork"]
TIMEOUT = 120
SAME = lambda x: x  # noqa: E731 - a module-level lambda: pickle cannot look "<lambda>" up (PicklingError)

SCRIPT = """
import sys, time
import arraymp as mp
import _work

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    with mp.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        assert list(ex.map(_work.double, range(50), chunksize=4, progress={"desc": "executor"})) == \\
            [2 * x for x in range(50)]
    with ctx.Pool(2) as pool:
        assert pool.map(_work.double, range(50), progress={"desc": "pool"}) == [2 * x for x in range(50)]
    print("results ok", flush=True)
"""


def _run(method: str, tmp_path, terminal: bool):
    script = tmp_path / "progress_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]))
    if not terminal:
        p = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=TIMEOUT,
                           env=env)
        return p.returncode, p.stdout, p.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal of 100 columns
    seen, out = [], []
    try:
        p = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE, stderr=follower, env=env)
        os.close(follower)
        follower = -1
        reader = threading.Thread(target=lambda: out.append(p.stdout.read()))
        reader.start()
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the terminal's other end closed
                break
            if not chunk:
                break
            seen.append(chunk)
        code = p.wait(timeout=TIMEOUT)
        reader.join(TIMEOUT)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    return code, out[0].decode(), b"".join(seen).decode(errors="replace")


@pytest.mark.parametrize("method", METHODS)
def test_executor_and_pool_maps_draw_a_bar_on_a_terminal_only(method, tmp_path):
    code, out, text = _run(method, tmp_path, terminal=True)
    assert code == 0, text[-3000:]
    assert out == "results ok\n"
    lines = text.replace("\r", "\n").splitlines()
    for desc in ("executor", "pool"):
        last = [line for line in lines if line.startswith(f"{desc}: ")][-1]
        assert "100%" in last and "50/50" in last and "it/s" in last, last
    code, out, err = _run(method, tmp_path, terminal=False)
    assert code == 0, err
    assert out == "results ok\n" and err == ""


@pytest.mark.parametrize("method", METHODS)
def test_a_lambda_given_to_the_executor_goes_by_value(method):
    with mp.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        assert ex.submit(SAME, 1).result(TIMEOUT) == 1  # by value (issue 43): it raised PicklingError
        assert list(ex.map(SAME, range(3), timeout=TIMEOUT)) == [0, 1, 2]
        assert ex.submit(len, [SAME, SAME]).result(TIMEOUT) == 2  # in the arguments too


NOTEBOOK_CELL = """
import arraymp as mp
with mp.Pool(2) as pool:
    print(pool.map(abs, range(-20, 0), progress={"desc": "nb"}))
"""


def test_a_notebook_gets_tqdms_widget_and_no_text_bar(tmp_path):
    # a Jupyter kernel's stderr is no terminal, yet the bar is seen there: tqdm.auto's widget (mp_reductions'
    # _progress), run in a real kernel by nbclient
    nbformat = pytest.importorskip("nbformat", reason="nbformat, nbclient, ipykernel and ipywidgets: nox -s facade")
    nbclient = pytest.importorskip("nbclient", reason="nbclient runs the notebook: nox -s facade installs it")
    pytest.importorskip("ipykernel", reason="a Jupyter kernel: nox -s facade installs ipykernel")
    pytest.importorskip("ipywidgets", reason="tqdm's notebook bar is an ipywidgets widget: nox -s facade")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL)]
    nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 1, outputs
    printed = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert printed.strip() == str(list(range(20, 0, -1)))
    assert not any(o.get("name") == "stderr" and "nb:" in o.get("text", "") for o in outputs), outputs
