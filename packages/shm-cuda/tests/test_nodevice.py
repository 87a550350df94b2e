"""What a machine without a usable GPU sees (skipped where a device is present)."""

import os
import pickle
import subprocess
import sys

import pytest
import shm_cuda

CODE = r"""
import shm_cuda, sys
registered = []
ok = shm_cuda.init_reductions(lambda cls, fn: registered.append(cls))
print(ok, registered, shm_cuda.device_available())
try:
    shm_cuda.reduce_cupy_array(object())
except shm_cuda.NoDeviceError as exc:
    print("NoDeviceError:", exc)
"""


def _has_device():
    import conftest
    out = subprocess.run([sys.executable, "-c", "import conftest; print(conftest._gpu_reason() or '')"],
                         capture_output=True, text=True, cwd=os.path.dirname(conftest.__file__), timeout=120)
    return out.returncode == 0 and not out.stdout.strip()


pytestmark = pytest.mark.skipif(_has_device(), reason="a CUDA device is present: these check the no-device paths")


def test_init_reductions_registers_nothing_without_device():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "False [] False", out.stderr
    assert lines[1].startswith("NoDeviceError:") and ("CUDA_VISIBLE_DEVICES" in lines[1] or "cupy" in lines[1])


def test_without_cupy():
    # cupy hidden: import shm_cuda still works, CUDA work says what to install
    code = "import sys; sys.modules['cupy'] = None\n" + CODE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "False [] False", out.stderr
    assert "pip install cupy-cuda12x" in lines[1]


def test_import_is_lazy():
    out = subprocess.run([sys.executable, "-c", "import shm_cuda, sys; print('cupy' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_errors_pickle():
    for cls in (shm_cuda.NoDeviceError, shm_cuda.ProducerGoneError, shm_cuda.ForkedAfterInitError,
                shm_cuda.UnsupportedAllocatorError, shm_cuda.HandleError):
        e = pickle.loads(pickle.dumps(cls("msg")))
        assert type(e) is cls and str(e) == "msg"
    assert issubclass(shm_cuda.UnsupportedAllocatorError, NotImplementedError)


def test_fork_after_init_guard():
    from shm_cuda import _fork

    shm_cuda.check_fork()  # the parent is fine
    saved = _fork._initialised
    _fork.mark_initialised()
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                msg = "no error"
                try:
                    shm_cuda.reduce_cupy_array(object())
                except shm_cuda.ForkedAfterInitError as exc:
                    msg = str(exc)
                os.write(w, msg.encode())
            finally:
                os._exit(0)
        os.close(w)
        msg = os.read(r, 4096).decode()
        os.close(r)
        os.waitpid(pid, 0)
    finally:
        _fork._initialised = saved
    assert "forked after CUDA had been initialised" in msg and "'spawn' or 'forkserver'" in msg
    shm_cuda.check_fork()
