from _deaths_suite import DeathsSuite


class TestDeathsForkserver(DeathsSuite):
    method = "forkserver"
