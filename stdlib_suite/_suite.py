"""CPython's ``test._test_multiprocessing``, installed here for one start method, with
arraymp's objects substituted when ``ARRAYMP_SUITE_MODE=arraymp`` (else the plain stdlib).

Every process of a run imports this module by name: the parent to find the
tests, and each spawn or forkserver child to unpickle the test method it runs
(the test classes live here), so the substitution holds in the children too,
and ``TestSubstituted`` checks that from inside one. The mode and the start
method come from the environment, which the children inherit.
"""

import multiprocessing
import os
import sys
import types
import unittest

from test import _test_multiprocessing as T

MODE = os.environ.get("ARRAYMP_SUITE_MODE", "stdlib")
METHOD = os.environ.get("ARRAYMP_SUITE_METHOD", "spawn")
# the "processes" flavour of the classes that touch queues, pipes, connections, pools, contexts and processes, in
# the order they run: TestSubstituted first, TestStartMethod last (3.14's test_spawn_dont_set_context leaves the
# start method unset, so the classes after it ran under the default one, forkserver, in the fork and spawn runs)
SELECTED = (
    "TestSubstituted", "WithProcessesTestProcess", "WithProcessesTestSubclassingProcess", "WithProcessesTestQueue",
    "WithProcessesTestPool", "WithProcessesTestPoolWorkerErrors", "WithProcessesTestPoolWorkerLifetime",
    "WithProcessesTestConnection", "WithProcessesTestListenerClient", "WithProcessesTestPoll",
    "WithProcessesTestPicklingConnections", "WithProcessesTestPollEintr", "TestWait", "TestTimeouts",
    "TestSimpleQueue", "TestPoolNotLeakOnFailure", "TestInitializers", "TestIgnoreEINTR", "TestCloseFds",
    "TestResourceTracker", "TestInvalidHandle", "MiscTestCase", "TestStartMethod",
)


class _Multiprocessing(types.ModuleType):
    """``multiprocessing`` as the tests see it: arraymp's names where it has them, the stdlib's otherwise
    (and the stdlib's ``__file__`` etc.: the tests list the stdlib package's modules from it)."""

    def __getattr__(self, name):
        import arraymp

        if name.startswith("__"):
            return getattr(multiprocessing, name)
        try:
            return getattr(arraymp, name)
        except AttributeError:
            return getattr(multiprocessing, name)


def _substitute():
    import arraymp

    T.multiprocessing = _Multiprocessing("multiprocessing")
    T.wait = arraymp.connection.wait
    for name in ("Pool", "Pipe", "Queue", "JoinableQueue"):
        setattr(T.ProcessesMixin, name, staticmethod(getattr(arraymp, name)))
    T.ProcessesMixin.connection = arraymp.connection


def ours() -> dict:
    """What the tests get, checked by type: True where it is arraymp's."""
    import mp_reductions

    from arraymp import _context

    m = T.multiprocessing
    q, (a, b), sq = m.Queue(), m.Pipe(), m.SimpleQueue()
    got = {
        "Queue": type(q) is mp_reductions.Queue,
        "mixin Queue": type(T.ProcessesMixin.Queue()) is mp_reductions.Queue,
        "JoinableQueue": type(T.ProcessesMixin.JoinableQueue()) is mp_reductions.JoinableQueue,
        "SimpleQueue": type(sq) is mp_reductions.SimpleQueue,
        "Pipe": type(a) is mp_reductions.Connection,
        "Pool": T.ProcessesMixin.Pool is m.Pool and m.Pool.__self__ is _context.default_context,
        "get_context": isinstance(m.get_context(), _context._ArrayContext),
        "queues.Queue": m.queues.Queue is mp_reductions.Queue,
    }
    for obj in (q, sq, a, b):
        obj.close()
    return got


class TestSubstituted(unittest.TestCase):
    """The objects under test are arraymp's, here and in a child of the start method under test."""

    @classmethod
    def _child(cls, conn):
        conn.send((ours(), type(conn).__module__))
        conn.close()

    def test_ours_here_and_in_a_child(self):
        self.assertEqual(multiprocessing.get_start_method(), METHOD)
        self.assertTrue(all(ours().values()), ours())
        parent, child = T.multiprocessing.Pipe()
        p = T.multiprocessing.Process(target=self._child, args=(child,))
        p.start()
        child.close()
        got, conn_module = parent.recv() if parent.poll(60) else ({}, None)
        parent.close()
        p.join(60)
        self.assertTrue(got and all(got.values()), f"in a {METHOD} child: {got}")
        self.assertEqual(conn_module, "mp_reductions._connection")


if MODE == "arraymp":
    _substitute()
elif MODE != "stdlib":
    sys.exit(f"ARRAYMP_SUITE_MODE={MODE!r}: use 'stdlib' or 'arraymp'")
else:
    del TestSubstituted

T.install_tests_in_module_dict(globals(), METHOD)
ALL = [name for name, obj in list(globals().items())  # --all: every class installed here
       if isinstance(obj, type) and issubclass(obj, unittest.TestCase) and obj.__module__ == __name__]
