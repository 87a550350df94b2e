"""shm-cuda: cupy arrays across processes through CUDA IPC, with crash-safe reference counting.

A sent array travels as the IPC handle of its whole device allocation plus
offset, shape, strides, dtype, device UUID and an interprocess event. The
producer keeps each sent block alive until every consumer released it,
counted in a shared-memory registry whose counts of a dead consumer are taken
back. cupy is imported lazily: ``import shm_cuda`` works without cupy or a
GPU, and CUDA work then raises NoDeviceError with the remedy.
"""


from ._cache import ImportCache, Mapping
from ._cuda import (
    busy_slots,
    collect,
    device_available,
    export_handle,
    init_reductions,
    rebuild_cupy_array,
    reduce_cupy_array,
)
from ._doctor import report as doctor_report
from ._errors import (
    ForkedAfterInitError,
    HandleError,
    NoDeviceError,
    ProducerGoneError,
    RegistryFullError,
    ShmCudaError,
    StaleHandleError,
    UnsupportedAllocatorError,
)
from ._fork import check_fork
from ._handle import CudaArrayHandle
from ._registry import Consumer, Registry, RegistryRef, consumer_for

__all__ = [
    "Consumer",
    "CudaArrayHandle",
    "ForkedAfterInitError",
    "HandleError",
    "ImportCache",
    "Mapping",
    "NoDeviceError",
    "ProducerGoneError",
    "Registry",
    "RegistryFullError",
    "RegistryRef",
    "ShmCudaError",
    "StaleHandleError",
    "UnsupportedAllocatorError",
    "busy_slots",
    "check_fork",
    "collect",
    "consumer_for",
    "device_available",
    "doctor_report",
    "export_handle",
    "init_reductions",
    "rebuild_cupy_array",
    "reduce_cupy_array",
]


def __getattr__(name):
    # the version lives in pyproject.toml only, read on first use: importing stays fast
    if name == "__version__":
        from importlib.metadata import version

        return version("shm-cuda")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
