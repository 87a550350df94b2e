from _suite import QueueSuite


class TestQueuesForkserver(QueueSuite):
    method = "forkserver"
