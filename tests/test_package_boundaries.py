"""The packages meet only at public names, and no package's modules import each other in a circle (issue 41).

Each package is versioned and published alone: a sibling's private module (``mp_reductions._pool``,
``shm_core._native``) may change in any patch release, so ``from <sibling>._x import`` (or ``import <sibling>._x``,
or ``from <sibling> import _x``) breaks the sibling that uses it; what it needs is exported instead (a name in the
package's ``__all__``). Within a package the modules are layered (docs/internals.md): an import circle, even one
made lazy by an import inside a function, means two modules that are one concern, or a name in the wrong one.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {path.parent.name: path.parent for path in REPO.glob("packages/*/src/*/__init__.py")}
PACKAGES["arraymp"] = REPO / "src" / "arraymp"


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path):
    """(imported dotted name, line) for each import in the module ``name`` at ``path``, relative ones resolved;
    ``from X import y`` yields ``X.y`` (a submodule or a name: the caller tells them apart)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, node.lineno
            for a in node.names:
                yield f"{module}.{a.name}", node.lineno


def test_packages_meet_only_at_public_names():
    bad = []
    for pkg, root in PACKAGES.items():
        for name, path in _modules(root).items():
            for target, line in _imports(name, path):
                top, _, rest = target.partition(".")
                if top in PACKAGES and top != pkg and rest.startswith("_"):
                    bad.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert not bad, ("imports of a sibling package's private module or name (export what is needed from the "
                     "sibling's __init__ and import that):\n" + "\n".join(sorted(set(bad))))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_import_circles(pkg):
    modules = _modules(PACKAGES[pkg])
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target, _ in _imports(name, path):
            # a package's __init__ re-exports its modules: what imports the package depends on the modules it names,
            # not the other way round, so an edge to a package (its __init__) counts only from outside it
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name and not name.startswith(target + "."):
                graph.setdefault(name, set()).add(target)
    assert not _cycles(graph), f"modules of {pkg} that import each other in a circle: {_cycles(graph)}"


INTERNALS = REPO / "docs" / "internals.md"
_SECTION = re.compile(r"^## .*?\(`(?P<root>[^`]+)`\)$", re.M)
_ROW = re.compile(r"^\| (?P<layer>\d+) \| (?P<modules>[^|]+) \|", re.M)


def _layers() -> dict[str, dict[str, int]]:
    """docs/internals.md's layers: package -> module (dotted, as _modules names it) -> layer."""
    text = INTERNALS.read_text()
    sections = list(_SECTION.finditer(text))
    out = {}
    for m, end in zip(sections, [*sections[1:], None], strict=True):
        pkg = pathlib.Path(m["root"]).name
        body = text[m.end():end.start() if end else len(text)]
        out[pkg] = {}
        for row in _ROW.finditer(body):
            for mod in re.findall(r"`([^`]+)`", row["modules"]):
                name = pkg if mod == "__init__" else f"{pkg}.{mod}"
                out[pkg][name] = int(row["layer"])
    return out


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_internals_page_maps_every_module_in_its_layer(pkg):
    """docs/internals.md names every module once, and each imports only modules of lower layers (its package's
    __init__ aside, which re-exports them)."""
    layers = _layers().get(pkg)
    assert layers is not None, f"docs/internals.md has no section for {pkg}"
    modules = _modules(PACKAGES[pkg])
    missing, gone = sorted(set(modules) - set(layers)), sorted(set(layers) - set(modules))
    assert not missing and not gone, f"docs/internals.md's {pkg} section lacks {missing}, names gone ones {gone}"
    upward = []
    for name, path in modules.items():
        for target, line in _imports(name, path):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name and target != pkg and not name.startswith(target + "."):
                if layers[target] >= layers[name]:
                    upward.append(f"{path.relative_to(REPO)}:{line}: {name} (layer {layers[name]}) imports "
                                  f"{target} (layer {layers[target]})")
    assert not upward, "imports that do not point down docs/internals.md's layers:\n" + "\n".join(upward)
