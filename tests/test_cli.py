"""The command line as a user meets it: versions, the usage line, help texts, bench sizes."""

import importlib
import importlib.util
import multiprocessing
import pathlib
import re
import subprocess
import sys

import pytest

from arraymp._bench import parse_sizes

ROOT = pathlib.Path(__file__).parents[1]
PACKAGES = {  # distribution: (import name, folder)
    "shm-core": ("shm_core", ROOT / "packages/shm-core"),
    "shm-manager": ("shm_manager", ROOT / "packages/shm-manager"),
    "mp-reductions": ("mp_reductions", ROOT / "packages/mp-reductions"),
    "shm-cuda": ("shm_cuda", ROOT / "packages/shm-cuda"),
    "mp-spawn": ("mp_spawn", ROOT / "packages/mp-spawn"),
}


def pyproject_version(folder: pathlib.Path) -> str:
    return re.search(r'^version = "([^"]+)"$', (folder / "pyproject.toml").read_text(), re.M).group(1)


def arraymp(*args, command=(sys.executable, "-m", "arraymp")):
    out = subprocess.run([*command, *args], capture_output=True, timeout=300)
    # decoded without text=True's newline translation, which would turn a redraw's "\r" into "\n"
    out.stdout, out.stderr = out.stdout.decode(), out.stderr.decode()
    return out


def test_version_names_arraymp_and_its_five_packages():
    out = arraymp("--version")
    assert out.returncode == 0, out.stderr
    found = [f"{dist} {pyproject_version(folder)}" for dist, (_, folder) in PACKAGES.items()]
    if importlib.util.find_spec("mp_dask") is not None:  # the dask extra, listed when installed
        found.append(f"mp-dask {pyproject_version(ROOT / 'packages/mp-dask')}")
    assert out.stdout.strip() == f"arraymp {pyproject_version(ROOT)} ({', '.join(found)})"


@pytest.mark.parametrize("dist", ["arraymp", *PACKAGES])
def test_version_lives_in_pyproject_only(dist):
    module, folder = PACKAGES.get(dist, ("arraymp", ROOT))
    mod = importlib.import_module(module)
    assert mod.__version__ == pyproject_version(folder)
    source = pathlib.Path(mod.__file__).read_text()
    assert not re.search(r"^__version__ = [\"']", source, re.M), (
        f"{module}/__init__.py repeats the version of {folder / 'pyproject.toml'}: read it with "
        f'importlib.metadata.version("{dist}")')


def test_usage_names_the_command_that_was_run():
    assert arraymp("-h").stdout.startswith("usage: python -m arraymp ")
    script = pathlib.Path(sys.executable).parent / "arraymp"  # the console script
    assert arraymp("-h", command=(str(script),)).stdout.startswith("usage: arraymp ")


@pytest.mark.parametrize("args", [["-h"], ["doctor", "-h"], ["demo", "-h"], ["bench", "-h"]])
def test_help_is_plain_text(args):
    out = arraymp(*args)
    assert out.returncode == 0, out.stderr
    assert "``" not in out.stdout


def test_demo_has_a_quick_and_a_full_run():
    out = arraymp("demo", "-h")
    assert "--quick" in out.stdout and "--full" in out.stdout
    out = arraymp("demo", "--quick", "--full")
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_bench_sizes_take_binary_units():
    assert parse_sizes("4KiB,1MiB,256MiB") == [4 << 10, 1 << 20, 256 << 20]
    assert parse_sizes("4096, 2GiB") == [4096, 2 << 30]
    out = arraymp("bench", "--sizes", "1MB")
    assert out.returncode == 2 and "'1MB'" in out.stderr and "4KiB,1MiB,256MiB" in out.stderr


def test_bench_runs_on_sizes_with_units_and_reports_gib_per_second():
    out = arraymp("bench", "--quick", "--repeat", "1", "--sizes", "64KiB")
    assert out.returncode == 0, out.stderr
    assert "fresh 64 KiB" in out.stdout and "GiB/s" in out.stdout and "GB/s" not in out.stdout
    # it says first what it compares, on which sizes and start method, and for about how long; stderr is a pipe
    # here: plain lines, no progress redrawn with carriage returns
    head = out.stderr.splitlines()[:2]
    assert "arraymp (file_descriptor) against the stdlib" in head[0]
    assert "sizes 64 KiB" in head[1] and "start method spawn" in head[1] and "1 repeats" in head[1]
    assert re.search(r"about \d+ s to \d+ s", head[1])
    assert "\r" not in out.stderr and "repeat 1/1 done" in out.stderr


