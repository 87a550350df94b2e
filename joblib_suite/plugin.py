"""pytest plugin for joblib's ``test_parallel.py`` with arraymp beside loky (``-p joblib_suite.plugin``; run.py).

It registers the backend (``import arraymp.joblib``) before the file is collected, names backend instances in
test ids by their class (``LokyBackend()``, ``ArraympBackend()``: pytest would number them, and the numbers
move when a backend is added), keeps only the tests that have an arraymp variant and their loky counterparts
(or the ids listed in the JSON file ``ARRAYMP_JOBLIB_SUITE_ONLY`` names), and appends each one's outcome as a
JSON line to the file ``ARRAYMP_JOBLIB_SUITE_OUT`` names.
"""

from __future__ import annotations

import json
import os

import arraymp.joblib  # noqa: F401  (registers "arraymp" in joblib's BACKENDS before test_parallel.py is read)

from .run import counterpart


def pytest_make_parametrize_id(config, val, argname):
    from joblib.parallel import ParallelBackendBase

    if "backend" in argname and isinstance(val, ParallelBackendBase):
        return f"{type(val).__name__}()"
    if "backend" in argname and type(val).__name__.endswith("Context"):  # a multiprocessing context
        return type(val).__name__
    return None


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("ARRAYMP_JOBLIB_SUITE_ONLY")
    if only:
        keep_ids = set(json.loads(open(only).read()))
    else:
        keep_ids = {item.nodeid for item in items if counterpart(item.nodeid)}
        keep_ids |= {counterpart(nodeid) for nodeid in keep_ids}  # type: ignore[arg-type]
    keep = [item for item in items if item.nodeid in keep_ids]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep_ids])
    items[:] = keep


_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    """A test's outcome: the first failure among its phases, else its call's (or its skip)."""
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.skipped:
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call":
        outcome = "xpassed" if hasattr(report, "wasxfail") else "passed"
    else:
        outcome = None
    if outcome and _outcomes.get(report.nodeid) not in ("failed", "error"):
        _outcomes[report.nodeid] = outcome
    out = os.environ.get("ARRAYMP_JOBLIB_SUITE_OUT")
    if out and report.when == "teardown":
        with open(out, "a") as f:
            f.write(json.dumps({"id": report.nodeid, "outcome": _outcomes.pop(report.nodeid, "error")}) + "\n")
