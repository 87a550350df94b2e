import os
import sys
import warnings

import pytest

# A fork child warns as the program it is would (as spawn and forkserver children do), not by this run's "error"
# filter, which is for this process (issue 44): its warnings go to its stderr, captured, as before.
os.register_at_fork(after_in_child=lambda: warnings.filters.__setitem__(
    slice(None), [f for f in warnings.filters if f[:4] != ("error", None, Warning, None)]))

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_reason():
    try:
        import cupy
    except ImportError as exc:
        return f"cupy does not import ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device visible ({type(exc).__name__}: {exc})"
    return None if n > 0 else "no CUDA device visible (0 devices)"


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    # probe in a child process so this process does not initialise CUDA (fork tests)
    import subprocess
    here = os.path.dirname(__file__)
    code = f"import sys; sys.path.insert(0, {here!r}); import conftest; print(conftest._gpu_reason() or '')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    reason = out.stdout.strip() or (None if out.returncode == 0 else f"GPU probe failed: {out.stderr[-300:]}")
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device: {reason}"))
