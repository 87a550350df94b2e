"""Run a function when a module's import completes, without importing it.

``init_reductions`` must not import cupy: that costs ~0.1 s in every process
that imports arraymp, and asking cupy for devices initialises the CUDA driver,
after which a forked child can no longer use CUDA at all. So the cupy reducer
is registered when the program itself imports cupy: a finder at the front of
``sys.meta_path`` finds cupy's spec through the other finders and wraps its
loader, which runs the callbacks after cupy's module has executed.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()


class _Loader:  # the loader protocol (importlib.abc.Loader's import cost every program ~4 ms)
    def __init__(self, loader, name):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module sees its own loader
        self.loader.exec_module(module)
        with _lock:  # taken only now: a find_spec() alone (a probe for cupy) must not use them up
            callbacks = _finder.pending.pop(self.name, [])
            if not _finder.pending and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
        for fn in callbacks:
            fn(module)


class _Finder:  # the meta path finder protocol
    def __init__(self):
        self.pending: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _Loader(spec.loader, fullname)
        return spec


_finder = _Finder()


def when_imported(name: str, fn: Callable) -> bool:
    """Call ``fn(module)`` once the top-level module ``name`` is imported: now if it already is
    (then returns True). Pending callbacks are kept once each."""
    if sys.modules.get(name) is not None:  # imported, or being imported (by another thread: this import waits for it)
        fn(importlib.import_module(name))
        return True
    with _lock:
        callbacks = _finder.pending.setdefault(name, [])
        if fn not in callbacks:
            callbacks.append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return False
