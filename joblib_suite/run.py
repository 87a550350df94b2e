"""Run joblib's own ``test_parallel.py`` with the backend "arraymp" beside "loky", and compare.

    python -m joblib_suite.run [--sdist FILE] [--keep DIR] [--timeout SECONDS]

joblib's sdist of the installed version is downloaded from the index (``pip download``, as pip is configured;
``--sdist`` names one already there) and unpacked in a temporary folder; its ``joblib/test/test_parallel.py`` is
edited there (``patch.py``: arraymp added wherever the file names loky as a backend to test) and run by pytest
with ``plugin.py``, which keeps the tests that have an arraymp variant and their loky counterparts. Each arraymp
variant is reported beside its loky counterpart. One that fails where loky's passes fails the run, unless the
table "Differences from loky in joblib's own tests" of docs/joblib.md names it (a pattern, ``*`` for any text)
with the reason; it runs a second time first, alone, so that a test that only failed by timing under load is
reported as such, not as a difference. Exit status: 0 when no difference is left, 1 otherwise. The run's log
and results are removed when the comparison passes, and kept (the path printed) when it fails or ``--keep`` names
a folder for them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

from .patch import patch

HERE = pathlib.Path(__file__).parent
DOC = HERE.parent / "docs" / "joblib.md"
TABLE = "## Differences from loky in joblib's own tests"
TEST_FILE = "joblib/test/test_parallel.py"
OURS = {"arraymp": "loky", "ArraympBackend()": "LokyBackend()"}


def counterpart(nodeid: str) -> str | None:
    """The loky variant's id of an arraymp variant's id; None for a test without an arraymp variant."""
    name, bracket, params = nodeid.partition("[")
    if not bracket or not any(ours in params for ours in OURS):
        return None
    for ours in sorted(OURS, key=len, reverse=True):  # ArraympBackend() before arraymp
        params = params.replace(ours, OURS[ours])
    return f"{name}[{params}"


def allowed() -> dict[str, str]:
    """The table of docs/joblib.md: ``pattern`` -> why arraymp's variant differs from loky's."""
    text = DOC.read_text()
    if TABLE not in text:
        raise SystemExit(f"{DOC} has no section {TABLE!r}: the list of allowed differences")
    entries = {}
    for line in text.split(TABLE, 1)[1].split("\n## ", 1)[0].splitlines():
        row = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if row:
            entries[row.group(1)] = row.group(2).strip()
    return entries


def matches(test: str, pattern: str) -> bool:
    """Whether ``pattern`` names ``test`` (its name after ``::``): ``*`` stands for any text, nothing else is special
    (test ids hold brackets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), test, re.S) is not None


def listed(test: str, entries: dict[str, str]) -> str | None:
    """The pattern of ``entries`` that names ``test``."""
    return next((p for p in entries if matches(test, p)), None)


def download(version: str, folder: pathlib.Path) -> pathlib.Path:
    """joblib's sdist of ``version`` from the index, as pip is configured."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "--dest", str(folder), f"joblib=={version}"], check=True)
    (sdist,) = folder.glob(f"joblib-{version}.tar.gz")
    return sdist


def unpack(sdist: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The sdist unpacked in ``folder``, its test_parallel.py edited: the project's root."""
    with tarfile.open(sdist) as t:
        t.extractall(folder, filter="data")
    (root,) = [p for p in folder.iterdir() if p.is_dir()]
    test_file = root / TEST_FILE
    text, n = patch(test_file.read_text())
    if n == 0:
        raise SystemExit(f"{sdist.name}: {TEST_FILE} names loky as a backend to test nowhere (its shape changed): "
                         "see joblib_suite/patch.py")
    test_file.write_text(text)
    print(f"[joblib_suite] {sdist.name}: arraymp added beside loky in {n} places of {TEST_FILE}", flush=True)
    return root


