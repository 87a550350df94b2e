"""Functions run in pool workers for the timeout and death tests (importable under spawn and forkserver)."""

import ctypes
import faulthandler
import os
import time

import numpy as np

HANG = 3  # the item that hangs


def square_or_hang(x, path, array=None):
    """``x * x``, except item HANG: it writes its start (``time.monotonic()``, one clock for the machine's
    processes) to ``path`` and sleeps a minute. ``array``: shared memory the task holds while it hangs."""
    if x == HANG:
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.replace(path + ".tmp", path)
        time.sleep(60)
    return x * x


def square_or_hang_args(args):
    return square_or_hang(*args)


def nap(seconds):
    time.sleep(seconds)
    return seconds


def crash(x):
    if x == HANG:
        # The fault's report (faulthandler's "Fatal Python error: Segmentation fault" and stack, where it is on) goes
        # to this worker's stderr, which the test captures: a fork worker inherits pytest's faulthandler, which
        # writes to the terminal pytest started on (issue 44).
        if faulthandler.is_enabled():
            faulthandler.enable(file=2)
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return x


def hog(step=8 << 20, pause=0.02):
    """Touch memory ``step`` bytes at a time until the kernel's OOM killer ends this process."""
    held = []
    while True:
        held.append(np.ones(step, np.uint8))
        time.sleep(pause)
