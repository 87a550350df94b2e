from _deaths_suite import DeathsSuite


class TestDeathsFork(DeathsSuite):
    method = "fork"
