"""Run CPython's multiprocessing tests on the stdlib and with arraymp's objects, and compare.

    python -m stdlib_suite.run [--all] [--methods spawn,fork,forkserver] [--jobs 2] [--keep DIR]

For each start method, the interpreter's ``test._test_multiprocessing`` runs
twice, each run in a process of its own (see ``_suite.py``): on the plain
stdlib, then with arraymp's Queue, JoinableQueue, SimpleQueue, Pipe, Pool and
get_context substituted. The classes that touch queues, pipes, connections,
pools, contexts and processes run by default; ``--all`` runs every class. A
test that passes on the stdlib and not with arraymp fails the run, unless
``allowed.txt`` (beside this file) names it with the reason; it runs a second
time first, alone, so that a test that only failed by timing under load is
reported as such, not as a difference. Exit status: 0 when no difference is
left, 1 otherwise, 2 when the interpreter lacks the ``test`` package. The runs'
logs are removed when the comparison passes, and kept (the path printed) when
it fails or ``--keep`` names a folder for them.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).parent
MODULE = "stdlib_suite._suite"
METHODS = ("spawn", "fork", "forkserver")
# the "processes" flavour of the classes that touch queues, pipes, connections, pools, contexts and processes
SELECTED = (
    "WithProcessesTestProcess", "WithProcessesTestSubclassingProcess", "WithProcessesTestQueue",
    "WithProcessesTestPool", "WithProcessesTestPoolWorkerErrors", "WithProcessesTestPoolWorkerLifetime",
    "WithProcessesTestConnection", "WithProcessesTestListenerClient", "WithProcessesTestPoll",
    "WithProcessesTestPicklingConnections", "WithProcessesTestPollEintr", "TestWait", "TestTimeouts",
    "TestSimpleQueue", "TestPoolNotLeakOnFailure", "TestInitializers", "TestStartMethod", "TestIgnoreEINTR",
    "TestCloseFds", "TestResourceTracker", "TestInvalidHandle", "MiscTestCase", "TestSubstituted",
)
TEST_TIMEOUT = 600  # seconds one test may take before its run is stopped with a traceback (> LONG_TIMEOUT, 300)
NO_TEST_PACKAGE = (f"{sys.executable} has no `test` package (test._test_multiprocessing): on Debian/Ubuntu install "
                   f"libpython3.{sys.version_info.minor}-testsuite, or run with an interpreter that has it "
                   "(pyenv's and python.org's builds do)")


def allowed() -> dict[str, str]:
    """allowed.txt: ``Class.test_name: why the difference is deliberate`` per line; # starts a comment."""
    entries = {}
    for line in (HERE / "allowed.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(":")
            entries[name.strip()] = reason.strip()
    return entries


def run_one(mode: str, method: str, names: list[str], out: pathlib.Path, log: pathlib.Path,
            timeout: float) -> int:
    """One run in a fresh interpreter; its results are appended to ``out`` as JSON lines."""
    env = {**os.environ, "ARRAYMP_SUITE_MODE": mode, "ARRAYMP_SUITE_METHOD": method,
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log, "w") as f:
        try:
            # in the run's folder: CPython's tests make (and may leave) their @test_* files in the current one
            return subprocess.run([sys.executable, "-m", "stdlib_suite.run", "--child", str(out), *names], env=env,
                                  stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=out.parent,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[stdlib_suite] the run took over {timeout:.0f} s and was stopped\n")
            return -1


def child(out: str, names: list[str]) -> None:
    """In the run's process: run the named classes (or Class.test ids) and record each outcome."""
    import faulthandler
    import importlib
    import unittest

    mod = importlib.import_module(MODULE)
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for name in names:
        if "." in name:
            suite.addTest(loader.loadTestsFromName(name, mod))
        elif isinstance(getattr(mod, name, None), type):
            suite.addTest(loader.loadTestsFromTestCase(getattr(mod, name)))
    records = open(out, "a", buffering=1)

    class Result(unittest.TextTestResult):
        def _record(self, test, outcome, detail=""):
            name = test.id().removeprefix(MODULE + ".")
            records.write(json.dumps({"test": name, "outcome": outcome, "detail": detail[-3000:]}) + "\n")

        def startTest(self, test):
            faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True)
            super().startTest(test)

        def addSuccess(self, test):
            super().addSuccess(test)
            self._record(test, "pass")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._record(test, "fail", self.failures[-1][1])

        def addError(self, test, err):
            super().addError(test, err)
            self._record(test, "error", self.errors[-1][1])

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._record(test, "skip", reason)

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._record(test, "pass")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._record(test, "fail", "unexpected success")

    unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=Result).run(suite)
    faulthandler.cancel_dump_traceback_later()


