"""Functions the multi-node tests run on Dask workers (importable there: the nodes' PYTHONPATH names this folder)."""

from __future__ import annotations

import os
import time

import numpy as np


def where_doubled(a):
    """(the name of the worker that ran it, ``a * 2``)."""
    from distributed import get_worker

    return get_worker().name, a * 2


def doubled(a):
    return a * 2


def stall_on(a, name: str, marker: str):
    """On the worker named ``name``: say which process runs it (in ``marker``), then hang until killed; elsewhere,
    ``a * 2`` at once."""
    from distributed import get_worker

    if get_worker().name != name:
        return a * 2
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(marker + ".tmp", marker)
    time.sleep(600)
    return np.zeros(0)
