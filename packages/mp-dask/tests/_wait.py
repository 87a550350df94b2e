"""Waiting with a bound, for the tests here and in ../nodes: a hang check for a loaded machine, not a timing."""

from __future__ import annotations

import gc
import time

import pytest


def wait_until(pred, timeout: float, what: str) -> float:
    """Wait for ``pred()`` (collecting garbage between tries, which releases views); fail after ``timeout`` s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        gc.collect()
        time.sleep(0.05)
    return time.monotonic() - t0
