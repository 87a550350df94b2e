"""Every private name of the standard library that arraymp depends on (issue 32).

PRIVATE below lists them: one row per dependency, with what breaks if it goes.
``test_private_name_exists`` fails on a Python where one is gone or changed (a
method called or overridden with other parameters), so it must pass on every
supported version (3.11-3.15): a failure there is a bug to fix, not a test to
skip. ``test_no_unlisted_private_access`` fails when our source reaches a new
private name of a stdlib module: add it to PRIVATE (or, better, don't).

Not listed: ``os._exit`` and ``sys._getframe`` (documented), and names of
ours. ``concurrent.futures`` has none: the executors use only its public API.
Undocumented names without an underscore (``multiprocessing.pool.job_counter``,
``RUN``/``CLOSE``/``TERMINATE``, ``context.get_spawning_popen``, ...) are not
private by name and are not listed either.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import multiprocessing
import pathlib
import sys
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import pool as mp_pool

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
_POOL = "mp_reductions/_pool.py"
_DASK_POOL = "mp_dask/_pool.py"

# (stdlib module or class, private name, kind, our file that uses it, what breaks if it goes).
# A name written as a call, ``_set(i, obj)``, is also a signature: the parameters we pass (or, for an
# override, those the stdlib passes to ours), in order; names after ``*`` are passed by keyword.
PRIVATE = [
    ("multiprocessing.queues.Queue", "_on_queue_feeder_error(e, obj)", "method we call", "mp_reductions/_queues.py",
     "read at import (mp_reductions fails to import); a subclass's feeder-error hook is called with (e, obj)"),
    ("multiprocessing.queues.SimpleQueue", "_reader", "attribute", "mp_reductions/_queues.py",
     "the stdlib's Pool reads inqueue._reader / outqueue._reader: ours exposes it so that Pool runs on ours"),
    ("multiprocessing.queues.SimpleQueue", "_writer", "attribute", "mp_reductions/_queues.py",
     "the stdlib's Pool sends by inqueue._writer: ours exposes it so that Pool runs on ours"),
    ("multiprocessing.queues.SimpleQueue", "_rlock", "attribute", "mp_reductions/_queues.py",
     "the stdlib's Pool._help_stuff_finish takes inqueue._rlock at terminate()"),
    ("multiprocessing.pool", "_PoolCache(*, notifier)", "signature", _POOL,
     "subclassed at import (mp_reductions fails to import); its __delitem__ wakes the worker handler"),
    ("multiprocessing.pool", "_helper_reraises_exception", "attribute", _POOL,
     "a worker's failing task raises AttributeError instead of sending the task's error"),
    ("multiprocessing.pool.ApplyResult", "_cache", "attribute", f"{_POOL}, {_DASK_POOL}",
     "result objects take pool._cache (mp_dask's Pool has one for them) and leave it when set"),
    ("multiprocessing.pool.ApplyResult", "_job", "attribute", _POOL,
     "apply_async sends result._job with the task: results could not be matched to tasks"),
    ("multiprocessing.pool.ApplyResult", "_set(i, obj)", "method we call", f"{_POOL}, {_DASK_POOL}",
     "results are never set: get() waits forever"),
    ("multiprocessing.pool.MapResult", "_set(i, success_result)", "method we call", f"{_POOL}, {_DASK_POOL}",
     "map results are never set: get() waits forever"),
    ("multiprocessing.pool.IMapIterator", "_set(i, obj)", "method we call", f"{_POOL}, {_DASK_POOL}",
     "imap results are never set: iteration waits forever"),
    ("multiprocessing.pool.IMapUnorderedIterator", "_set(i, obj)", "method we call", f"{_POOL}, {_DASK_POOL}",
     "imap_unordered results are never set: iteration waits forever"),
    ("multiprocessing.pool.IMapIterator", "_set_length(length)", "method we call",
     f"{_DASK_POOL}, mp_reductions/_progress.py", "mp_dask's imap never ends; an imap's bar never learns its total"),
    ("multiprocessing.pool.Pool", "_check_running()", "method we call", _POOL, "apply_async raises AttributeError"),
    ("multiprocessing.pool.Pool", "_map_async(func, iterable, mapper, chunksize, callback, error_callback)",
     "method we override", _POOL, "map, starmap and their _async forms fail (ours calls super()'s without progress=)"),
    ("multiprocessing.pool.Pool", "_get_tasks(func, it, size)", "method we call", _POOL,
     "a map with progress= fails: its chunks are made by it"),
    ("multiprocessing.pool.Pool", "_guarded_task_generation(result_job, func, iterable)", "method we call", _POOL,
     "a map with progress= fails: its tasks are made by it"),
    ("multiprocessing.pool.Pool", "_repopulate_pool()", "method we call", _POOL, "Pool() raises AttributeError"),
    ("multiprocessing.pool.Pool",
     "_repopulate_pool_static(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs, "
     "maxtasksperchild, wrap_exception)", "method we override", _POOL,
     "the stdlib's _repopulate_pool calls ours with these: Pool() starts no worker or fails"),
    ("multiprocessing.pool.Pool", "_help_stuff_finish(inqueue, task_handler, size)", "method we override", _POOL,
     "the stdlib's _terminate_pool calls ours: terminate() fails or hangs on a task handler waiting for a slot"),
    ("multiprocessing.pool.Pool",
     "_terminate_pool(taskqueue, inqueue, outqueue, pool, change_notifier, worker_handler, task_handler, "
     "result_handler, cache)", "method we override", _POOL,
     "the Finalize made by our __init__ calls it, ours calls super()'s: close/terminate fail, workers leak"),
    ("multiprocessing.pool.Pool", "_handle_tasks(taskqueue, put, outqueue, pool, cache)", "method we call", _POOL,
     "Pool() fails: our __init__ starts the stdlib's task handler with these"),
    ("multiprocessing.pool.Pool", "_wait_for_updates(sentinels, change_notifier, timeout)", "method we call", _POOL,
     "our worker handler fails: dead workers are never replaced"),
    ("multiprocessing.pool.Pool", "_get_worker_sentinels(workers)", "method we call", _POOL,
     "our worker handler fails: dead workers are never replaced"),
    ("multiprocessing.pool.Pool", "_wrap_exception", "attribute", _POOL, "Pool() raises AttributeError"),
    ("multiprocessing.pool.Pool", "_worker_handler._state", "attribute", _POOL,
     "the stdlib's close()/terminate() stop the handler threads by setting their _state, which our handlers "
     "read (threading.current_thread()._state): close/join would hang"),
    ("multiprocessing.forkserver", "_forkserver", "attribute", _POOL,
     "read with a default: the fork server no longer preloads our packages, so each forkserver worker imports "
     "numpy and ours itself before its first task (Note [fork server preload])"),
    ("multiprocessing.forkserver.ForkServer", "_preload_modules", "attribute", _POOL,
     "read with a default: as for _forkserver (a list we extend, keeping the names the user set)"),
    ("multiprocessing.process.BaseProcess", "_popen", "attribute", "mp_spawn/_spawn.py",
     "start_processes' clean-up after a failed start raises AttributeError"),
    ("multiprocessing.spawn", "_inheriting", "attribute", "mp_spawn/_spawn.py",
     "set on current_process() while a spawned child unpickles its main: read with a default, so the guard "
     "against start_processes at import of __main__ in a child is silently lost"),
    ("multiprocessing.reduction.ForkingPickler", "_extra_reducers", "attribute",
     "mp_reductions/_channel.py, _reductions.py, _bare.py; arraymp/_bench.py",
     "our channels' pickler misses every registered reducer (arrays go by copy); init_reductions fails"),
    ("subprocess", "_fork_exec", "attribute", "mp_reductions/_nofile.py",
     "looked up with a default: subprocess children silently keep the raised RLIMIT_NOFILE"),
    ("_posixsubprocess", "fork_exec", "attribute", "mp_reductions/_nofile.py",
     "the module gone: _nofile fails to import; the name gone: spawn/forkserver children silently keep the "
     "raised RLIMIT_NOFILE (a C function: no signature assumed, our wrapper passes *args, **kwargs)"),
    ("test", "_test_multiprocessing", "attribute", "stdlib_suite/_suite.py", "the stdlib suite cannot run"),
    ("test._test_multiprocessing", "ProcessesMixin", "attribute", "stdlib_suite/_suite.py",
     "the stdlib suite cannot run"),
    ("test._test_multiprocessing", "install_tests_in_module_dict", "attribute", "stdlib_suite/_suite.py",
     "the stdlib suite cannot run"),
]

# Where the dependency is on how the stdlib uses a name, not on an attribute we can look up: the stdlib
# module whose source must still contain it.
IN_SOURCE = {
    ("multiprocessing.spawn", "_inheriting"): ("multiprocessing.spawn", "._inheriting"),
    # we wrap the module attributes: they are only seen if the stdlib calls through them
    ("subprocess", "_fork_exec"): ("subprocess", "_fork_exec("),
    ("_posixsubprocess", "fork_exec"): ("multiprocessing.util", "_posixsubprocess.fork_exec("),
}


class _StubPool:
    """The only thing the stdlib's result objects take from the pool they are made for."""

    def __init__(self):
        self._cache = {}


