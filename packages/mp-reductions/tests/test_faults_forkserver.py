from _faults_suite import FaultsSuite, HelperThreadsSuite


class TestFaultsForkserver(FaultsSuite):
    method = "forkserver"


class TestHelperThreadsForkserver(HelperThreadsSuite):
    method = "forkserver"
