from _suite import QueueSuite


class TestQueuesSpawn(QueueSuite):
    method = "spawn"
