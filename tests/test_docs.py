"""Every code sample of the documentation site (docs/*.md) runs as written, each in a fresh process with a
shared-memory directory of its own, and leaves nothing in that directory: a ```python block as a script, a
```bash block as a bash script, and the ``$ `` lines of a ```console block as one (the other lines are output).

A sample that needs what may be missing says so on the line just before it, in an HTML comment that the site does
not show:

    <!-- sample: requires joblib -->        skipped unless `import joblib` would work (module names, spaced)
    <!-- sample: requires gpu -->           skipped unless cupy imports and sees a CUDA device
    <!-- sample: not run: <reason> -->      never run; the reason is the skip's
"""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

DOCS = pathlib.Path(__file__).parents[1] / "docs"
BLOCK = re.compile(r"^```(python|bash|console)\n(.*?)^```\n", re.M | re.S)
MARK = re.compile(r"<!--\s*sample:\s*(.*?)\s*-->\s*\n\s*$")
TIMEOUT = 180


def samples():
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            mark = MARK.search(text, 0, m.start())
            mark = mark.group(1) if mark and mark.end() == m.start() else ""
            lang, code = m.groups()
            if lang == "console":
                code = "".join(line[2:] + "\n" for line in code.splitlines() if line.startswith("$ "))
            found.append(pytest.param(lang, code, mark, id=f"{page.relative_to(DOCS)}:{line}"))
    return found


def _gpu() -> bool:
    """Whether cupy imports and sees a device, asked in a child so that this process never initialises CUDA."""
    if shutil.which("nvidia-smi") is None:
        return False
    code = "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


def _skip_unless_ready(mark: str) -> None:
    if not mark:
        return
    if mark.startswith("not run:"):
        pytest.skip(mark)
    need = re.fullmatch(r"requires ((?:\S+ ?)+)", mark)
    assert need, f"unknown sample marker {mark!r}: write 'requires <module> ...', 'requires gpu' or 'not run: <reason>'"
    for name in need.group(1).split():
        if name == "gpu":
            if not _gpu():
                pytest.skip("needs cupy and a CUDA device")
        elif importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {name}, which is not installed")


def _left(shm: str) -> list[str]:
    """What a program left in its shm dir: segments, and files in shm-manager's runtime dirs but its log."""
    left = []
    for entry in os.listdir(shm):
        path = os.path.join(shm, entry)
        if entry.startswith(".arraymp-") and os.path.isdir(path):
            left += [f"{entry}/{n}" for n in os.listdir(path) if n != "manager.log"]
        else:
            left.append(entry)
    return left


def test_the_docs_have_samples():
    assert len(samples()) >= 10


@pytest.mark.parametrize("lang, code, mark", samples())
def test_sample_runs(lang, code, mark, tmp_path):
    _skip_unless_ready(mark)
    if lang == "python":
        (tmp_path / "sample.py").write_text(code)
        command = [sys.executable, "sample.py"]
    else:  # this interpreter's python and console scripts (arraymp, shm-manager) first on PATH
        (tmp_path / "sample.sh").write_text(f'PATH="{pathlib.Path(sys.executable).parent}:$PATH"\n{code}')
        command = ["bash", "-euo", "pipefail", "sample.sh"]
    parent = os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")
    shm = tempfile.mkdtemp(prefix="docs-sample-", dir=parent)
    try:
        env = {**os.environ, "ARRAYMP_SHM_DIR": shm}
        # a program of its own, as a user runs it: not a member of this process's shm-manager group (which
        # importing arraymp here put in $ARRAYMP_GROUP), whose end would then be the one to clean its files up
        for name in ("ARRAYMP_RUNTIME_DIR", "ARRAYMP_GROUP"):
            env.pop(name, None)
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
        deadline = time.monotonic() + 5  # shm-manager's daemon lingers 0.5 s after its group ends
        while _left(shm) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _left(shm), f"the sample left {_left(shm)} in its shm dir"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
