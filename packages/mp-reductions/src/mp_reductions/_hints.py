"""What to do, added to errors whose stdlib message does not say it: a task whose function cannot be pickled.

The stdlib's Pool pickles each task (its function, by module and name) to send it; a lambda, or a function defined
inside another, has no name a worker can import, and the task fails with pickle's bare ``PicklingError`` (3.11 and
3.12 raise ``AttributeError`` for a local function). The error keeps its type; a note (``add_note``, shown under the
traceback) names the function and the fix.
"""

from __future__ import annotations

import functools
import pickle
import types

_SCAN = 16  # items of a sequence looked at, at most (a map's chunk may hold millions)
_DEPTH = 3  # levels of tuples, lists, dicts and partials looked into (a map's task: (mapstar, ((func, chunk),)))

HINT = (
    "{what} cannot be sent to the worker processes: pickle sends a function by its module and name, and a lambda or "
    "a function defined inside another function has none that a worker can import. Define it with `def` at the top "
    "level of a module (in a script, above `if __name__ == \"__main__\":`); or run it through the joblib backend "
    "(`import arraymp.joblib` and `with joblib.parallel_config(backend=\"arraymp\"):`), which sends lambdas and "
    "closures by value"
)
_MARK = "cannot be sent to the worker processes"


def _unpicklable_function(obj, depth: int = _DEPTH):
    """The first lambda or local function in ``obj`` (looked into a few levels deep), else None."""
    if isinstance(obj, types.FunctionType):
        name = obj.__qualname__
        return obj if "<lambda>" in name or "<locals>" in name else None
    if depth == 0:
        return None
    if isinstance(obj, functools.partial):
        items = [obj.func, *obj.args[:_SCAN], *list(obj.keywords.values())[:_SCAN]]
    elif isinstance(obj, (tuple, list)):
        items = obj[:_SCAN]
    elif isinstance(obj, dict):
        items = list(obj.values())[:_SCAN]
    else:
        return None
    for item in items:
        found = _unpicklable_function(item, depth - 1)
        if found is not None:
            return found
    return None


def _describe(func) -> str:
    code = getattr(func, "__code__", None)
    where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    if func.__name__ == "<lambda>":
        return f"The lambda{where}"
    return f"The function {func.__qualname__!r}{where}, local to another function,"


def add_pickling_hint(exc: BaseException, task) -> None:
    """Add the hint to ``exc``, raised while pickling ``task`` (a Pool's ``(job, i, func, args, kwds)``), when a
    lambda or local function in it is the likely cause; once."""
    if not isinstance(exc, (pickle.PicklingError, AttributeError)):
        return
    text = str(exc)
    if not any(s in text for s in ("<lambda>", "<locals>", "local object")):  # another object could not be pickled
        return
    if any(_MARK in note for note in getattr(exc, "__notes__", ())):
        return
    try:
        func = _unpicklable_function(tuple(task[2:]) if isinstance(task, tuple) else task)
    except Exception:  # an odd object in the task: the hint without its name rather than a second error
        func = None
    exc.add_note(HINT.format(what=_describe(func) if func is not None else "A lambda or local function"))