def outcomes(path: pathlib.Path) -> dict[str, dict]:
    """Each test's last outcome (a module-level error, e.g. in tearDownModule, counts as the run's)."""
    got = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            got[rec["test"]] = rec
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every class of the module, not only the selection")
    ap.add_argument("--methods", default=",".join(METHODS), help="start methods, comma-separated")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--keep", help="a folder to keep the runs' logs and results in")
    ap.add_argument("--missing", action="store_true", help="print why the suite cannot run here (nothing: it can)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.names)
        return 0
    have_tests = importlib.util.find_spec("test") and importlib.util.find_spec("test._test_multiprocessing")
    if args.missing:
        print("" if have_tests else NO_TEST_PACKAGE)
        return 0
    if not have_tests:
        print(NO_TEST_PACKAGE, file=sys.stderr)
        return 2
    names = _all_classes() if args.all else list(SELECTED)
    methods = [m for m in args.methods.split(",") if m]
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="stdlib_suite_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"stdlib_suite: {sys.executable} (Python {sys.version.split()[0]}), {len(names)} classes, "
          f"methods {methods}; logs in {work}", flush=True)

    start = time.monotonic()
    runs = [(mode, method) for method in methods for mode in ("stdlib", "arraymp")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        futures = {(mode, method): ex.submit(run_one, mode, method, names, work / f"{mode}-{method}.jsonl",
                                             work / f"{mode}-{method}.log", args.timeout) for mode, method in runs}
    codes = {run: f.result() for run, f in futures.items()}
    allow, used, failed = allowed(), set(), False
    for method in methods:
        std, ours = outcomes(work / f"stdlib-{method}.jsonl"), outcomes(work / f"arraymp-{method}.jsonl")
        for mode, got in (("stdlib", std), ("arraymp", ours)):
            counts = collections.Counter("fail" if r["outcome"] == "error" else r["outcome"] for r in got.values())
            stopped = f" (stopped early, exit {codes[mode, method]}: see its log)" if codes[mode, method] else ""
            print(f"{method:>10} {mode:>8}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} "
                  f"skipped{stopped}")
        if not std or not ours:
            print(f"{method}: a run recorded nothing; see {work}/*-{method}.log", file=sys.stderr)
            failed = True
            continue
        lost = sorted(t for t in std if _passed(std, t) and not _passed(ours, t))
        gained = sorted(t for t in ours if _passed(ours, t) and not _passed(std, t))
        if gained:
            print(f"{method}: pass with arraymp only: {gained}")
        for name in [t for t in lost if t in allow]:
            used.add(name)
            print(f"{method}: allowed: {name}: {allow[name]}")
        lost = [t for t in lost if t not in allow]
        if lost:  # once more, alone: a test that failed by timing under load passes now
            again = work / f"arraymp-{method}-again.jsonl"
            run_one("arraymp", method, lost, again, work / f"arraymp-{method}-again.log", args.timeout)
            rerun = outcomes(again)
            unrun = [name for name in lost if name not in ours and _passed(rerun, name)]
            if unrun:
                print(f"{method}: the arraymp run stopped before {len(unrun)} tests (see its log); they all passed "
                      "when run again")
            for name in lost:
                if name in unrun:
                    continue
                if _passed(rerun, name):
                    print(f"{method}: FLAKY (failed, then passed alone): {name}\n{_detail(ours.get(name))}")
                else:
                    failed = True
                    print(f"{method}: DIFFERENCE: {name} passes on the stdlib, not with arraymp:\n"
                          f"{_detail(rerun.get(name) or ours.get(name))}")
    for name in sorted(set(allow) - used):
        print(f"allowed.txt: {name} passed with arraymp (or did not run): remove it if it passes everywhere")
    print(f"stdlib_suite: {'FAILED' if failed else 'OK'} in {time.monotonic() - start:.0f} s")
    if failed or args.keep:
        print(f"stdlib_suite: logs and results in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _passed(got: dict[str, dict], name: str) -> bool:
    return got.get(name, {}).get("outcome") == "pass"


def _detail(rec: dict | None) -> str:
    if rec is None:
        return "    (no outcome: the run stopped before it; see its log)"
    return "    " + f"{rec['outcome']}: {rec['detail']}".replace("\n", "\n    ")


def _all_classes() -> list[str]:
    """Every TestCase class the module installs, by running the install in a throwaway interpreter."""
    code = (f"import unittest, {MODULE} as m; print(' '.join(n for n, v in vars(m).items() "
            "if isinstance(v, type) and issubclass(v, unittest.TestCase) and v.__module__ == m.__name__))")
    env = {**os.environ, "ARRAYMP_SUITE_MODE": "arraymp", "PYTHONPATH": str(HERE.parent)}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                          text=True).stdout.split()


if __name__ == "__main__":
    sys.exit(main())
