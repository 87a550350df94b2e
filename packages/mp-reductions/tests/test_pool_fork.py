from _pool_suite import PoolSuite


class TestPoolFork(PoolSuite):
    method = "fork"
