from _values_suite import ValuesSuite


class TestValuesForkServer(ValuesSuite):
    method = "forkserver"