@contextlib.contextmanager
def _simple_queue():
    q = multiprocessing.get_context("spawn").SimpleQueue()
    try:
        yield q
    finally:
        q.close()


@contextlib.contextmanager
def _closed_thread_pool():
    # ThreadPool runs the stdlib Pool's own __init__, close() and _terminate_pool, without processes
    p = mp_pool.ThreadPool(1)
    try:
        p.close()
        yield p
    finally:
        p.join()


# Real instances, for names that exist only on instances.
INSTANCES = {
    "multiprocessing.queues.SimpleQueue": _simple_queue,
    "multiprocessing.pool.Pool": _closed_thread_pool,
    "multiprocessing.pool.ApplyResult": lambda: contextlib.nullcontext(mp_pool.ApplyResult(_StubPool(), None, None)),
    "multiprocessing.forkserver.ForkServer": lambda: contextlib.nullcontext(mp_forkserver.ForkServer()),
    "multiprocessing.process.BaseProcess": lambda: contextlib.nullcontext(multiprocessing.get_context().Process()),
}

# Our code makes these stdlib objects with its own __init__ (mp_reductions' Pool and _ApplyResult), setting the
# attributes the stdlib's __init__ sets, for the stdlib's other methods: the same set, or those methods break.
REPLICATED = {
    # _quick_get: only the stdlib's own _handle_results used it; ours replaces that handler
    "multiprocessing.pool.Pool": (_closed_thread_pool, {"_quick_get"}, {
        "_cache", "_change_notifier", "_ctx", "_initargs", "_initializer", "_inqueue", "_maxtasksperchild",
        "_outqueue", "_pool", "_processes", "_quick_put", "_result_handler", "_state", "_task_handler", "_taskqueue",
        "_terminate", "_worker_handler"}),
    "multiprocessing.pool.ApplyResult": (INSTANCES["multiprocessing.pool.ApplyResult"], set(), {
        "_pool", "_event", "_job", "_cache", "_callback", "_error_callback"}),
}


