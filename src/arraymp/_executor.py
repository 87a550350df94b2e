"""``ProcessPoolExecutor``: mp_reductions' executor (concurrent.futures' API over arraymp's pool core: see
mp_reductions' _pool/executor.py), with arraymp's context as the default ``mp_context``."""

from __future__ import annotations

from mp_reductions import ProcessPoolExecutor as _Executor

from ._context import default_context


class ProcessPoolExecutor(_Executor):
    __doc__ = (_Executor.__doc__ or "").replace("``multiprocessing.get_context()``", "``arraymp.get_context()``")
    _default_context = staticmethod(default_context.get_context)
