"""shm-cuda (work in progress)."""

__all__ = []
__version__ = "0.1.0"
