"""progress= on the Pool's maps and executor_map, and the hint on a lambda's pickling error; bound to a start
method by test_progress_<method>.py."""

import multiprocessing
import os
import pathlib
import subprocess
import sys
import threading

import _pool_targets as T
import mp_reductions as mpr
import pytest

HERE = pathlib.Path(__file__).parent
SCRIPT = HERE / "_progress_script.py"
TIMEOUT = 120
# lambdas at module level: pickle would look "<lambda>" up in this module and fail (PicklingError; a lambda made
# in a function is a local object: AttributeError up to 3.12); ours sends them by value
ONE, SAME, FIRST = (lambda: 1), (lambda x: x), (lambda x, y: x)
DESCS = ["map-chunks", "map-async", "starmap", "starmap-async", "imap-gen", "imap-chunks", "unordered",
         "unordered-chunks", "executor", "executor-buffered"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_on_terminal(args: list[str], columns: int = 120) -> tuple[int, str, str]:
    """Run ``python args`` with stderr on a pseudo-terminal of ``columns`` columns: its exit code, stdout, and
    everything written to the terminal."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    seen = []
    try:
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=follower, env=_env())
        os.close(follower)
        follower = -1
        out = []
        reader = threading.Thread(target=lambda: out.append(p.stdout.read()))  # stdout must not fill either
        reader.start()
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's other end exited
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


def final_lines(text: str) -> dict[str, str]:
    """The last drawing of each bar, by its desc (a bar without one under "")."""
    last = {}
    for line in text.replace("\r", "\n").splitlines():
        if "|" not in line:
            continue
        desc = line.split(":", 1)[0].strip() if ": " in line.split("|", 1)[0] else ""
        last[desc] = line
    return last


class ProgressSuite:
    method = None

    @pytest.fixture
    def ctx(self):
        return multiprocessing.get_context(self.method)

    def test_bars_are_drawn_on_a_terminal(self):
        pytest.importorskip("tqdm")
        code, out, text = run_on_terminal([str(SCRIPT), self.method])
        assert code == 0, text[-3000:]
        assert out == "results ok\n"
        assert "\r" in text
        last = final_lines(text)
        for desc in ["", *DESCS]:
            assert desc in last, (desc, text[-3000:])
            line = last[desc]
            assert "100%" in line and "60/60" in line and "it/s" in line, line  # count, rate
        assert "00:00<?" in text or "<00:0" in text  # the ETA column

    def test_no_bar_when_stderr_is_a_pipe(self):
        pytest.importorskip("tqdm")
        p = subprocess.run([sys.executable, str(SCRIPT), self.method], capture_output=True, text=True,
                           timeout=TIMEOUT, env=_env())
        assert p.returncode == 0, p.stderr
        assert p.stdout == "results ok\n"
        assert p.stderr == ""  # nothing from tqdm: no bar, no redraw

    def test_nothing_imported_or_drawn_when_not_asked(self):
        code = ("import sys, multiprocessing, mp_reductions as mpr, _pool_targets as T\n"
                f"ctx = multiprocessing.get_context({self.method!r})\n"
                "with mpr.Pool(2, context=ctx) as pool:\n"
                "    assert pool.map(T.square, range(20), progress=False) == [x * x for x in range(20)]\n"
                "    assert list(pool.imap(T.square, range(20))) == [x * x for x in range(20)]\n"
                "    assert pool.starmap_async(T.add, [(1, 2)] * 5, 2, None, None).get(60) == [3] * 5\n"
                "assert 'tqdm' not in sys.modules, 'tqdm imported'\n"
                "print('ok')\n")
        code_, out, text = run_on_terminal(["-c", code])
        assert code_ == 0 and out == "ok\n", text
        assert text == ""

    def test_without_tqdm_progress_says_how_to_install_it_and_the_pool_goes_on(self):
        code = ("import sys, multiprocessing, mp_reductions as mpr, _pool_targets as T\n"
                "sys.modules['tqdm'] = None  # as if not installed\n"
                f"ctx = multiprocessing.get_context({self.method!r})\n"
                "with mpr.Pool(2, context=ctx) as pool:\n"
                "    for call in (lambda: pool.map(T.square, range(5), progress=True),\n"
                "                 lambda: pool.imap(T.square, range(5), progress={'desc': 'x'})):\n"
                "        try:\n"
                "            call()\n"
                "        except ImportError as e:\n"
                "            print(e)\n"
                "    assert pool.map(T.square, range(5)) == [0, 1, 4, 9, 16]\n"
                "    pool.close()\n"
                "    pool.join()  # no result left pending by the failed calls\n")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                           env=_env())
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert len(lines) == 2 and all("`pip install tqdm`" in line for line in lines), p.stdout

    def test_terminate_closes_an_unfinished_bar(self, ctx):
        pytest.importorskip("tqdm")
        import io

        buf = io.StringIO()
        with mpr.Pool(2, context=ctx) as pool:
            result = pool.map_async(T.nap, [0.01] * 2 + [60] * 2, 1, progress={"file": buf, "disable": False})
            bar = result._progress
            assert not bar.closed
        assert bar.closed  # the with block terminated the pool
        assert not result.ready()

    def test_failed_items_are_counted_apart_and_the_bar_closes(self, ctx):
        pytest.importorskip("tqdm")
        import io

        buf = io.StringIO()
        with mpr.Pool(2, context=ctx) as pool:
            result = pool.map_async(T.fail, range(10), 2, progress={"file": buf, "disable": False})
            with pytest.raises(ValueError):
                result.get(TIMEOUT)
            assert result._progress.closed
        assert "failed=10" in buf.getvalue().replace("\r", "\n").splitlines()[-1]

    @pytest.mark.parametrize("call", ["map", "imap", "imap_unordered", "starmap", "apply_async"])
    def test_a_lambda_as_the_pools_function_goes_by_value(self, ctx, call):
        # issue 43: a lambda or local function as a pool's function travels by value (cloudpickle, as loky sends
        # it), under every start method (_byvalue Note [by value]); it failed with a hint to define it with def
        def local(x, y=0):
            return x + y

        with mpr.Pool(2, context=ctx) as pool:
            if call == "apply_async":
                assert [pool.apply_async(f, (3,)).get(TIMEOUT) for f in (SAME, local)] == [3, 3]
            elif call == "starmap":
                assert [pool.starmap(f, [(1, 2)] * 3) for f in (FIRST, local)] == [[1, 1, 1], [3, 3, 3]]
            else:
                assert [sorted(getattr(pool, call)(f, range(3))) for f in (SAME, local)] == [[0, 1, 2]] * 2

    def test_lambdas_and_local_classes_in_arguments_and_results_go_by_value(self, ctx):
        class Local:
            def __init__(self, x):
                self.x = x

        with mpr.Pool(2, context=ctx) as pool:
            assert pool.apply_async(T.call_each, ([ONE, SAME],)).get(TIMEOUT) == [1, None]
            got = pool.map(T.identity, [Local(1), Local(2)])
            assert [type(g) is Local and g.x for g in got] == [1, 2]  # the same class came back

    def test_what_pickle_cannot_send_by_value_either_fails_as_in_the_stdlib(self, ctx):
        with mpr.Pool(2, context=ctx) as pool:
            with pytest.raises(TypeError):
                pool.apply(T.identity, (threading.Lock(),))
            assert pool.map(T.square, range(3)) == [0, 1, 4]  # the pool goes on
