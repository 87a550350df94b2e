from _pool_suite import PoolSuite


class TestPoolForkserver(PoolSuite):
    method = "forkserver"
