"""The mp-spawn suite with the 'fork' start method."""

from _spawn_suite import SpawnSuite


class TestFork(SpawnSuite):
    start_method = "fork"
