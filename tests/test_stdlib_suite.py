"""What code written for multiprocessing finds in arraymp: its submodules, its classes for isinstance and subclassing,
and the ProcessPoolExecutor's choice of context. CPython's own tests over our objects: nox -s stdlib_suite."""

import multiprocessing
import multiprocessing.connection
import multiprocessing.pool
import multiprocessing.queues
import os
import pathlib
import subprocess
import sys

import mp_reductions

import arraymp as mp


def test_submodules_are_there_as_in_multiprocessing():
    # a fresh interpreter: nothing imported the submodules before (multiprocessing.X after `import multiprocessing`)
    code = ("import arraymp as mp, multiprocessing.pool, multiprocessing.util\n"
            "assert mp.pool.ThreadPool is multiprocessing.pool.ThreadPool\n"
            "assert mp.connection.wait is multiprocessing.connection.wait\n"
            "assert mp.util._cleanup_tests is multiprocessing.util._cleanup_tests\n"  # private names too
            "import arraymp.managers, arraymp.shared_memory\n"
            "from arraymp.queues import *\n"
            "print(Queue.__module__, mp.pool.Pool.__module__, mp.managers.SyncManager.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mp_reductions._queues", "mp_reductions._pool.pool", "multiprocessing.managers"]


def test_ours_are_instances_of_the_stdlib_classes():
    with mp.Pool(1) as pool:
        assert isinstance(pool, multiprocessing.pool.Pool)
        r, m = pool.apply_async(abs, (-1,)), pool.map_async(abs, [-1])
        assert isinstance(r, multiprocessing.pool.AsyncResult) and isinstance(m, multiprocessing.pool.MapResult)
        assert isinstance(pool.imap(abs, [-1]), multiprocessing.pool.IMapIterator)
        assert isinstance(pool.imap_unordered(abs, [-1]), multiprocessing.pool.IMapUnorderedIterator)
        assert (r.get(60), m.get(60)) == (1, [1]) and mp.pool.MapResult is type(m)
    q, (a, b) = mp.Queue(), mp.Pipe()
    assert isinstance(q, multiprocessing.queues.Queue) and isinstance(q, mp.queues.Queue)
    assert isinstance(a, multiprocessing.connection.Connection) and isinstance(a, mp.connection.Connection)
    assert mp.connection.wait([a], timeout=0) == []
    for chan in (q, a, b):
        chan.close()


class SafeQueue(mp.queues.Queue):
    """The stdlib's pattern for unpicklable items (bpo-30006), written against arraymp."""

    @staticmethod
    def _on_queue_feeder_error(e, obj):
        obj.hooked = e


class Unpicklable:
    hooked = None

    def __reduce__(self):
        raise AttributeError("no")


def test_the_stdlib_feeder_error_pattern_works():
    q = SafeQueue(ctx=mp.get_context())
    bad = Unpicklable()
    q.put(bad)
    q.put(True)
    assert q.get(timeout=60) is True and isinstance(bad.hooked, AttributeError)
    q.close()
    assert issubclass(SafeQueue, mp_reductions.Queue)


def test_executor_with_max_tasks_per_child_picks_spawn_as_the_stdlibs():
    # under the fork default, as concurrent.futures' own: spawn, since fork cannot replace workers safely.
    # Fewer tasks than max_tasks_per_child: CPython 3.11's own executor can hang when a worker retires.
    code = ("import multiprocessing, arraymp as mp\n"
            "multiprocessing.set_start_method('fork')\n"
            "with mp.ProcessPoolExecutor(1, max_tasks_per_child=3) as ex:\n"
            "    ctx = ex._mp_context\n"
            "    print(ctx.get_start_method(), type(ctx).__module__, list(ex.map(abs, [-1, 2])))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["spawn", "arraymp._context", "[1,", "2]"]  # arraymp's spawn context, as mp's


FAKE_SUITE = '''
import os, time, unittest

class T(unittest.TestCase):
    def test_a_passes(self):
        pass

    def test_b_hangs_with_arraymp(self):
        if os.environ["ARRAYMP_SUITE_MODE"] == "arraymp":
            time.sleep(600)

    def test_c_fails_with_arraymp(self):
        for i in (1, 2):
            with self.subTest(i=i):
                self.assertTrue(os.environ["ARRAYMP_SUITE_MODE"] == "stdlib" or i == 1)

    def test_d_differs_but_allowed(self):
        self.assertEqual(os.environ["ARRAYMP_SUITE_MODE"], "stdlib")

    def test_e_leaves_a_thread_that_never_ends_with_arraymp(self):
        if os.environ["ARRAYMP_SUITE_MODE"] == "arraymp":
            import threading

            threading.Thread(target=time.sleep, args=(600,)).start()  # the interpreter's exit waits for it

SELECTED = ALL = ["T"]
if os.environ["ARRAYMP_SUITE_MODE"] == "arraymp":
    class TestSubstituted(unittest.TestCase):
        def test_ours(self):
            self.fail("the objects under test are not ours")

    SELECTED = ALL = ["T", "TestSubstituted"]
'''


def test_the_comparison_records_a_hang_and_goes_on_after_it(tmp_path):
    # the runner both harnesses share (stdlib_suite/_runner.py), on a suite of six tests: a test still running past
    # the suite's limit is a hang, the run resumes after it in a new process, a failing subtest fails its test, a
    # test of the arraymp runs alone must pass, and so must the run's exit
    repo = pathlib.Path(__file__).resolve().parent.parent
    fake = tmp_path / "fake_suite"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_suite.py").write_text(FAKE_SUITE)
    (fake / "allowed.txt").write_text("T.test_d_*: deliberate\n")
    (fake / "run.py").write_text(
        "import pathlib, sys\nfrom stdlib_suite._runner import Suite, main\n"
        "SUITE = Suite('fake_suite', pathlib.Path(__file__).parent, 'fake_suite._suite', 'json', test_timeout=3)\n"
        "sys.exit(main(SUITE, 'fake'))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(tmp_path)])}
    out = subprocess.run([sys.executable, "-m", "fake_suite.run", "--methods", "fork", "--keep", str(tmp_path / "k")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fork  arraymp: 2 pass, 3 fail, 0 skip, 1 hang" in out.stdout, out.stdout
    assert "fork: allowed: T.test_d_differs_but_allowed (fail): deliberate" in out.stdout
    differences = [line for line in out.stdout.splitlines() if "DIFFERENCE" in line]
    assert differences == [
        "fork: DIFFERENCE: (the run's exit) passes on the stdlib, not with arraymp:",
        "fork: DIFFERENCE: T.test_b_hangs_with_arraymp passes on the stdlib, not with arraymp:",
        "fork: DIFFERENCE: T.test_c_fails_with_arraymp passes on the stdlib, not with arraymp:",
        "fork: DIFFERENCE: TestSubstituted.test_ours (arraymp's runs only) fails:"], out.stdout