def pytest(root: pathlib.Path, out: pathlib.Path, log: pathlib.Path, timeout: float, only: list[str] | None = None
           ) -> int:
    """One pytest run of the edited file in a fresh interpreter; outcomes appended to ``out`` as JSON lines."""
    env = {**os.environ, "ARRAYMP_JOBLIB_SUITE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if only is not None:
        selection = out.with_suffix(".only")
        selection.write_text(json.dumps(only))
        env["ARRAYMP_JOBLIB_SUITE_ONLY"] = str(selection)
    args = [sys.executable, "-m", "pytest", "-p", "joblib_suite.plugin", TEST_FILE, "-o", "addopts=",
            "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test fails alone instead of the run
        args += ["--timeout", "300"]
    with open(log, "a") as f:
        try:
            return subprocess.run(args, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[joblib_suite] the run took over {timeout:.0f} s and was stopped\n")
            return -1


def outcomes(out: pathlib.Path) -> dict[str, str]:
    if not out.exists():
        return {}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {row["id"]: row["outcome"] for row in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=pathlib.Path, help="joblib's sdist (default: downloaded from the index)")
    parser.add_argument("--keep", type=pathlib.Path, help="keep the unpacked sdist, log and results here")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds the whole pytest run may take")
    args = parser.parse_args(argv)
    version = importlib.metadata.version("joblib")
    entries = allowed()
    work = pathlib.Path(tempfile.mkdtemp(prefix="arraymp-joblib-suite-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sdist = args.sdist or download(version, work)
    root = unpack(sdist, work / "src")
    out, log = work / "results.jsonl", work / "pytest.log"
    code = pytest(root, out, log, args.timeout)
    seen = outcomes(out)
    if code not in (0, 1) or not seen:
        print(log.read_text()[-20000:])
        print(f"[joblib_suite] pytest exited with {code}; the run is kept in {work}")
        return 1
    ours = {test: outcome for test, outcome in seen.items() if counterpart(test)}
    failing = [test for test, outcome in ours.items()
               if outcome in ("failed", "error") and seen.get(counterpart(test) or "") == "passed"]
    unlisted = [test for test in failing if listed(test.split("::", 1)[1], entries) is None]
    flaky: list[str] = []
    if unlisted:  # alone, once more: a failure by timing under load is not a difference
        again = work / "again.jsonl"
        pytest(root, again, log, args.timeout, only=unlisted)
        flaky = [test for test, outcome in outcomes(again).items() if outcome == "passed"]
        unlisted = [test for test in unlisted if test not in flaky]

    print(f"\n[joblib_suite] joblib {version}: {TEST_FILE}, each arraymp variant beside loky's")
    print(f"{'loky':8} {'arraymp':8} test")
    for test, outcome in ours.items():
        loky = seen.get(counterpart(test) or "", "-")
        name = test.split("::", 1)[1]
        note = " (passed when run again alone)" if test in flaky else ""
        if test in failing and test not in flaky:
            pattern = listed(name, entries)
            note = f" (listed: {pattern})" if pattern else " (NOT LISTED)"
        print(f"{loky:8} {outcome:8} {name}{note}")
    n_loky = sum(seen.get(counterpart(t) or "") == "passed" for t in ours)
    n_ours = sum(outcome == "passed" for outcome in ours.values())
    print(f"\n[joblib_suite] arraymp variants passed: {n_ours} of {len(ours)}; their loky counterparts passed: "
          f"{n_loky}; arraymp failing where loky passes: {len(failing) - len(flaky)} ({len(unlisted)} not listed in "
          f"docs/joblib.md), {len(flaky)} passed when run again alone; {time.monotonic() - started:.0f} s")
    stale = [p for p in entries if not any(matches(t.split("::", 1)[1], p) for t in failing)]
    if stale:
        print(f"[joblib_suite] listed in docs/joblib.md but not failing in this run: {', '.join(stale)}")
    if unlisted:
        print(f"[joblib_suite] arraymp fails where loky passes, and docs/joblib.md does not say why: "
              f"{', '.join(t.split('::', 1)[1] for t in unlisted)}; the run is kept in {work}")
        return 1
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
