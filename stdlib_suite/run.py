"""Run CPython's multiprocessing tests on the stdlib and with arraymp's objects, and compare.

    python -m stdlib_suite.run [--all] [--methods spawn,fork,forkserver] [--jobs 2] [--keep DIR]

For each start method, the interpreter's ``test._test_multiprocessing`` runs
twice, each run in a process of its own (see ``_suite.py``): on the plain
stdlib, then with arraymp's Queue, JoinableQueue, SimpleQueue, Pipe, Pool and
get_context substituted. The classes that touch queues, pipes, connections,
pools, contexts and processes run by default (``_suite.SELECTED``); ``--all``
runs every class. A test that passes on the stdlib and not with arraymp fails
the run, unless ``allowed.txt`` (beside this file) names it with the reason;
it runs a second time first, alone, so that a test that only failed by timing
under load is reported as such, not as a difference. A test still running
after 600 s is recorded as a hang, and the run goes on after it. Exit status:
0 when no difference is left, 1 otherwise, 2 when the interpreter lacks the
``test`` package. The runs' logs are removed when the comparison passes, and
kept (the path printed) when it fails or ``--keep`` names a folder for them.
The comparison is ``_runner.py``'s, which ``futures_suite`` shares.
"""

import pathlib
import sys

from stdlib_suite._runner import Suite, main

# > LONG_TIMEOUT (300), which some of the tests wait for
SUITE = Suite("stdlib_suite", pathlib.Path(__file__).parent, "stdlib_suite._suite", "test._test_multiprocessing",
              test_timeout=600)

if __name__ == "__main__":
    sys.exit(main(SUITE, __doc__))
