from _pool_suite import PoolSuite


class TestPoolSpawn(PoolSuite):
    method = "spawn"