def _resolve(dotted: str):
    """A module, or a class in one (``multiprocessing.pool.Pool``)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _split(name: str) -> tuple[str, list[str] | None]:
    """``"_set(i, obj)"`` -> ``("_set", ["i", "obj"])``; ``"_reader"`` -> ``("_reader", None)``."""
    if "(" not in name:
        return name, None
    attr, params = name.rstrip(")").split("(")
    return attr, [p.strip() for p in params.split(",") if p.strip()]


def _getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("target, name, kind, used_in, breaks", PRIVATE, ids=[f"{t}.{_split(n)[0]}"
                                                                              for t, n, *_ in PRIVATE])
def test_private_name_exists(target, name, kind, used_in, breaks):
    if target.startswith("test") and importlib.util.find_spec("test._test_multiprocessing") is None:
        pytest.skip("no `test` package here (only the stdlib suite needs it)")
    attr, params = _split(name)
    obj = _resolve(target)
    if (target, attr) in IN_SOURCE:
        module, needle = IN_SOURCE[target, attr]
        assert needle in inspect.getsource(importlib.import_module(module)), f"{module} no longer uses {needle}"
        if not inspect.ismodule(obj) or not hasattr(obj, attr):  # set only while the stdlib runs
            return
    if target in INSTANCES:
        with INSTANCES[target]() as instance:
            assert hasattr(instance, attr.split(".")[0]), f"{target} instances have no {attr}: {breaks}"
            found = _getattr_path(instance, attr)
    elif hasattr(obj, "__path__") and importlib.util.find_spec(f"{target}.{attr}") is not None:
        found = importlib.import_module(f"{target}.{attr}")  # a submodule
    else:
        assert hasattr(obj, attr), f"{target} has no {attr}: {breaks}"
        found = getattr(obj, attr)
    if params is None:
        return
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a C function: no signature to check
        return
    names = list(signature.parameters)
    if inspect.isclass(obj) and inspect.isfunction(found) and inspect.isfunction(inspect.getattr_static(obj, attr)):
        names = names[1:]  # a plain method looked up on the class: self
    positional = params[:params.index("*")] if "*" in params else params
    keywords = params[len(positional) + 1:]
    assert names[:len(positional)] == positional and set(keywords) <= set(names), (
        f"{target}.{attr}{signature}: we pass ({', '.join(params)}); {breaks}")


@pytest.mark.parametrize("target", REPLICATED)
def test_replicated_init_sets_the_same_attributes(target):
    make, unused, ours = REPLICATED[target]
    with make() as instance:
        assert set(vars(instance)) - unused == ours, f"{target}.__init__ changed: ours must set the same attributes"
        if target == "multiprocessing.pool.Pool":  # close() tells the handler threads by their _state
            assert instance._worker_handler._state == mp_pool.CLOSE


def _stdlib(module: str) -> bool:
    return module.partition(".")[0] in sys.stdlib_module_names


def _private_accesses(path: pathlib.Path):
    """(stdlib dotted path, private name) for each ``alias[.attr...]._name`` and ``import``/``from ... import _name``
    in one file, where ``alias`` is bound by an import of a stdlib module or of a name in one (anywhere in the file,
    functions included). Heuristic: it cannot see private names reached through instances (``process._popen``,
    ``self._x``), only through names bound by imports; ``(alias, "_name")`` pairs (getattr, tables) are seen."""
    tree, aliases = ast.parse(path.read_text()), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _stdlib(a.name):
                    aliases[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
                    if a.name.startswith("_"):
                        yield a.name, ""
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _stdlib(node.module):
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if a.name.startswith("_"):
                    yield node.module, a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            chain = []
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases and not any(c.startswith("_") for c in chain):
                yield ".".join([aliases[base.id], *chain]), node.attr
        elif isinstance(node, (ast.Tuple, ast.Call)):
            items = node.elts if isinstance(node, ast.Tuple) else node.args
            for a, b in zip(items, items[1:], strict=False):
                if (isinstance(a, ast.Name) and a.id in aliases and isinstance(b, ast.Constant)
                        and isinstance(b.value, str) and b.value.startswith("_")):
                    yield aliases[a.id], b.value


DOCUMENTED = {("os", "_exit"), ("sys", "_getframe")}


def test_no_unlisted_private_access():
    listed = {(t, _split(n)[0]) for t, n, *_ in PRIVATE} | DOCUMENTED
    listed_modules = {t for t, *_ in PRIVATE}
    files = [*REPO.glob("packages/*/src/*/*.py"), *REPO.glob("src/arraymp/*.py")]
    assert files
    unlisted = set()
    for path in files:
        for target, name in _private_accesses(path):
            ok = (target in listed_modules) if not name else (target, name) in listed
            if not ok:
                unlisted.add(f"{path.relative_to(REPO)}: {target}{'.' if name else ''}{name}")
    assert not unlisted, "private stdlib names not in PRIVATE (add them, with what breaks):\n" + "\n".join(
        sorted(unlisted))