def test_demo_writes_plain_progress_lines_when_stderr_is_not_a_terminal():
    out = arraymp("demo", "--quick")  # stderr is a pipe
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr, "progress bars redrawn into a pipe"
    assert "pipeline, fresh 8 MiB arrays [arraymp]: 16 messages\n" in out.stderr
    assert all(line.strip() for line in out.stderr.splitlines()), "blank lines where bars would have ended"
    assert "speed-up" in out.stdout
    # a handle moves no array bytes: the shared array's row is in messages per second, and the table says so
    (shared,) = [line for line in out.stdout.splitlines() if line.startswith("pipeline, shared 8 MiB array")]
    assert shared.count("msg/s") == 2 and "GiB/s" not in shared, shared
    (fresh,) = [line for line in out.stdout.splitlines() if line.startswith("pipeline, fresh 8 MiB arrays")]
    assert fresh.count("GiB/s") == 2, fresh
    assert "GiB/s: array bytes that reached the other process per second" in out.stdout
    assert "msg/s: an array already in shared memory travels as a handle" in out.stdout


def test_demo_with_stderr_in_a_file_logs_no_redraws(tmp_path):
    # `python -m arraymp demo --quick 2>log`, as a user would
    with open(tmp_path / "log", "wb") as log:
        out = subprocess.run([sys.executable, "-m", "arraymp", "demo", "--quick"], stdout=subprocess.PIPE,
                             stderr=log, timeout=300)
    text = (tmp_path / "log").read_bytes().decode()
    assert out.returncode == 0, text
    assert "\r" not in text and "\x1b" not in text, "progress redrawn into the log"
    assert "pool, 1 MiB results [stdlib]: 64 messages\n" in text


def test_demo_draws_progress_bars_on_a_terminal():
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal of 80 columns
    try:
        p = subprocess.Popen([sys.executable, "-m", "arraymp", "demo", "--quick"], stdout=subprocess.PIPE,
                             stderr=follower)
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the terminal's other end closed
                break
            if not chunk:
                break
            seen += chunk
        assert p.wait(timeout=300) == 0, seen.decode(errors="replace")
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    text = seen.decode(errors="replace")
    assert "\r" in text and "100%" in text and "16/16 msg" in text, text[-2000:]


def test_bench_overhead_prints_each_workload_with_its_ratio(capsys, monkeypatch):
    # the short form of `python -m arraymp bench --overhead`: every row of the table, with a ratio
    from arraymp import _overhead
    from arraymp._overhead import POOL, main

    monkeypatch.setattr(_overhead, "BLOCK", 0.01)  # the table's form is checked here, not its figures
    monkeypatch.setattr(_overhead, "TURN", 0.005)
    assert main(n=200, repeat=1, methods=("fork",)) == 0
    out = capsys.readouterr().out
    assert f"this Python's default start method: {multiprocessing.get_all_start_methods()[0]}\n" in out
    for row in [*POOL, "submit", "ping-pong Queue (us)", "handles/s vs 4 KiB pickled/s"]:
        (line,) = [line for line in out.splitlines() if line.startswith(f"| {row} |")]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4 and float(cells[3]) > 0, line


def test_bench_payloads_prints_each_row_with_its_ratios():
    # the short form of `python -m arraymp bench --payloads`: one small row, one start method; the form, not figures
    out = arraymp("bench", "--payloads", "--quick", "--repeat", "1", "--methods", "fork", "--rows", "tuple")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("tuple of a few small objects")]
    queue, cpu, pool, peak = line.split()[-4:]
    assert float(queue) > 0 and float(cpu) > 0 and float(pool) > 0 and "/" in peak, line


def test_bench_inputs_prints_the_caller_s_copies_of_one_input_given_to_16_tasks():
    # the short form of `python -m arraymp bench --inputs` (issue 43 item 4: 1 GiB by default): a plain input is
    # copied twice by the caller whatever the number of tasks (_reductions Note [inputs once per call]), a shared
    # one never; the peak column is the machine's, not checked here
    out = arraymp("bench", "--inputs", "--sizes", "8MiB", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    assert "one 8 MiB input given to each of 16 tasks of one call" in out.stdout
    for row in ("Pool.starmap", "Pool.map", "Pool.imap", "executor.map"):
        (line,) = [line for line in out.stdout.splitlines() if line.startswith(f"| {row} |")]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == "2 (16 MiB)" and cells[5] == "0 (0 B)", line
        assert float(cells[1]) > 0 and cells[3].endswith("x"), line


def test_bench_payloads_skips_a_row_whose_package_does_not_import(monkeypatch):
    from arraymp._payloads import available

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    rows, skipped = available(["pyarrow Table 64 MB", "str 16 MiB"])
    assert rows == ["str 16 MiB"]
    assert skipped == ["pyarrow Table 64 MB: skipped, pyarrow does not import (pip install pyarrow)"]
