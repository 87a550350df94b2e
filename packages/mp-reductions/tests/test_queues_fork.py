from _suite import QueueSuite


class TestQueuesFork(QueueSuite):
    method = "fork"
