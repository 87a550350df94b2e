"""Add "arraymp" beside "loky" in joblib's ``test_parallel.py``, as a text edit of the file (line numbers kept).

Where the file names loky as a backend to test, arraymp is added next to it:

- ``PROCESS_BACKENDS = [..., "loky"]`` (and so ``PARALLEL_BACKENDS``) gets ``"arraymp"``;
- a ``parametrize`` over a name holding ``backend``: a list of backend names (``["loky", "threading"]``, also
  inside ``a if mp is None else b``) gets ``"arraymp"``; a list of cases (``("loky", True)``,
  ``("loky", "multiprocessing", True)``) gets each case that names loky again, with arraymp for loky, on the
  same line.

What iterates joblib's registry (``BACKENDS``, ``ALL_VALID_BACKENDS``) has arraymp once ``arraymp.joblib`` is
imported, as a program that names the backend imports it: the file's ``import joblib`` line and the scripts it
runs in fresh interpreters (``from joblib import Parallel, ...``) import ``arraymp.joblib`` too, so that a task
of the file run by a loky worker, or a script, finds the backend. Nothing else of joblib's code is changed.
"""

from __future__ import annotations

import ast
import sys

LOKY, OURS = "loky", "arraymp"
REGISTER = "import arraymp.joblib"
SCRIPT_IMPORT = "from joblib import Parallel"


def _names(node: ast.expr) -> list[str | None] | None:
    """The strings (or None) of a list of constants, else None."""
    if not isinstance(node, ast.List) or not all(isinstance(e, ast.Constant) for e in node.elts):
        return None
    values = [e.value for e in node.elts]  # type: ignore[attr-defined]
    return values if all(v is None or isinstance(v, str) for v in values) else None


def _cases(node: ast.expr) -> list[ast.Tuple] | None:
    if isinstance(node, ast.List) and node.elts and all(isinstance(e, ast.Tuple) for e in node.elts):
        return node.elts  # type: ignore[return-value]
    return None


def _offset(lines: list[str], line: int, col: int) -> int:
    return sum(len(s) for s in lines[: line - 1]) + len(lines[line - 1].encode()[:col].decode())


def edits(source: str) -> list[tuple[int, str]]:
    """(offset, text to insert there) for every place arraymp goes beside loky."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out: list[tuple[int, str]] = []

    def add_name(lst: ast.List) -> None:
        end = _offset(lines, lst.end_lineno, lst.end_col_offset - 1)  # type: ignore[arg-type, operator]
        out.append((end, f', "{OURS}"'))

    def visit_values(node: ast.expr) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.List):
                names = _names(sub)
                if names is not None and LOKY in names and OURS not in names:
                    add_name(sub)
                for case in _cases(sub) or []:
                    if any(isinstance(e, ast.Constant) and e.value == LOKY for e in case.elts):
                        text = ast.get_source_segment(source, case)
                        assert text is not None
                        copy = text.replace(f'"{LOKY}"', f'"{OURS}"').replace(f"'{LOKY}'", f"'{OURS}'")
                        out.append((_offset(lines, case.end_lineno, case.end_col_offset), f", {copy}"))  # type: ignore[arg-type]

    for node in tree.body:  # `import joblib`: the workers that import this file register arraymp too
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["joblib"]:
            out.append((_offset(lines, node.end_lineno, node.end_col_offset), f"; {REGISTER}"))  # type: ignore[arg-type]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value.startswith(SCRIPT_IMPORT) or f"\n{SCRIPT_IMPORT}" in node.value):
            text = ast.get_source_segment(source, node)  # a script run by a fresh interpreter
            assert text is not None and SCRIPT_IMPORT in text
            start = _offset(lines, node.lineno, node.col_offset)
            out.append((start + text.index(SCRIPT_IMPORT), f"{REGISTER}; "))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PROCESS_BACKENDS"
                                                for t in node.targets):
            names = _names(node.value)
            if names is not None and LOKY in names:
                add_name(node.value)  # type: ignore[arg-type]
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name == "parametrize" and isinstance(first, ast.Constant) and isinstance(first.value, str) and any(
                    "backend" in n for n in first.value.replace(" ", "").split(",")):
                visit_values(node.args[1])
    return out


def patch(source: str) -> tuple[str, int]:
    """The source with arraymp added, and in how many places it was added as a backend to test (0: the file
    changed shape)."""
    found = sorted(edits(source), reverse=True)
    for offset, text in found:
        source = source[:offset] + text + source[offset:]
    return source, sum(f'"{OURS}"' in text for _, text in found)


if __name__ == "__main__":  # python -m joblib_suite.patch FILE: edit FILE in place, say how many places
    path = sys.argv[1]
    with open(path) as f:
        text, n = patch(f.read())
    if n == 0:
        sys.exit(f"{path}: no place names loky as a backend to test: joblib's test file changed shape")
    with open(path, "w") as f:
        f.write(text)
    print(f"{path}: arraymp added beside loky in {n} places")
