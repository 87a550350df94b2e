"""Run CPython's test_concurrent_futures (its process pool classes) on the stdlib's executor and on arraymp's,
and compare.

    python -m futures_suite.run [--methods spawn,fork,forkserver] [--jobs 2] [--keep DIR]

For each start method, the interpreter's ``test.test_concurrent_futures``
classes of that method (``ProcessPoolSpawn*``, ``ProcessPoolFork*``,
``ProcessPoolForkserver*``; see ``_suite.py``) run twice, each run in a process
of its own: with the stdlib's ``concurrent.futures.ProcessPoolExecutor``, then
with ``arraymp.ProcessPoolExecutor`` in its place (in the scripts the tests run
in a child interpreter too). A test that passes on the stdlib and not with
arraymp fails the run, unless ``allowed.txt`` (beside this file) names it with
the reason; it runs a second time first, alone, so that a test that only failed
by timing under load is reported as such. A test still running after 300 s (the
suite's own limit) is recorded as a hang, and the run goes on after it. Exit
status: 0 when no difference is left, 1 otherwise, 2 when the interpreter lacks
``test.test_concurrent_futures``. The comparison is ``stdlib_suite/_runner.py``'s.
"""

import pathlib
import sys

from stdlib_suite._runner import Suite, main

SUITE = Suite("futures_suite", pathlib.Path(__file__).parent, "futures_suite._suite", "test.test_concurrent_futures",
              test_timeout=300)  # the suite's tearDown fails a test that lasted that long

if __name__ == "__main__":
    sys.exit(main(SUITE, __doc__))
