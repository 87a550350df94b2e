"""The comparison both harnesses run (``stdlib_suite.run``, ``futures_suite.run``): a suite of CPython's own tests,
run per start method once on the stdlib and once with arraymp's objects, each run in a process of its own, then
compared per test.

A harness is a ``Suite``: its folder (``allowed.txt`` beside its ``run.py``) and the module that installs the tests
for one start method, with arraymp's objects substituted when ``ARRAYMP_SUITE_MODE=arraymp`` (else the plain
stdlib); the method comes in ``ARRAYMP_SUITE_METHOD``, which the children inherit. That module names the classes a
run takes (``SELECTED``; ``ALL`` with ``--all``).

A run records each test as it starts and as it ends (JSON lines). A test that is still running after the suite's
``test_timeout`` seconds ends its run (faulthandler prints every thread's stack to the log); it is recorded as a
hang and the run goes on, in a new process, from the test after it. A test that passes on the stdlib and not with
arraymp fails the comparison unless ``allowed.txt`` names it (an entry may be a glob: ``ProcessPool*Test.test_x``);
it runs a second time first, alone, so that a test that only failed by timing under load is reported as such.
Exit status: 0 when no difference is left, 1 otherwise, 2 when the interpreter lacks the suite's ``test`` module.
The logs are removed when the comparison passes, and kept (the path printed) when it fails or ``--keep`` names a
folder for them.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import fnmatch
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

METHODS = ("spawn", "fork", "forkserver")
OUTCOMES = ("pass", "fail", "skip", "hang", "crash")
EXIT = "(the run's exit)"  # recorded as a test of each run: it passes unless the interpreter's exit hangs


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str  # the harness's package: ``python -m <name>.run``
    folder: pathlib.Path  # where its allowed.txt is
    module: str  # installs the tests for one start method (see the module docstring)
    needs: str  # the stdlib test module it runs
    test_timeout: float  # seconds one test may run before it counts as a hang

    def missing(self) -> str:
        """Why the suite cannot run on this interpreter ("" when it can)."""
        try:
            found = importlib.util.find_spec(self.needs)
        except ImportError:
            found = None
        if found:
            return ""
        minor = sys.version_info.minor
        return (f"{sys.executable} has no `test` package with {self.needs}: on Debian/Ubuntu install "
                f"libpython3.{minor}-testsuite, or run with an interpreter that has it (python.org's builds do; "
                "some pyenv builds leave parts of it out)")

    def allowed(self) -> dict[str, str]:
        """allowed.txt: ``Class.test_name: why the difference is deliberate`` per line; # starts a comment."""
        entries = {}
        for line in (self.folder / "allowed.txt").read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, reason = line.partition(":")
                entries[name.strip()] = reason.strip()
        return entries


def run(suite: Suite, mode: str, method: str, names: list[str], out: pathlib.Path, log: pathlib.Path,
        timeout: float, all_: bool = False) -> int:
    """One run in fresh interpreters (a new one after each hang), its records appended to ``out``; the exit status
    of the last, or -1 if a process ran past ``timeout`` seconds."""
    tries = 0
    while True:
        code = _run_child(suite, mode, method, names, out, log, timeout, all_)
        planned, records = _records(out)
        with open(out, "a") as f:
            for name, rec in records.items():
                if rec["outcome"] != "start":
                    continue
                if code == 0:
                    how, detail = "fail", "the test reported no outcome"
                elif code in (1, -1):  # the run ended in it: faulthandler's exit(1) past the limit, or ours
                    how = "hang"
                    detail = f"still running after {suite.test_timeout:.0f} s: the stacks are in {log.name}"
                else:
                    how, detail = "crash", f"the run's process ended in it (exit {code}): see {log.name}"
                f.write(json.dumps({"test": name, "outcome": how, "detail": detail}) + "\n")
        left = [t for t in planned if t not in records]
        if code == 0 or not left or tries > len(planned):
            return code
        tries += 1
        names, all_ = left, False


