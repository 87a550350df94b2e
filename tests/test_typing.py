"""What a user's type checker sees: mypy over a small program that uses arraymp as the docs do.

The packages are read from this checkout's folders (the ``mypy_path`` of pyproject.toml's ``[tool.mypy]``), so the
test checks the source, not whatever is installed. ``nox -s lint`` runs it with mypy installed; elsewhere it is
skipped when mypy is missing."""

import pathlib
import re
import textwrap

import pytest

api = pytest.importorskip("mypy.api", reason="mypy is not installed (nox -s lint installs it)")

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATHS = ["src", *(f"packages/{name}/src" for name in ("shm-core", "shm-manager", "mp-reductions", "shm-cuda",
                                                      "mp-spawn", "mp-dask"))]

USER = """\
import arraymp as mp


def square(x: int) -> int:
    return x * x


def pair(a: int, b: int) -> tuple[int, int]:
    return a, b


if __name__ == "__main__":
    with mp.Pool() as pool:
        reveal_type(pool.map(len, ["a"]))
        reveal_type(pool.starmap(pair, [(7, 2)]))
        reveal_type(pool.map_async(square, [1]).get())
        reveal_type(pool.imap_unordered(square, [1], progress=True))
    q: mp.Queue[int] = mp.Queue()
    reveal_type(q.get())
    reveal_type(mp.SimpleQueue[str]().get())
    a, b = mp.Pipe()
    reveal_type(a)
    reveal_type(mp.zeros_shared((2, 3)))
    reveal_type(mp.start_processes(print, nprocs=2, join=False))
    reveal_type(mp.get_context("spawn").Pool())
    reveal_type(mp.ProcessPoolExecutor().map(square, [1]))
"""

WRONG = """\
import arraymp as mp

if __name__ == "__main__":
    with mp.Pool() as pool:
        pool.map(len, [1])
    q: mp.Queue[int] = mp.Queue()
    q.put("one")
"""


def _mypy(tmp_path: pathlib.Path, source: str) -> tuple[str, int]:
    program = tmp_path / "user.py"
    program.write_text(source)
    config = tmp_path / "mypy.ini"
    config.write_text(textwrap.dedent(f"""\
        [mypy]
        mypy_path = {":".join(str(ROOT / p) for p in PATHS)}
        follow_imports = silent
        ignore_missing_imports = true
        """))
    stdout, stderr, status = api.run(["--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
                                      "--no-error-summary", "--hide-error-context", str(program)])
    return stdout + stderr, status


def test_revealed_types(tmp_path):
    out, status = _mypy(tmp_path, USER)
    # (mypy before 1.16 writes builtins.list[builtins.int], later ones list[int])
    revealed = [t.replace("builtins.", "") for t in re.findall(r'Revealed type is "(.*)"', out)]
    assert revealed == [
        "list[int]",
        "list[tuple[int, int]]",
        "list[int]",
        "typing.Iterator[int]",
        "int",
        "str",
        "mp_reductions._connection.Connection[Any, Any]",
        "numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]]",
        "mp_spawn._context.ProcessContext",
        "mp_reductions._pool.pool.Pool",
        "typing.Iterator[int]",
    ], out
    assert status == 0, out


def test_wrong_use_is_an_error(tmp_path):
    out, status = _mypy(tmp_path, WRONG)
    assert status == 1, out
    assert re.search(r'user.py:5: error: Argument [12] to "map" of "Pool" has incompatible type', out), out
    assert 'Argument 1 to "put" of "Queue" has incompatible type "str"; expected "int"' in out, out
