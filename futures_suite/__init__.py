"""CPython's test_concurrent_futures (its process pool classes) with arraymp's ProcessPoolExecutor substituted:
``python -m futures_suite.run``."""
