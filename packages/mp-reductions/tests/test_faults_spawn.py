from _faults_suite import FaultsSuite, HelperThreadsSuite


class TestFaultsSpawn(FaultsSuite):
    method = "spawn"


class TestHelperThreadsSpawn(HelperThreadsSuite):
    method = "spawn"
