"""``multiprocessing.util``: the stdlib's, under arraymp's name (``import arraymp.util`` works as
``import multiprocessing.util`` does); its private names too."""

from multiprocessing import util as _stdlib
from multiprocessing.util import (
    SUBDEBUG,
    SUBWARNING,
    Finalize,
    ForkAwareLocal,
    ForkAwareThreadLock,
    close_all_fds_except,
    debug,
    get_logger,
    get_temp_dir,
    info,
    is_exiting,
    log_to_stderr,
    register_after_fork,
    sub_debug,
    sub_warning,
)

__all__ = ["Finalize", "ForkAwareLocal", "ForkAwareThreadLock", "SUBDEBUG", "SUBWARNING", "close_all_fds_except",
           "debug", "get_logger", "get_temp_dir", "info", "is_exiting", "log_to_stderr", "register_after_fork",
           "sub_debug", "sub_warning"]


def __getattr__(name):
    return getattr(_stdlib, name)
