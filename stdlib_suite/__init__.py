"""CPython's multiprocessing test suite with arraymp's objects substituted: ``python -m stdlib_suite.run``."""
