"""``arraymp.get_context("dask", ...)`` (when the facade is installed too)."""

from __future__ import annotations

import subprocess
import sys

import mp_dask
import pytest


def test_get_context_dask_is_lazy():
    mp = pytest.importorskip("arraymp")
    ctx = mp.get_context("dask", n_workers=2, same_node=False)
    assert isinstance(ctx, mp_dask.DaskContext) and not ctx.same_node
    assert ctx._client is None  # nothing started before first use
    assert isinstance(mp.get_context("spawn").get_context("dask"), mp_dask.DaskContext)


def test_missing_mp_dask_names_the_extra():
    pytest.importorskip("arraymp")
    code = ("import sys; sys.modules['mp_dask'] = None\n"
            "import arraymp\n"
            "try:\n    arraymp.get_context('dask')\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'arraymp[dask]'" in out.stdout, out
