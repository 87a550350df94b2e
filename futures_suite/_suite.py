"""CPython's ``test.test_concurrent_futures`` process pool classes of one start method, with
``arraymp.ProcessPoolExecutor`` in place of the stdlib's when ``ARRAYMP_SUITE_MODE=arraymp`` (else the plain
stdlib).

The tests reach the executor three ways, and each gets ours: ``futures.ProcessPoolExecutor`` (the
``concurrent.futures`` attribute, set before the test modules are imported), their mixins' ``executor_type``
(bound when those are made: set again), and the scripts some tests run in a child interpreter with
``assert_python_ok('-c', ...)`` (isolated mode: they get a first line that makes the same substitution there).
The executor's workers need nothing: the tests send them functions of the stdlib's test modules. The mode and the
start method come from the environment; ``TestSubstituted`` checks all three from inside a run. The classes stay
in their own modules (their setUpModule runs), and are named here for the runner.

Python 3.12 and later split the tests into a package (``test_process_pool``, ``test_shutdown``, ...); 3.11 has
one module.
"""

import concurrent.futures
import importlib
import multiprocessing
import os
import pkgutil
import subprocess
import sys
import unittest

import test.test_concurrent_futures as P

MODE = os.environ.get("ARRAYMP_SUITE_MODE", "stdlib")
METHOD = os.environ.get("ARRAYMP_SUITE_METHOD", "spawn")
# the first line of a child interpreter's script (arraymp mode)
SUBSTITUTE = ("import concurrent.futures, arraymp; "
              "concurrent.futures.ProcessPoolExecutor = arraymp.ProcessPoolExecutor\n")
SKIPPED_MODULES = ("test_thread_pool", "test_interpreter_pool", "test_future")  # no process pool in them
# tests of every start method's executor, run under the one they name
BY_NAME = {"spawn": ["FailingInitializerResourcesTest.test_spawn"],
           "forkserver": ["FailingInitializerResourcesTest.test_forkserver"]}
# Tests that would wait forever with arraymp's executor (they have no timeout of their own), on a difference that
# allowed.txt explains: skipped in its runs, rather than each costing the runner's limit per test.
WAIT_FOREVER = ("ProcessPoolExecutorTest.test_broken_process_pool_traceback",)

if MODE not in ("stdlib", "arraymp"):
    sys.exit(f"ARRAYMP_SUITE_MODE={MODE!r}: use 'stdlib' or 'arraymp'")
if MODE == "arraymp":
    import arraymp

    concurrent.futures.ProcessPoolExecutor = arraymp.ProcessPoolExecutor  # type: ignore[misc]


def _modules() -> list:
    if not hasattr(P, "__path__"):
        return [P]
    return [importlib.import_module(f"{P.__name__}.{m.name}") for m in pkgutil.iter_modules(P.__path__)
            if m.name.startswith("test_") and m.name not in SKIPPED_MODULES]


def _in_child(assert_python):
    """``assert_python_ok`` (or ``_failure``) whose ``-c`` script starts with SUBSTITUTE."""

    def run(*args, **kwargs):
        if len(args) >= 2 and args[0] == "-c":
            args = ("-c", SUBSTITUTE + args[1], *args[2:])
        return assert_python(*args, **kwargs)

    return run


MODULES = _modules()
UTIL = getattr(P, "util", P)
MIXIN = getattr(UTIL, f"ProcessPool{METHOD.capitalize()}Mixin")
if MODE == "arraymp":
    for mixin in ("ProcessPoolForkMixin", "ProcessPoolSpawnMixin", "ProcessPoolForkserverMixin"):
        getattr(UTIL, mixin).executor_type = arraymp.ProcessPoolExecutor
    for module in MODULES:
        for name in ("assert_python_ok", "assert_python_failure"):
            if hasattr(module, name):
                setattr(module, name, _in_child(getattr(module, name)))

SELECTED = []
for module in MODULES:
    for name, obj in vars(module).items():
        if isinstance(obj, type) and issubclass(obj, unittest.TestCase) and obj.__module__ == module.__name__:
            if issubclass(obj, MIXIN) or any(n.partition(".")[0] == name for n in BY_NAME.get(METHOD, ())):
                globals()[name] = obj
            if issubclass(obj, MIXIN):
                SELECTED.append(name)
SELECTED += BY_NAME.get(METHOD, [])
if MODE == "arraymp":
    for name in WAIT_FOREVER:
        kind, _, test = name.partition(".")
        for cls in (globals()[n] for n in SELECTED if "." not in n):
            if cls.__name__.endswith(kind) and hasattr(cls, test):
                setattr(cls, test, unittest.skip("waits forever with arraymp's executor: see allowed.txt")(
                    getattr(cls, test)))


class TestSubstituted(unittest.TestCase):
    """The executor under test is arraymp's: ``futures.ProcessPoolExecutor``, the mixins' and a child script's."""

    def test_ours_here_and_in_a_child_script(self):
        ours = arraymp.ProcessPoolExecutor
        self.assertIs(concurrent.futures.ProcessPoolExecutor, ours)
        self.assertIs(MIXIN.executor_type, ours)
        with MIXIN.executor_type(1, mp_context=multiprocessing.get_context(METHOD)) as ex:
            self.assertEqual(ex._mp_context.get_start_method(), METHOD)
            self.assertEqual(ex.submit(abs, -1).result(60), 1)
        script = "from concurrent.futures import ProcessPoolExecutor as E; print(E.__module__)"
        for module in MODULES:
            if hasattr(module, "assert_python_ok"):
                rc, out, err = module.assert_python_ok("-c", script)
                self.assertEqual(out.decode().strip(), ours.__module__, err)
                break
        else:  # (no test of this version runs a child script)
            out = subprocess.run([sys.executable, "-I", "-c", SUBSTITUTE + script], capture_output=True, text=True,
                                 timeout=120)
            self.assertEqual(out.stdout.strip(), ours.__module__, out.stderr)


if MODE == "arraymp":
    SELECTED.append("TestSubstituted")
else:
    del TestSubstituted
ALL = SELECTED
