"""One test session per package, each installing only that package and what it
declares (siblings from their folders, not editable); plus the facade, lint and
bench. ``nox`` runs every test session; ``nox -l`` lists them."""

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["shm_core", "shm_manager", "mp_reductions", "shm_cuda", "mp_spawn", "facade", "lint"]

PKG = {
    "shm_core": ["packages/shm-core"],
    "shm_manager": ["packages/shm-core", "packages/shm-manager"],
    "mp_reductions": ["packages/shm-core", "packages/shm-manager", "packages/mp-reductions"],
    "shm_cuda": ["packages/shm-core", "packages/shm-cuda"],
    "mp_spawn": ["packages/mp-spawn"],
}


def _test(session: nox.Session, paths: list[str], tests: str) -> None:
    session.install(*paths, "pytest")
    session.run("python", "-m", "pytest", tests, *session.posargs)


@nox.session
def shm_core(session):
    _test(session, PKG["shm_core"], "packages/shm-core/tests")


@nox.session
def shm_manager(session):
    _test(session, PKG["shm_manager"], "packages/shm-manager/tests")


@nox.session
def mp_reductions(session):
    _test(session, PKG["mp_reductions"], "packages/mp-reductions/tests")


@nox.session
def shm_cuda(session):
    _test(session, PKG["shm_cuda"], "packages/shm-cuda/tests")


@nox.session
def mp_spawn(session):
    _test(session, PKG["mp_spawn"], "packages/mp-spawn/tests")


@nox.session
def facade(session):
    _test(session, ["."], "tests")


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def bench(session):
    """Benchmarks against the stdlib (and torch when installed): not part of plain ``nox``."""
    session.install(".")
    for script in session.posargs or ["segment_alloc.py"]:
        session.run("python", f"benchmarks/{script}")
