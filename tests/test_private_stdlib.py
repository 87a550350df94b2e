"""Every private name of the standard library (and of third-party packages) that arraymp depends on (issues 32, 41).

PRIVATE below lists them: one row per dependency, with what breaks if it goes;
HARNESS those only the test harnesses need, THIRD_PARTY those of other
packages. ``test_private_name_exists`` fails on a Python where one is gone or
changed (a method called or overridden with other parameters), so it must pass
on every supported version (3.11-3.15): a failure there is a bug to fix, not a
test to skip. ``test_no_unlisted_private_access`` fails when our source reaches
a new private name of a stdlib module through a name an import bound;
``test_no_foreign_private_attribute`` when it reaches, through any object
(``process._popen``, ``getattr(obj, "_name")``), a private attribute
that no code of ours defines: add it to a list (or, better, don't).

Not listed: ``os._exit`` and ``sys._getframe`` (documented), and names of
ours. Undocumented names without an underscore (``context.get_spawning_popen``,
``multiprocessing.pool.ExceptionWithTraceback``, ...) are not private by name
and are not listed either. The pool is ours (mp_reductions/_pool/): it
subclasses the stdlib's Pool and result classes for ``isinstance`` and calls
none of their methods.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import pathlib
import sys
from multiprocessing import forkserver as mp_forkserver

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
_WORKER = "mp_reductions/_pool/worker.py"
_CORE = "mp_reductions/_pool/core.py"

# (stdlib module or class, private name, kind, our file that uses it, what breaks if it goes).
# A name written as a call, ``_set(i, obj)``, is also a signature: the parameters we pass (or, for an
# override, those the stdlib passes to ours), in order; names after ``*`` are passed by keyword.
PRIVATE = [
    ("multiprocessing.forkserver", "_forkserver", "attribute", _CORE,
     "read with a default: the fork server no longer preloads our packages, so each forkserver worker imports "
     "numpy and ours itself before its first task (Note [fork server preload])"),
    ("multiprocessing.forkserver.ForkServer", "_preload_modules", "attribute", _CORE,
     "read with a default: as for _forkserver (a list we extend, keeping the names the user set)"),
    ("multiprocessing.reduction.ForkingPickler", "_extra_reducers", "attribute",
     "mp_reductions/_channel.py, _reductions.py, _bare.py; arraymp/_bench.py",
     "our channels' pickler misses every registered reducer (arrays go by copy); init_reductions fails"),
    ("subprocess", "_fork_exec", "attribute", "mp_reductions/_nofile.py",
     "looked up with a default: subprocess children silently keep the raised RLIMIT_NOFILE"),
    ("subprocess", "_USE_VFORK", "attribute", "mp_reductions/_nofile.py",
     "set False once the limit is raised: the name gone, children vforked with the GIL released may see other "
     "threads refused descriptors while the limit is lowered for them (Note [open-files limit])"),
    ("subprocess", "_USE_POSIX_SPAWN", "attribute", "mp_reductions/_nofile.py",
     "set False once the limit is raised: the name gone, Popen's posix_spawn fails with EBADF (its pipes past the "
     "old limit) or its children keep the raised limit"),
    ("_posixsubprocess", "fork_exec", "attribute", "mp_reductions/_nofile.py",
     "the module gone: _nofile fails to import; the name gone: spawn/forkserver children silently keep the "
     "raised RLIMIT_NOFILE (a C function: no signature assumed, our wrapper passes *args, **kwargs)"),
    ("threading", "_register_atexit(func)", "function we call", "mp_reductions/_pool/executor.py",
     "read with a default (atexit.register): executors not shut down still finish their calls at exit, but an "
     "atexit function registered after the executor was first used runs first and may still submit"),
]

# What only the test harnesses need (stdlib_suite/, futures_suite/): their runs fail, no user sees it.
HARNESS = [
    ("test", "_test_multiprocessing", "attribute", "stdlib_suite/_suite.py", "the stdlib suite cannot run"),
    ("test._test_multiprocessing", "ProcessesMixin", "attribute", "stdlib_suite/_suite.py",
     "the stdlib suite cannot run"),
    ("test._test_multiprocessing", "install_tests_in_module_dict", "attribute", "stdlib_suite/_suite.py",
     "the stdlib suite cannot run"),
]

# Private names of third-party packages we depend on, checked where the package is installed.
THIRD_PARTY = [
    ("joblib.parallel.ParallelBackendBase", "_prepare_worker_env(n_jobs)", "method we call", "arraymp/joblib.py",
     "the backend's workers no longer get joblib's limits on BLAS/OpenMP threads (inner_max_num_threads)"),
    ("cloudpickle.cloudpickle", "_function_setstate(obj, state)", "function we call", "mp_dask/_script.py",
     "a script's functions sent to Dask workers fail to rebuild there"),
    ("cloudpickle.cloudpickle.Pickler", "_dynamic_function_reduce(func)", "method we call / override",
     "mp_dask/_script.py", "a script's functions are no longer sent by value to Dask workers"),
    ("distributed.nanny.Nanny", "_on_worker_exit_sync", "attribute", "mp_dask/_deaths.py",
     "read with a default: a Dask worker's death is no longer explained (its exit code and signal) in the "
     "client's DaskWorkerLostError"),
]

# Where the dependency is on how the stdlib uses a name, not on an attribute we can look up: the stdlib
# module whose source must still contain it.
IN_SOURCE = {
    # we wrap the module attributes: they are only seen if the stdlib calls through them
    ("subprocess", "_fork_exec"): ("subprocess", "_fork_exec("),
    ("subprocess", "_USE_VFORK"): ("multiprocessing.util", "subprocess._USE_VFORK"),
    ("subprocess", "_USE_POSIX_SPAWN"): ("subprocess", "if (_USE_POSIX_SPAWN"),
    ("_posixsubprocess", "fork_exec"): ("multiprocessing.util", "_posixsubprocess.fork_exec("),
}


# Names a Python version removed, with the version: from it on, the name must be gone and our code must not need it.
REMOVED = {("subprocess", "_USE_VFORK"): (3, 14)}  # gh-121381: subprocess vforks without a switch


# Real instances, for names that exist only on instances.
INSTANCES = {
    "multiprocessing.forkserver.ForkServer": lambda: contextlib.nullcontext(mp_forkserver.ForkServer()),
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


@pytest.mark.parametrize("target, name, kind, used_in, breaks", PRIVATE + HARNESS + THIRD_PARTY,
                         ids=[f"{t}.{_split(n)[0]}" for t, n, *_ in PRIVATE + HARNESS + THIRD_PARTY])
def test_private_name_exists(target, name, kind, used_in, breaks):
    if target.startswith("test") and importlib.util.find_spec("test._test_multiprocessing") is None:
        pytest.skip("no `test` package here (only the stdlib suite needs it)")
    if (target, name, kind, used_in, breaks) in THIRD_PARTY and importlib.util.find_spec(target.split(".")[0]) is None:
        pytest.skip(f"{target.split('.')[0]} is not installed here")
    attr, params = _split(name)
    obj = _resolve(target)
    if sys.version_info >= REMOVED.get((target, attr), (99,)):
        assert not hasattr(obj, attr), f"{target}.{attr} is back from Python {sys.version_info[:2]}: drop REMOVED's row"
        return
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


DOCUMENTED = {("os", "_exit"), ("sys", "_getframe"), ("collections", "_fields")}  # (namedtuple's API)
SOURCES = [*REPO.glob("packages/*/src/**/*.py"), *REPO.glob("src/arraymp/*.py")]


def test_no_unlisted_private_access():
    listed = {(t, _split(n)[0]) for t, n, *_ in PRIVATE} | DOCUMENTED
    listed_modules = {t for t, *_ in PRIVATE}
    files = SOURCES
    assert files
    unlisted = set()
    for path in files:
        for target, name in _private_accesses(path):
            ok = (target in listed_modules) if not name else (target, name) in listed
            if not ok:
                unlisted.add(f"{path.relative_to(REPO)}: {target}{'.' if name else ''}{name}")
    assert not unlisted, "private stdlib names not in PRIVATE (add them, with what breaks):\n" + "\n".join(
        sorted(unlisted))


def _names(tree: ast.AST):
    """(names our code defines as attributes, private attribute names it reads), of one module."""
    defined, used = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif node.attr.startswith("_") and not node.attr.startswith("__"):
                used.append((node.attr, node.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            body = node.body if isinstance(node, ast.ClassDef) else []
            for stmt in body:  # class attributes
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
                    if isinstance(stmt, ast.AnnAssign) else []
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            defined.add(n.id)
                        elif isinstance(n, ast.Constant) and isinstance(n.value, str):  # __slots__
                            defined.add(n.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
            if node.func.id == "setattr":
                defined.add(name)
            elif node.func.id in ("getattr", "hasattr") and name.startswith("_") and not name.startswith("__"):
                used.append((name, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__" and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            used.append((node.args[0].value, node.lineno))  # obj.__dict__.get("_name")
    return defined, used


def test_no_foreign_private_attribute():
    trees = {path: ast.parse(path.read_text()) for path in SOURCES}
    defined = {path.stem for path in SOURCES}  # our modules (``from shm_manager import _paths``: the other test's)
    for tree in trees.values():
        defined |= _names(tree)[0]
    listed = {_split(n)[0] for _, n, *_ in PRIVATE + HARNESS + THIRD_PARTY} | {n for _, n in DOCUMENTED}
    foreign = sorted({f"{path.relative_to(REPO)}:{line}: {name}" for path, tree in trees.items()
                      for name, line in _names(tree)[1] if name not in defined and name not in listed})
    assert not foreign, ("private attributes that no code of ours defines, reached through objects (list them in "
                         "PRIVATE or THIRD_PARTY, with what breaks, or use a public name):\n" + "\n".join(foreign))
