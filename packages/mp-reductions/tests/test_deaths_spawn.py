from _deaths_suite import DeathsSuite


class TestDeathsSpawn(DeathsSuite):
    method = "spawn"
