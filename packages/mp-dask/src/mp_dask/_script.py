"""Functions of the script (``__main__``) on Dask workers: one globals namespace per pool and worker.

Note [Script namespaces]
~~~~~~~~~~~~~~~~~~~~~~~~
Invariant: on a Dask worker, the functions of the script (``__main__``) that a pool's initializer, tasks or arguments
hold run over one globals namespace per pool and worker: a global the initializer sets is seen by that pool's tasks and
no other pool's, as on the stdlib's workers.

Why: cloudpickle sends a function of ``__main__`` by value (a worker cannot import the script), rebuilt over a fresh
dict of the globals it names per pickle: the initializer (pickled once, in a worker plugin) and each task's function had
dicts of their own, so after an initializer's ``global X; X = ...`` a task read the script's X, or got NameError (the
stdlib's workers import the script as a module).

How: a Pool or executor binds the script's functions (its classes', lambdas, partials too) to a namespace the pool
names, made on first use::

    client: pickle initializer / (func, payload)     worker: one dict per pool
        function of __main__ ──────────────────────▶ FunctionType(code, namespace(pool), ...)
        the globals it names (the script's values) ─▶ namespace.setdefault(name, value)

A name the namespace has keeps its value (the worker's own state wins, as in a module imported once): a global the
script rebinds after the pool started is not seen (pass it as an argument). The namespace goes when the pool closes (its
initializer's plugin is removed, or ``drop`` runs on every worker). Functions of importable modules travel by reference.
It uses two private names of cloudpickle (``Pickler._dynamic_function_reduce``, ``_function_setstate``); the tests run a
script's initializer and tasks.
"""

from __future__ import annotations

import builtins
import sys
import threading

from cloudpickle import cloudpickle as _cp

_namespaces: dict[str, dict] = {}  # pool key -> the script's globals for that pool, in this process
_sent: set[str] = set()  # pools whose messages from this process bound a function to their namespace
_lock = threading.Lock()


def namespace(key: str) -> dict:
    """The globals of the script's functions of pool ``key`` in this process (made on first use)."""
    with _lock:
        ns = _namespaces.get(key)
        if ns is None:
            ns = _namespaces[key] = {"__name__": "__main__", "__builtins__": builtins}
        return ns


def drop(key: str) -> None:
    """The pool ``key`` closed: its namespace goes (its functions keep it while they live)."""
    with _lock:
        _namespaces.pop(key, None)


class NamespaceRef:
    """Pickled as ``namespace(key)``: the dict a script function is rebuilt over."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key

    def __reduce__(self):
        return namespace, (self.key,)


def sent(key: str) -> bool:
    """Whether a function was sent bound to pool ``key``'s namespace (forgetting it: the pool closes)."""
    with _lock:
        found = key in _sent
        _sent.discard(key)
        return found


def is_script_function(func, key: str) -> bool:
    """Whether ``func``'s globals are the script's (here, or pool ``key``'s namespace on a worker)."""
    g = func.__globals__
    main = sys.modules.get("__main__")
    return (main is not None and g is vars(main)) or g is _namespaces.get(key)


def reduce_in_namespace(pickler, func, key_ref: NamespaceRef):
    """cloudpickle's reduction of ``func``, rebuilt over ``namespace(key)`` instead of a dict of its own."""
    make, (code, _own_globals, name, argdefs, closure), state, *_ = _cp.Pickler._dynamic_function_reduce(pickler, func)
    if func.__globals__ is not _namespaces.get(key_ref.key):  # the script's own: this process is the client
        with _lock:
            _sent.add(key_ref.key)
    return make, (code, key_ref, name, argdefs, closure), state, None, None, _setstate_in_namespace


def _setstate_in_namespace(func, state) -> None:
    """cloudpickle's ``_function_setstate``, with the globals the function names added to its namespace only
    where the namespace has no value yet (Note [Script namespaces])."""
    state, slotstate = state
    ns = func.__globals__
    for k, v in slotstate["__globals__"].items():
        ns.setdefault(k, v)
    _cp._function_setstate(func, (state, {**slotstate, "__globals__": {}}))
