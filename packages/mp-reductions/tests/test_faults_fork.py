from _faults_suite import FaultsSuite, HelperThreadsSuite


class TestFaultsFork(FaultsSuite):
    method = "fork"


class TestHelperThreadsFork(HelperThreadsSuite):
    method = "fork"
