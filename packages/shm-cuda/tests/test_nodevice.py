"""What a machine without a usable GPU sees (skipped where a device is present)."""

import importlib.util
import os
import pickle
import subprocess
import sys

import pytest
import shm_cuda

CODE = r"""
import shm_cuda, sys
registered = []
ok = shm_cuda.init_reductions(lambda cls, fn: registered.append(cls.__name__))
print(ok, registered, sys.modules.get("cupy") is not None)
try:
    import cupy
except ImportError:
    pass
print(registered, shm_cuda.device_available())
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
# cupy is an extra (cuda12 / cuda13): without it, what importing cupy does cannot be checked
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="cupy is not installed (shm-cuda[cuda12] or [cuda13]): these check what "
                                       "importing cupy does")


def run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@needs_cupy
def test_registers_when_cupy_is_imported_and_errors_without_device():
    # init_reductions neither imports cupy nor touches CUDA; importing cupy registers
    lines = run(CODE)
    assert lines[0] == "False [] False"
    assert lines[1] == "['ndarray'] False"
    assert lines[2].startswith("NoDeviceError:") and "CUDA_VISIBLE_DEVICES" in lines[2]


@needs_cupy
def test_registers_at_once_when_cupy_is_imported_already():
    lines = run("import cupy\n" + CODE)
    assert lines[0] == "True ['ndarray'] True"


def test_without_cupy():
    # cupy hidden: import shm_cuda still works, CUDA work says what to install
    lines = run("import sys; sys.modules['cupy'] = None\n" + CODE)
    assert lines[0] == "False [] False"
    assert lines[1] == "[] False"
    assert "pip install cupy-cuda12x" in lines[2]


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


def test_driver_calls_name_the_missing_driver():
    from shm_cuda import _cuda

    if _cuda._driver() is not None:
        pytest.skip("libcuda.so.1 loads here")
    with pytest.raises(shm_cuda.NoDeviceError, match="libcuda.so.1"):
        _cuda._call("cuMemGetAddressRange_v2")


@needs_cupy
def test_a_probe_for_cupy_does_not_use_up_the_registration():
    lines = run("import importlib.util\nassert importlib.util.find_spec('cupy')\n" + CODE)
    assert lines[:2] == ["False [] False", "['ndarray'] False"]


def test_doctor_report_says_why_there_is_no_cuda():
    # without a driver cupy says "CUDA driver version is insufficient": the report names the driver instead
    from shm_cuda import _cuda

    lines = run("import shm_cuda\nfor line in shm_cuda.doctor_report()[0]: print(line)")
    assert "GPU sharing unavailable; CPU sharing unaffected" in lines[0]
    if _cuda.driver_version() is None:
        assert lines[0].startswith("CUDA: no NVIDIA driver") and "insufficient" not in lines[0]

