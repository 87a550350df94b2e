"""Progress bars for maps (``progress=True`` on ``Pool.map`` and the rest, and on ``executor_map``): a tqdm bar
advanced in the parent as results arrive, drawn only where it can be seen.

The workers know nothing of it: the bar is the parent's, advanced by the thread that delivers results (the Pool's
result handler, a future's done-callback) just before it hands each one over, so a map's caller finds the bar
drawn to its end and closed when its ``get()`` returns. tqdm is imported only when a bar is asked for, and is not a
dependency of mp-reductions (arraymp's install has it).

Where it is drawn: on stderr where stderr is a terminal; nowhere where it is a pipe or a file (a CI log, ``2>log``
gets no carriage-return redraws: tqdm's own ``disable=None`` checks ``isatty`` too, but raises on a closed stream);
in a Jupyter kernel, ``tqdm.auto``'s widget (whose stderr is no terminal, yet shows the bar).
"""

from __future__ import annotations

import sys
import threading

_INSTALL = "pip install tqdm"


def isatty(stream) -> bool:
    """Whether ``stream`` is a terminal (False for a stream without ``isatty``, or closed)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's shell with an IPKernelApp): only looked up when a bar is
    asked for, and cheap: nothing is imported."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    try:
        shell = sys.modules["IPython"].get_ipython()
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # an IPython too old or too new to ask: the plain bar
        return False


class ProgressBar:
    """A tqdm bar that threads may advance and close in any order: ``add`` after ``close`` draws nothing, and the
    bar closes itself once every item of its known total is settled. The bar counts the items that succeeded; those
    that failed are counted apart, shown as ``failed=N`` after the rate."""

    def __init__(self, bar):
        self.bar = bar
        self.lock = threading.Lock()
        self.closed = False
        self.settled = self.failed = 0  # items whose result came, and those of them that failed
        self.total = bar.total

    def add(self, n: int, ok: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            self.settled += n
            if ok:
                self.bar.update(n)
            else:
                self.failed += n
                self.bar.set_postfix(failed=self.failed, refresh=False)  # drawn with the next update or the close
            if self.total is not None and self.settled >= self.total:
                self._close()

    def expect(self, total: int) -> None:
        """The total is known now (an iterable without ``len`` was read to its end)."""
        with self.lock:
            if self.closed:
                return
            self.total = self.bar.total = total
            if self.settled >= total:
                self._close()
            else:
                self.bar.refresh()

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self._close()

    def _close(self) -> None:
        self.closed = True
        self.bar.close()


def progress_bar(progress, total: int | None = None) -> ProgressBar | None:
    """The bar asked for by ``progress`` (True, or a dict of tqdm's options such as ``{"desc": "fit"}``), counting
    to ``total`` (None: unknown); None when ``progress`` is None or False. ImportError, saying how to install it,
    where tqdm is not installed."""
    if progress is None or progress is False:
        return None
    if progress is True:
        options = {}
    elif isinstance(progress, dict):
        options = dict(progress)
    else:
        raise TypeError("progress must be True, False, None or a dict of tqdm's options, not "
                        f"{type(progress).__name__}")
    notebook = _in_notebook()
    try:
        if notebook:
            from tqdm.auto import tqdm
        else:
            from tqdm import tqdm
    except ImportError as exc:
        raise ImportError(f"progress= draws a tqdm progress bar, and tqdm is not installed: `{_INSTALL}` "
                          f"(arraymp's own install includes it) ({exc})") from exc
    options.setdefault("total", total)
    if not notebook:
        options.setdefault("file", sys.stderr)
        options.setdefault("disable", not isatty(options["file"]))  # no redraws into a pipe or a log
    return ProgressBar(tqdm(**options))


def track_progress(result, bar: ProgressBar | None, sizes=None) -> None:
    """Advance ``bar`` (``progress_bar``'s; None: nothing to do) as ``result`` (one of mp_reductions' result
    objects, made and no task of it sent yet) gets its results: ``sizes[i]`` items for the result of task ``i``
    (``sizes``: a list, which may grow as tasks are made; None: one item each), failed ones too. The bar closes
    once every item of its total is settled (at once for a map of nothing); an iterator's total is known at
    ``_set_length`` (its tasks are all made) if it was not before. For every pool that delivers to these result
    objects (``mp_reductions.Pool``, mp-dask's)."""
    if bar is None:
        return
    result._progress, result._sizes = bar, sizes  # (the result advances it: _pool/results.py)
    if getattr(result, "ready", bool)():  # a map of nothing (an iterator's total comes at _set_length)
        bar.close()


def chunk_sizes(total: int, chunksize: int) -> list[int]:
    """The items of each of a map's chunks."""
    if chunksize <= 0:
        return []
    return [min(chunksize, total - start) for start in range(0, total, chunksize)]


def counted(tasks, sizes: list):
    """``tasks`` (a map's chunks, ``(func, items)`` each) as they are made, each one's item count added to
    ``sizes``."""
    for task in tasks:
        sizes.append(len(task[1]))
        yield task

