"""Every cupy name shm_cuda and its GPU tests use exists in the installed cupy.

Runs without a device (cupy imports without one), so a renamed or removed cupy
API fails CI instead of failing only on a GPU machine.
"""

import ast
import pathlib

import pytest

cupy = pytest.importorskip("cupy", reason="cupy is not installed")
HERE = pathlib.Path(__file__).parent
FILES = [HERE.parent / "src/shm_cuda/_cuda.py", HERE / "test_gpu.py", HERE / "_gpu_targets.py",
         HERE.parents[2] / "benchmarks/gpu/transfer.py"]
ROOTS = {"cp", "cupy", "_cupy_mod"}  # the names the code binds the cupy module to


def cupy_names(path):
    """``(line, "cuda.runtime.x")`` for every attribute chain rooted at a cupy name."""
    for node in ast.walk(ast.parse(path.read_text())):
        parts, n = [], node
        while isinstance(n, ast.Attribute):
            parts.append(n.attr)
            n = n.value
        if parts and isinstance(n, ast.Name) and n.id in ROOTS:
            yield node.lineno, ".".join(reversed(parts))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cupy_names_exist(path):
    names = sorted(set(cupy_names(path)))
    assert names, f"no cupy names found in {path}"
    missing = []
    for line, dotted in names:
        obj = cupy
        try:
            for part in dotted.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            missing.append(f"{path.name}:{line}: cupy.{dotted}")
    assert not missing, f"cupy {cupy.__version__} lacks: {missing}"
