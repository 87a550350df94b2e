"""What the benchmarks share (``_bench``, ``_overhead``, ``_payloads``, ``_inputs``): pickling as another system
does, the progress shown on stderr, sizes in words, and the machine's memory."""

from __future__ import annotations

import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
from mp_reductions import isatty
from tqdm import tqdm


def human(n: int) -> str:
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30} GiB"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def meminfo(field: str) -> int:
    """Bytes of ``field`` in /proc/meminfo (``MemAvailable``, ``Shmem``: the whole machine's)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def plain_pickling():
    """Undo arraymp's registration in this process: the stdlib baseline pickles arrays."""
    ForkingPickler._extra_reducers.pop(np.ndarray, None)


class As:
    """Pickle in this process as ``system`` does while inside the block."""

    def __init__(self, system):
        self.system = system

    def __enter__(self):
        self.saved = ForkingPickler._extra_reducers.get(np.ndarray)
        if self.system != "arraymp":
            plain_pickling()
        if self.system.startswith("torch"):
            import torch.multiprocessing as tmp

            tmp.set_sharing_strategy("file_descriptor" if self.system == "torch-fd" else "file_system")

    def __exit__(self, *exc):
        if self.saved is not None:
            ForkingPickler.register(np.ndarray, self.saved)


class Status:
    """Progress on stderr. Where stderr is a terminal, ``show`` draws one line in place (a tqdm status line);
    anywhere else (a pipe, a file, a CI log) it writes nothing, so the output holds plain lines only, never
    carriage-return redraws. ``line`` writes a line that stays, either way; ``bar`` makes a tqdm progress bar
    that is drawn only on a terminal too."""

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.tty = isatty(self.stream)  # the test of the pools' progress bars (progress=True)
        self.status = None  # the tqdm line ``show`` draws in place, None when none

    def show(self, text: str) -> None:
        if self.status is None and self.tty:
            self.status = tqdm(file=self.stream, bar_format="{desc}", leave=False)
        if self.status is not None:
            self.status.set_description_str(text)

    def done(self) -> None:
        """Ends the line shown in place, which stays on the screen."""
        if self.status is not None:
            self.status.leave = True
            self.status.close()
            self.status = None

    def line(self, text: str) -> None:
        if self.status is not None:  # clear what show() drew
            self.status.close()
            self.status = None
        tqdm.write(text, file=self.stream)
        self.stream.flush()

    def bar(self, total: int) -> tqdm:
        """A progress bar of ``total`` steps (``update()`` each), drawn only where the stream is a terminal."""
        return tqdm(total=total, file=self.stream, disable=not self.tty, leave=True, unit="msg",
                    bar_format="  {bar:40} {percentage:3.0f}% {n_fmt}/{total_fmt} {unit}")
