"""What ``arraymp doctor`` says about CUDA IPC on this machine (initialises CUDA: a diagnostic only)."""

from __future__ import annotations

from ._errors import NoDeviceError

# cudaComputeMode: in these modes a second process gets no context on the device, so no consumer can open a handle
_NO_SHARING = {1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}


def report() -> tuple[list[str], list[str]]:
    """(lines, warnings): cupy, each device by index, name, UUID and whether CUDA IPC can work on it."""
    from . import _cuda

    try:
        cp = _cuda._cupy()
    except NoDeviceError as exc:
        return [f"CUDA: {exc}"], []
    rt = cp.cuda.runtime
    lines, warnings = [f"CUDA: cupy {cp.__version__}, driver {rt.driverGetVersion()}"], []
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
