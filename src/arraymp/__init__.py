"""arraymp: multiprocessing for array programs."""

import sys

if not sys.platform.startswith("linux"):  # pragma: no cover
    raise ImportError(f"arraymp supports Linux only; this is {sys.platform}")

__all__ = []
__version__ = "0.1.0"
