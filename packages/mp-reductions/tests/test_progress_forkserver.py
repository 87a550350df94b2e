from _progress_suite import ProgressSuite


class TestProgressForkserver(ProgressSuite):
    method = "forkserver"
