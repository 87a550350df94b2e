"""What travels in the pickle for one CUDA array: a small checked dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import HandleError
from ._registry import RegistryRef

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
UUID_BYTES = 16


@dataclass(frozen=True)
class CudaArrayHandle:
    """One exported view of a device allocation.

    ``ipc_handle`` names the whole cudaMalloc block (``block_size`` bytes);
    ``offset`` is the array's first byte from the block's base (a pool hands
    out pieces of blocks). The device is named by UUID, not index, because
    CUDA_VISIBLE_DEVICES may differ between processes. ``registry``/``slot``/
    ``generation`` name the producer's counter slot; ``token`` lets the
    producer return its original array on a same-process round trip.
    """

    ipc_handle: bytes
    block_size: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device_uuid: bytes
    event_handle: bytes | None
    producer_pid: int
    registry: RegistryRef
    slot: int
    generation: int
    token: int = 0

    @property
    def key(self) -> tuple[bytes, bytes]:
        """The import cache key: one mapping per (device, allocation) per process."""
        return (self.device_uuid, self.ipc_handle)

    def validate(self):
        """Check the handle; returns its numpy dtype. Raises HandleError naming what is wrong."""
        import numpy

        if not isinstance(self.ipc_handle, bytes) or len(self.ipc_handle) != IPC_HANDLE_BYTES:
            raise HandleError(f"CUDA IPC memory handle must be {IPC_HANDLE_BYTES} bytes, got {_len(self.ipc_handle)}")
        if self.event_handle is not None and (not isinstance(self.event_handle, bytes)
                                              or len(self.event_handle) != IPC_HANDLE_BYTES):
            raise HandleError(f"CUDA IPC event handle must be {IPC_HANDLE_BYTES} bytes or None, "
                              f"got {_len(self.event_handle)}")
        if not isinstance(self.device_uuid, bytes) or len(self.device_uuid) != UUID_BYTES:
            raise HandleError(f"device UUID must be {UUID_BYTES} bytes, got {_len(self.device_uuid)}")
        try:
            dtype = numpy.dtype(self.dtype)
        except (TypeError, ValueError) as exc:
            raise HandleError(f"unknown dtype {self.dtype!r} in CUDA array handle ({exc})") from None
        if dtype.hasobject or dtype.itemsize == 0:
            raise HandleError(f"dtype {self.dtype!r} cannot live in device memory")
        if len(self.shape) != len(self.strides):
            raise HandleError(f"CUDA array handle has {len(self.shape)} dimensions but {len(self.strides)} strides")
        if any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise HandleError(f"bad shape {self.shape} in CUDA array handle")
        if not isinstance(self.block_size, int) or self.block_size < 0:
            raise HandleError(f"bad block size {self.block_size!r} in CUDA array handle")
        check_extent(self.block_size, self.offset, self.shape, self.strides, dtype.itemsize)
        return dtype


def _len(x) -> str:
    return f"{len(x)} bytes" if isinstance(x, bytes) else type(x).__name__


def check_extent(block_size: int, offset: int, shape, strides, itemsize: int) -> None:
    """Raise HandleError unless every element lies inside ``[0, block_size)``."""
    if not isinstance(offset, int) or not 0 <= offset <= block_size:
        raise HandleError(f"offset {offset} lies outside the {block_size}-byte device allocation")
    if any(n == 0 for n in shape):
        return
    lo = hi = offset
    for n, st in zip(shape, strides, strict=True):
        if not isinstance(st, int):
            raise HandleError(f"bad strides {strides} in CUDA array handle")
        if st < 0:
            lo += st * (n - 1)
        else:
            hi += st * (n - 1)
    if lo < 0 or hi + itemsize > block_size:
        raise HandleError(f"array of shape {tuple(shape)}, strides {tuple(strides)} at offset {offset} reaches bytes "
                          f"[{lo}, {hi + itemsize}) outside its {block_size}-byte device allocation; the handle is "
                          "corrupted")
