"""The mp-spawn suite with the 'spawn' start method."""

from _spawn_suite import ParallelStartSuite, SpawnSuite


class TestSpawn(SpawnSuite):
    start_method = "spawn"


class TestSpawnParallelStart(ParallelStartSuite):
    start_method = "spawn"
