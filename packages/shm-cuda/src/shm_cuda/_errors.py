"""Exceptions of shm-cuda. Each says what happened and ends with the remedy."""

from __future__ import annotations


class ShmCudaError(RuntimeError):
    """Raised when a CUDA array cannot be shared or received; the base of this package's errors."""

    def __reduce__(self):
        return type(self), self.args


class NoDeviceError(ShmCudaError):
    """Raised when CUDA work is asked for and cupy is missing or sees no device."""


class ProducerGoneError(ShmCudaError):
    """Raised when a handle is used after the process that exported it has exited."""


class StaleHandleError(ShmCudaError):
    """Raised when a handle names a counter slot that was already released and reused."""


class RegistryFullError(ShmCudaError):
    """Raised when a producer's counter registry has no free slot or consumer row left."""


class ForkedAfterInitError(ShmCudaError):
    """Raised when shm_cuda is used in a child forked after CUDA was initialised in its parent."""


class UnsupportedAllocatorError(ShmCudaError, NotImplementedError):
    """Raised when an array's memory comes from an allocator whose memory CUDA IPC cannot export."""


class HandleError(ShmCudaError, ValueError):
    """Raised when a received handle is malformed (bad dtype, shape, strides or bounds)."""
