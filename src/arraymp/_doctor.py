"""arraymp doctor: what this machine offers shared memory, and the fixes."""

from __future__ import annotations

import multiprocessing
import os
import resource

import shm_cuda

SMALL_SHM = 1 << 30  # below 1 GiB /dev/shm is small for array work (docker's default is 64 MiB)


def _memfd_ok() -> bool:
    import shm_core

    try:
        os.close(shm_core.memfd_create("arraymp-doctor"))
    except OSError:
        return False
    return True


def _remove_ipc() -> str | None:
    """systemd-logind's RemoveIPC for this user: "yes"/"no", or None where it does not apply."""
    if not os.path.isdir("/run/systemd/system") or os.getuid() < 1000:  # no systemd; root and system users are exempt
        return None
    value = "yes"  # logind's default
    dropins = [os.path.join(d, f) for d in ("/usr/lib/systemd/logind.conf.d", "/etc/systemd/logind.conf.d",
                                            "/run/systemd/logind.conf.d") if os.path.isdir(d)
               for f in sorted(os.listdir(d)) if f.endswith(".conf")]
    for path in ["/etc/systemd/logind.conf", *dropins]:  # the last setting wins
        try:
            with open(path) as f:
                for line in f:
                    key, _, v = line.strip().partition("=")
                    if key.strip() == "RemoveIPC":
                        value = v.strip().lower()
        except OSError:
            pass
    return value


def _start_method() -> str:
    """The start method this process's Python uses, as ``multiprocessing.get_start_method()`` gives it: the one the
    program set, else the interpreter's default (fork before 3.14, forkserver from 3.14 on Linux), read without
    fixing it (a later ``set_start_method`` still works)."""
    method = multiprocessing.get_start_method(allow_none=True)
    if method is None:
        method = multiprocessing.get_start_method()  # fixes the default context...
        multiprocessing.set_start_method(None, force=True)  # ...which this unfixes
        return f"{method} (this Python's default)"
    return f"{method} (set by the program)"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def report() -> tuple[list[str], list[str]]:
    """(lines, warnings) describing this machine."""
    lines, warnings = [], []
    shm = os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm")
    try:
        st = os.statvfs(shm)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        lines.append(f"{shm}: {_gib(size)} total, {_gib(free)} free")
        if size < SMALL_SHM:
            warnings.append(f"{shm} is only {size >> 20} MiB: large arrays with the 'file_system' strategy will "
                            f"not fit. Run docker with --shm-size=8g (or mount -o remount,size=8G {shm}), or keep "
                            f"the default 'file_descriptor' strategy")
    except OSError as exc:
        warnings.append(f"{shm} is not usable ({exc}); set ARRAYMP_SHM_DIR to a tmpfs directory")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lines.append(f"open files limit (ulimit -n): {soft} (hard {hard})")
    if soft < 4096:
        warnings.append(f"ulimit -n is {soft}: raise it (ulimit -n {min(hard, 65536)}) if you keep many arrays alive")
    memfd = _memfd_ok()
    lines.append(f"memfd_create: {'yes' if memfd else 'no (falls back to unlinked files in ' + shm + ')'}")
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            lines.append(f"vm.max_map_count: {f.read().strip()}")
    except OSError:
        pass
    remove_ipc = _remove_ipc()
    if remove_ipc is not None:
        lines.append(f"systemd RemoveIPC: {remove_ipc}" + (
            " (named segments of the 'file_system' strategy are removed when this user's last login session ends; "
            "memfd segments are not: keep the default strategy, or `loginctl enable-linger`)"
            if remove_ipc in ("yes", "true", "1", "on") else ""))
    lines.append(f"default start method: {_start_method()}; "
                 f"available: {', '.join(multiprocessing.get_all_start_methods())}")
    cuda_lines, cuda_warnings = shm_cuda.doctor_report(extras_of="arraymp")
    return lines + cuda_lines, warnings + cuda_warnings


def main() -> int:
    lines, warnings = report()
    print("arraymp doctor")
    for line in lines:
        print("  " + line)
    for w in warnings:
        print("  WARNING: " + w)
    if not warnings:
        print("  all good")
    return 0
