import os
import sys
import warnings

# Child target functions live in tests/_spawn_targets.py; spawn and forkserver
# children import them by name, so this directory must be on sys.path (the
# children inherit the parent's sys.path).
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import multiprocessing  # noqa: E402

import pytest  # noqa: E402

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))

# The shared suite is a plain module: have pytest explain its failed asserts too.
pytest.register_assert_rewrite("_spawn_suite")


@pytest.fixture
def no_leftover_children():
    """After the test, this process has no multiprocessing child left."""
    yield
    from _spawn_suite import wait_for

    wait_for(lambda: not multiprocessing.active_children(), 10.0, "children to be joined")
