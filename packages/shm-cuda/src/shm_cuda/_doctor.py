"""What ``arraymp doctor`` says about CUDA IPC on this machine (initialises CUDA: a diagnostic only)."""

from __future__ import annotations

import importlib.util

from ._errors import NoDeviceError

# cudaComputeMode: in these modes a second process gets no context on the device, so no consumer can open a handle
_NO_SHARING = {1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}
_UNAVAILABLE = "GPU sharing unavailable; CPU sharing unaffected"


def report(extras_of: str = "shm-cuda") -> tuple[list[str], list[str]]:
    """(lines, warnings): the driver, cupy, each device by index, name, UUID and whether CUDA IPC can work on it.
    ``extras_of`` is the package whose cuda12 / cuda13 extras the advice names (arraymp's doctor: "arraymp")."""
    from . import _cuda

    driver = _cuda.driver_version()
    if driver is None:
        return [f"CUDA: no NVIDIA driver (libcuda.so.1, CUDA >= 11.4, does not load), so no CUDA device: "
                f"{_UNAVAILABLE}"], []
    major, cuda = driver // 1000, f"{driver // 1000}.{driver % 1000 // 10}"
    if importlib.util.find_spec("cupy") is None:
        # the extra's own package, not `pip install "arraymp[cuda12]"`: from a clone, that asks an index for our name
        fix = (f"install the {extras_of}[cuda{major}] extra: pip install cupy-cuda{major}x" if major in (12, 13) else
               f"update the NVIDIA driver to one for CUDA 12 or 13 (this one is for CUDA {cuda})")
        return [f"CUDA: NVIDIA driver for CUDA {cuda}, but cupy is not installed: {_UNAVAILABLE}; to share cupy "
                f"arrays too, {fix}"], []
    try:
        cp = _cuda._cupy()
    except NoDeviceError as exc:
        return [f"CUDA: {_UNAVAILABLE}: {exc}"], []
    rt = cp.cuda.runtime
    lines, warnings = [f"CUDA: cupy {cp.__version__}, driver {driver} (CUDA {cuda})"], []
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        name = props["name"].decode(errors="replace")
        uuid = _cuda.device_uuid(i).hex()
        mode = props["computeMode"]
        ipc = "yes" if props["unifiedAddressing"] and mode not in _NO_SHARING else "no"
        lines.append(f"  device {i}: {name}, UUID {uuid}, compute {props['major']}.{props['minor']}, "
                     f"CUDA IPC: {ipc}")
        if mode in _NO_SHARING:
            warnings.append(f"device {i} is in {_NO_SHARING[mode]} compute mode: other processes cannot open its "
                            f"memory; set the default mode (nvidia-smi -i {i} -c DEFAULT)")
    return lines, warnings
