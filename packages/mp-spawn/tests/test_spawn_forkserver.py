"""The mp-spawn suite with the 'forkserver' start method."""

from _spawn_suite import ParallelStartSuite, SpawnSuite


class TestForkserver(SpawnSuite):
    start_method = "forkserver"


class TestForkserverParallelStart(ParallelStartSuite):
    start_method = "forkserver"
