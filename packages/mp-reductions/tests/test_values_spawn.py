from _values_suite import ValuesSuite


class TestValuesSpawn(ValuesSuite):
    method = "spawn"
