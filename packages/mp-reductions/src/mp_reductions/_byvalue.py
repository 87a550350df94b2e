"""Functions and classes that a worker could not find by name, sent by value (cloudpickle, as loky sends them).

Note [by value]
~~~~~~~~~~~~~~~
Invariant: a function or class that pickle would send by a name the receiving process cannot import goes by value,
and every other goes by name, as the stdlib sends it. Which cannot: a lambda or a function defined inside another
(its ``__qualname__`` holds ``<``), and a function or class of ``__main__`` not defined in the main module's file:
one defined at an interactive prompt, by ``python -c``, in a script read from stdin, or in a Jupyter cell (a spawn or
forkserver worker imports the main module again from its file, where it is not; a fork worker has only what existed
at the fork).

How: our channels' pickler sees every function and class (``reducer_override``: pickle's C implementation sends those
by name before any table's reducer sees them), so the rule covers a Pool's or executor's function, arguments and
results (an instance of a class from a notebook cell: pickle reaches its class through the instance's reduction),
Queue and Pipe messages, and the target of a spawn or forkserver Process (``reduce_process``, in the stdlib
ForkingPickler's table). By value is cloudpickle's bytes, made once per object (a weak table) and loaded once per
process per bytes (``_loaded``): a map of 10,000 tasks pays one cloudpickle of its function, and its worker one load.
What a process got by value goes back by value (cloudpickle may rebuild a local class under a plain name), and a
class sent back and forth stays one class, so ``isinstance`` holds for what comes back.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import threading
import types
import weakref

_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # object -> its cloudpickle bytes
_loaded: dict[bytes, object] = {}  # bytes -> the object, in the receiving process
_received: weakref.WeakSet = weakref.WeakSet()  # functions and classes this process got by value: they go back so
_LOADED_MAX = 64
_lock = threading.Lock()


@functools.lru_cache(maxsize=64)
def _in_main_file(main_path, code_path: str) -> bool:
    """Whether code of ``code_path`` is the main module's file, ``main_path`` (its ``__file__``)."""
    if _interactive(main_path):
        return False  # python -c, the prompt, a script read from stdin ("<stdin>")
    return os.path.realpath(code_path) == os.path.realpath(main_path)


def dynamic(obj) -> bool:
    """Whether the function or class ``obj`` has no name another process could import (Note [by value])."""
    if "<" in getattr(obj, "__qualname__", "<") or obj in _received:
        return True
    if getattr(obj, "__module__", None) != "__main__":
        return False
    main_path = getattr(sys.modules.get("__main__"), "__file__", None)
    codes = [obj.__code__] if hasattr(obj, "__code__") else [
        f.__code__ for f in vars(obj).values() if isinstance(f, types.FunctionType)]
    return not codes or any(not _in_main_file(main_path, code.co_filename) for code in codes)


@functools.lru_cache(maxsize=8)
def _interactive(main_path) -> bool:
    return not (isinstance(main_path, str) and os.path.isfile(main_path))


def reducer_override(obj):
    """Our channels' picklers' ``reducer_override``: a function or class (and so the class of an instance, which
    pickle reaches through the instance's reduction) that must go by value does."""
    if isinstance(obj, (types.FunctionType, type)) and dynamic(obj):
        return _by_value, (_bytes(obj),)
    return NotImplemented


def target(func):
    """``func`` to send as a pool's function or a process's target: itself, or wrapped to go by value when pickle
    would send it (a function, a class, the class or function of a bound method or partial) by a name the worker
    cannot import (Note [by value])."""
    inner = func
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, types.MethodType):
        inner = inner.__self__ if isinstance(inner.__self__, type) else type(inner.__self__)
    if isinstance(inner, (types.FunctionType, type)) and dynamic(inner):
        return ByValue(func)
    return func


def reduce_process(process):
    """ForkingPickler's reducer of a spawn or forkserver Process (pickled once, to start it): its target by value
    when it must be (Note [by value])."""
    rv = process.__reduce_ex__(4)
    state = rv[2]
    if isinstance(state, dict) and state.get("_target") is not None:
        wrapped = target(state["_target"])
        if wrapped is not state["_target"]:
            rv = (*rv[:2], {**state, "_target": wrapped}, *rv[3:])
    return rv


class ByValue:
    """``obj`` pickled by value; unpickled, the object itself."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        return _by_value, (_bytes(self.obj),)

    def __call__(self, *args, **kwds):  # (in the sender's own process: the object's call)
        return self.obj(*args, **kwds)


def _bytes(obj) -> bytes:
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - a dependency of mp-reductions
        raise pickle.PicklingError(f"{obj!r} can only be sent by value, which needs cloudpickle: `pip install "
                                   f"cloudpickle` ({exc})") from exc
    with _lock:
        try:
            data = _made.get(obj)
        except TypeError:  # not weakly referenceable (a partial of a lambda: cheap enough to make again)
            data = None
        if data is None:
            data = cloudpickle.dumps(obj, protocol=5)
            try:
                _made[obj] = data
            except TypeError:
                pass
        return data


def _by_value(data: bytes):
    """The receiver's rebuild: the object, loaded once per process for the same bytes."""
    with _lock:
        obj = _loaded.get(data)
    if obj is None:
        obj = pickle.loads(data)
        if isinstance(obj, (types.FunctionType, type)):
            _received.add(obj)
        with _lock:
            if len(_loaded) >= _LOADED_MAX:
                _loaded.pop(next(iter(_loaded)))
            _loaded[data] = obj
    return obj