def _run_child(suite: Suite, mode: str, method: str, names: list[str], out: pathlib.Path, log: pathlib.Path,
               timeout: float, all_: bool) -> int:
    """One process of a run, in a session of its own: what it leaves running when it ends (the workers of a test
    it hung in) is killed with it."""
    env = {**os.environ, "ARRAYMP_SUITE_MODE": mode, "ARRAYMP_SUITE_METHOD": method,
           "PYTHONPATH": os.pathsep.join([str(suite.folder.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    listed = out.with_suffix(".names")
    listed.write_text("\n".join(names))
    args = [sys.executable, "-m", f"{suite.name}.run", "--child", str(out), *(["--all"] if all_ else []), str(listed)]
    with open(log, "a") as f:
        # in the run's folder: CPython's tests make (and may leave) their @test_* files in the current one
        proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=out.parent, start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            f.write(f"\n[{suite.name}] the run took over {timeout:.0f} s and was stopped\n")
            return -1
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def child(suite: Suite, out: str, listed: str, all_: bool) -> None:
    """In the run's process: run the classes (or Class.test ids) the file ``listed`` names, a line each (none: the
    module's selection), and record each test's start, then its outcome."""
    import atexit
    import faulthandler
    import gc
    import importlib

    def record(name: str, outcome: str, detail: str = "") -> None:
        records.write(json.dumps({"test": name, "outcome": outcome, "detail": detail[-3000:]}) + "\n")

    records = open(out, "a", buffering=1)
    ran: list[bool] = []
    # registered first, so run last: the exit (threads joined, multiprocessing's finalizers run) did not hang
    atexit.register(lambda: ran and record(EXIT, "pass"))
    names = pathlib.Path(listed).read_text().split()
    mod = importlib.import_module(suite.module)
    loader = unittest.TestLoader()
    tests = unittest.TestSuite()
    for name in names or getattr(mod, "ALL" if all_ else "SELECTED"):
        if "." in name:
            if isinstance(getattr(mod, name.partition(".")[0], None), type):
                tests.addTest(loader.loadTestsFromName(name, mod))
        elif isinstance(getattr(mod, name, None), type):
            tests.addTest(loader.loadTestsFromTestCase(getattr(mod, name)))
    records.write(json.dumps({"plan": [_name(t) for t in _flatten(tests)]}) + "\n")

    class Result(unittest.TextTestResult):
        failed = False

        def _record(self, test, outcome, detail=""):
            record(_name(test), outcome, detail)
            self.failed = self.failed or outcome in ("fail", "error")

        def startTest(self, test):
            self._record(test, "start")
            faulthandler.dump_traceback_later(suite.test_timeout, exit=True)
            super().startTest(test)

        def stopTest(self, test):
            super().stopTest(test)
            if self.failed:  # what a failure left behind (a pool its traceback held) goes before the next test
                gc.collect()
                self.failed = False

        def addSuccess(self, test):
            super().addSuccess(test)
            self._record(test, "pass")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._record(test, "fail", self.failures[-1][1])

        def addError(self, test, err):
            super().addError(test, err)
            self._record(test, "error", self.errors[-1][1])

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:  # the test's own outcome is then never added
                self._record(test, "fail", f"{subtest}: {self._exc_info_to_string(err, test)}")

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._record(test, "skip", reason)

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._record(test, "pass")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._record(test, "fail", "unexpected success")

    unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=Result).run(tests)
    record(EXIT, "start")  # a pool or executor that never ends hangs the interpreter's exit: a hang of its own
    ran.append(True)
    faulthandler.dump_traceback_later(suite.test_timeout, exit=True)


def _name(test) -> str:
    """``Class.test_name``, a subtest's too (a module-level error, e.g. in tearDownModule, by its description)."""
    test = getattr(test, "test_case", test)  # (a subtest that skipped: its test's outcome)
    if isinstance(test, unittest.TestCase):
        return f"{type(test).__name__}.{test.id().rpartition('.')[2]}"
    return test.id()


def _flatten(tests):
    for t in tests:
        if hasattr(t, "__iter__"):
            yield from _flatten(t)
        else:
            yield t


def _records(path: pathlib.Path) -> tuple[list[str], dict[str, dict]]:
    """(the tests the runs planned, each one's last record)."""
    planned: list[str] = []
    got: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "plan" in rec:
                planned += [t for t in rec["plan"] if t not in planned]
            else:
                got[rec["test"]] = rec
    return planned, got


def outcomes(path: pathlib.Path) -> dict[str, dict]:
    """Each test's outcome: pass, fail (an error too), skip, hang or crash."""
    got = _records(path)[1]
    for rec in got.values():
        if rec["outcome"] == "error":
            rec["outcome"] = "fail"
    return got


def main(suite: Suite, doc: str) -> int:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        child(suite, args.child, args.names[0], args.all)
        return 0
    missing = suite.missing()
    if args.missing:
        print(missing)
        return 0
    if missing:
        print(missing, file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix=f"{suite.name}_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"{suite.name}: {sys.executable} (Python {sys.version.split()[0]}), {suite.needs}, methods {methods}; "
          f"logs in {work}", flush=True)

    start = time.monotonic()
    runs = [(mode, method) for method in methods for mode in ("stdlib", "arraymp")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        futures = {(mode, method): ex.submit(run, suite, mode, method, args.names, work / f"{mode}-{method}.jsonl",
                                             work / f"{mode}-{method}.log", args.timeout, args.all)
                   for mode, method in runs}
    codes = {r: f.result() for r, f in futures.items()}
    allow, used, failed = suite.allowed(), set(), False
    for method in methods:
        std, ours = outcomes(work / f"stdlib-{method}.jsonl"), outcomes(work / f"arraymp-{method}.jsonl")
        for mode, got in (("stdlib", std), ("arraymp", ours)):
            counts = collections.Counter(r["outcome"] for t, r in got.items() if t != EXIT)
            stopped = f" (stopped early, exit {codes[mode, method]}: see its log)" if codes[mode, method] else ""
            print(f"{method:>10} {mode:>8}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES
                                                          if counts[o] or o in ("pass", "fail", "skip")) + stopped)
        if not std or not ours:
            print(f"{method}: a run recorded nothing; see {work}/*-{method}.log", file=sys.stderr)
            failed = True
            continue
        lost = sorted(t for t in std if _passed(std, t) and not _passed(ours, t))
        gained = sorted(t for t in ours if _passed(ours, t) and not _passed(std, t))
        # a test of the arraymp runs alone (TestSubstituted: the objects under test are ours) must pass
        lost += sorted(t for t in ours if t not in std and ours[t]["outcome"] not in ("pass", "skip"))
        if gained:
            print(f"{method}: pass with arraymp only: {gained}")
        unexplained = []
        for name in lost:
            entry = next((e for e in allow if fnmatch.fnmatchcase(name, e)), None)
            if entry is None:
                unexplained.append(name)
            else:
                used.add(entry)
                print(f"{method}: allowed: {name} ({ours.get(name, {}).get('outcome', 'not run')}): {allow[entry]}")
        if unexplained:  # once more, alone: a test that failed by timing under load passes now
            again = work / f"arraymp-{method}-again.jsonl"
            run(suite, "arraymp", method, [t for t in unexplained if t != EXIT], again,
                work / f"arraymp-{method}-again.log", args.timeout)
            rerun = {**outcomes(again), EXIT: ours.get(EXIT, {})}  # (the exit after the tests: not run again)
            for name in unexplained:
                if _passed(rerun, name):
                    first = ours.get(name)
                    print(f"{method}: FLAKY (failed, then passed alone): {name}\n{_detail(first)}")
                else:
                    failed = True
                    why = "passes on the stdlib, not with arraymp" if name in std else "(arraymp's runs only) fails"
                    print(f"{method}: DIFFERENCE: {name} {why}:\n{_detail(rerun.get(name) or ours.get(name))}")
    for name in sorted(set(allow) - used):
        print(f"allowed.txt: {name} passed with arraymp (or did not run): remove it if it passes everywhere")
    print(f"{suite.name}: {'FAILED' if failed else 'OK'} in {time.monotonic() - start:.0f} s")
    if failed or args.keep:
        print(f"{suite.name}: logs and results in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _passed(got: dict[str, dict], name: str) -> bool:
    return got.get(name, {}).get("outcome") == "pass"


def _detail(rec: dict | None) -> str:
    if rec is None:
        return "    (no outcome: the run stopped before it; see its log)"
    return "    " + f"{rec['outcome']}: {rec['detail']}".replace("\n", "\n    ")
