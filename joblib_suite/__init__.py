"""joblib's own ``test_parallel.py`` with the backend "arraymp" beside "loky": see ``run.py``."""
