from _progress_suite import ProgressSuite


class TestProgressSpawn(ProgressSuite):
    method = "spawn"
