import os
import subprocess
import sys


def test_doctor_reports_machine():
    out = subprocess.run([sys.executable, "-m", "arraymp", "doctor"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for needle in ("/dev/shm", "ulimit -n", "memfd_create", "start method", "CUDA"):
        assert needle in out.stdout


def test_doctor_warns_about_small_shm(tmp_path):
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(tmp_path)], capture_output=True)
    if r.returncode:
        import pytest

        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.decode().strip()}")
    try:
        env = dict(os.environ, ARRAYMP_SHM_DIR=str(tmp_path))
        out = subprocess.run([sys.executable, "-m", "arraymp", "doctor"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert "WARNING" in out.stdout and "--shm-size" in out.stdout
    finally:
        subprocess.run(["umount", "--lazy", str(tmp_path)])


def test_doctor_without_a_gpu_says_cpu_sharing_is_unaffected():
    from shm_cuda import _cuda

    if _cuda.driver_version() is not None:
        import pytest

        pytest.skip("an NVIDIA driver is here")
    out = subprocess.run([sys.executable, "-m", "arraymp", "doctor"], capture_output=True, text=True, timeout=60)
    cuda = next(line for line in out.stdout.splitlines() if "CUDA:" in line)
    assert "no NVIDIA driver" in cuda and "GPU sharing unavailable; CPU sharing unaffected" in cuda, cuda
    assert "insufficient" not in out.stdout and "all good" in out.stdout


def test_doctor_reports_this_pythons_default_start_method():
    """The default start method of the Python that runs doctor, as multiprocessing gives it: fork before 3.14,
    forkserver from 3.14 on Linux (issue 44: a literal "fork" was printed on 3.14)."""
    ask = "import multiprocessing; print(multiprocessing.get_start_method())"
    expected = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()
    assert expected == ("forkserver" if sys.version_info >= (3, 14) else "fork")
    out = subprocess.run([sys.executable, "-m", "arraymp", "doctor"], capture_output=True, text=True, timeout=60)
    line = next(line for line in out.stdout.splitlines() if "start method" in line)
    assert f"default start method: {expected} (this Python's default)" in line, line


def test_doctor_leaves_the_start_method_unset():
    """Reading the default does not fix it: a program that runs the report can still set its start method."""
    code = ("import multiprocessing\nfrom arraymp import _doctor\n"
            "_doctor.report()\n"
            "assert multiprocessing.get_start_method(allow_none=True) is None\n"
            "multiprocessing.set_start_method('spawn')\n"
            "assert any('default start method: spawn (set by the program)' in line for line in _doctor.report()[0])\n")
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)
