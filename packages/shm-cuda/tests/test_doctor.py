"""doctor_report where an NVIDIA driver is present but cupy is not (runs with or without a device)."""

import subprocess
import sys

import pytest


def test_doctor_report_names_the_extra_that_brings_cupy():
    from shm_cuda import _cuda

    driver = _cuda.driver_version()
    if driver is None:
        pytest.skip("no NVIDIA driver here: the report names the missing driver, not cupy")
    code = ("import sys; sys.modules['cupy'] = None\nimport shm_cuda\n"
            "for line in shm_cuda.doctor_report(extras_of='arraymp')[0]: print(line)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    major = driver // 1000
    assert "cupy is not installed" in lines[0]
    assert f"arraymp[cuda{major}] extra: pip install cupy-cuda{major}x" in lines[0]
