from _progress_suite import ProgressSuite


class TestProgressFork(ProgressSuite):
    method = "fork"
