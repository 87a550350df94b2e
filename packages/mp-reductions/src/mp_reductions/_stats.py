"""What moved: this process's counters of messages, arrays and segments (``stats()``), what another process
reads of them (``read(pid)``: ``python -m arraymp stats PID``), and the warning when sharing stops.

Note [stats]
~~~~~~~~~~~~
Invariant: a process's counters are written by that process alone, readable by another of its uid (or root) as they are
now, and nothing of them outlives the process.

How: each process keeps its counters in one array of int64 words, ``counts``; the send and receive paths add to a word
by its index (``FIELDS`` says which counts what): no lock, no lookup by name, no system call. From ``init_reductions()``
on (``import arraymp``, or a channel of ours received) that array is a page of its own memfd, ``arraymp-stats``, mapped
shared and open for the process's life::

    | magic "AMPSTATS", version, nfields, pid, names at, names length | int64 x nfields | names, comma-separated |
    | where sharing first stopped (file:line), NUL-padded                                                      |

A reader (``read``) finds it among ``/proc/PID/fd`` (open to the owner and root only) and trusts nothing in it: a
regular file of its own uid and one page, its magic, version and pid, field names that are short identifiers. A memfd
has no name on any filesystem and goes with the last process holding it, SIGKILL included: nothing is left behind, and
no dead pid's counters can be read. A fork child drops the inherited page and starts its own from zero
(``os.register_at_fork``). Segments mapped and descriptors held (``GAUGES``) are read from ``/proc/PID/maps`` and
``/proc/PID/fd`` when asked.

Not covered: increments from several threads are not atomic (two at once may, rarely, lose one): exact for one sending
and one receiving thread, as the tests use them.

Note [sharing stopped]
~~~~~~~~~~~~~~~~~~~~~~
Invariant: every unshared array of at least the inline threshold that goes inside the pickle is counted (``fallbacks``,
``fallback_bytes``), and the first of a process (a fork child's first too) raises a ``SharingStoppedWarning`` saying
what happened, how many bytes, and the remedy; on our channels, before it is sent.

Why: such an array is meant for shared memory (copied once into a segment). Where it goes inside the pickle instead (a
full shared-memory directory, or a stdlib or Manager channel under the file_descriptor strategy: _reductions Note
[channels we do not own]) every byte of it is copied through the socket, ten times slower, and nothing said so. On our
channels the warning comes while the message is pickled, so a filter that makes it an error fails the ``put`` with
nothing sent.

Note [copy hints]
~~~~~~~~~~~~~~~~~
Rule: ``hints()`` gives the remedy that fits what was copied, never one the copied thing cannot take.

A numpy array (a pandas frame's numeric block too) can be made in shared memory beforehand, and then travels as a
handle with no copy: its hint says how. A protocol-5 buffer of pyarrow's (an Arrow Table's, RecordBatch's or
Arrow-backed pandas column's) cannot: pyarrow allocates from its own memory pool and nothing of ours builds a Table,
so its one copy on send is the least it can cost, and what is worth checking is that only the rows meant to go went:
a ``Table.slice`` carries its parent's whole buffers (docs/payloads.md). So the sender's ``out_of_band`` counts the
buffers that are no numpy array's apart (``buffers_copied``, ``buffer_bytes_copied``, part of ``arrays_copied``).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import sys
import threading
import warnings

__all__ = ["FIELDS", "SharingStoppedWarning", "Stats", "count", "read", "stats"]

#: the counters, in the order of ``counts`` (each since the process started):
FIELDS = (
    "messages_sent",  # messages this process put on our channels (a Pool's batch of tasks is one)
    "messages_received",  # messages it took off them
    "handles_sent",  # arrays sent as handles: already in shared memory, no copy
    "arrays_copied",  # arrays (and protocol-5 buffers) copied once into shared memory to be sent
    "bytes_copied",  # their bytes
    "arrays_inline",  # arrays sent inside the pickle (small ones, and those of ``fallbacks``)
    "bytes_inline",  # their bytes
    "fallbacks",  # arrays meant for shared memory that went inside the pickle (Note [sharing stopped])
    "fallback_bytes",  # their bytes
    "segments_made",  # shared-memory segments this process made (copies, spills, arenas, shared arrays)
    "segments_reused",  # pooled segments it took again instead of making one (_recycle Note [recycling])
    "worker_deaths",  # Pool workers of this process's pools that died running a task (not ended for a timeout)
    "task_timeouts",  # Pool tasks that ran past their time limit (their workers ended)
    "buffers_copied",  # of arrays_copied, the protocol-5 buffers that are no numpy array's (pyarrow's)
    "buffer_bytes_copied",  # their bytes
)
(MESSAGES_SENT, MESSAGES_RECEIVED, HANDLES_SENT, ARRAYS_COPIED, BYTES_COPIED, ARRAYS_INLINE, BYTES_INLINE,
 FALLBACKS, FALLBACK_BYTES, SEGMENTS_MADE, SEGMENTS_REUSED, WORKER_DEATHS, TASK_TIMEOUTS, BUFFERS_COPIED,
 BUFFER_BYTES_COPIED) = range(len(FIELDS))
#: read from the kernel when asked (Note [stats]): they are values now, not counts since a start
GAUGES = ("segments_live", "descriptors_held")
_INDEX = {name: i for i, name in enumerate(FIELDS)}

MEMFD_NAME = "arraymp-stats"
_LINK = f"/memfd:{MEMFD_NAME} (deleted)"
_SEGMENT_LINK = "/memfd:arraymp (deleted)"  # shm_core's memfd segments
_MAGIC = b"AMPSTATS"
_VERSION = 1
_HEAD = struct.Struct("<8sIIqII")  # magic, version, nfields, pid, names at, names length
_COUNTS_AT = 64
_PAGE = 4096
_WHERE_AT = 3072  # where sharing first stopped, up to the page's end
_NAME = re.compile(rb"[a-z][a-z0-9_]{0,63}")

counts = memoryview(bytearray(8 * len(FIELDS))).cast("q")  # this process's counters (a page once published)
_page: tuple | None = None  # (mmap, the views over it) once published
_warned = False
_where = ""  # where sharing first stopped (file:line of the caller)
_full: str = ""  # why the last segment could not be made (a SharedMemoryFullError's message)


class SharingStoppedWarning(UserWarning):
    """Raised (as a warning, once per process) when an array meant for shared memory travelled inside the
    pickle instead: copied through the socket, much slower (Note [sharing stopped]). The message says how many
    bytes, why, and the remedy; ``arraymp.stats()`` counts every such array (``fallbacks``)."""


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to the counter ``name`` (one of ``FIELDS``): for events that are not per message, e.g. a Pool
    worker's death (``worker_deaths``) or a task's timeout (``task_timeouts``)."""
    counts[_INDEX[name]] += n


# ----------------------------------------------------------------------------------------------- publishing
def publish() -> None:
    """Move this process's counters into a page another process can read (Note [stats]); once per process."""
    global counts, _page
    if _page is not None:
        return
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _PAGE)
        mm = mmap.mmap(fd, _PAGE)  # (it keeps a descriptor of its own, close-on-exec: the one a reader finds)
    finally:
        os.close(fd)
    names = ",".join(FIELDS).encode()
    names_at = _COUNTS_AT + 8 * len(FIELDS)
    mm[names_at:names_at + len(names)] = names
    whole = memoryview(mm)
    view = whole[_COUNTS_AT:names_at]
    new = view.cast("q")
    new[:] = counts
    # the header last: a reader never takes a page half written for a valid one
    _HEAD.pack_into(mm, 0, _MAGIC, _VERSION, len(FIELDS), os.getpid(), names_at, len(names))
    _page, counts = (mm, (new, view, whole)), new
    if _where:
        _write_where()


def _write_where() -> None:
    if _page is not None:
        data = _where.encode("utf-8", "replace")[:_PAGE - _WHERE_AT - 1]
        _page[0][_WHERE_AT:_WHERE_AT + len(data)] = data


def _after_fork_in_child() -> None:
    # Note [stats]: the counters are the child's own from zero; the parent's page is not ours to write
    global counts, _page, _warned, _where, _full
    page, _page = _page, None
    counts = memoryview(bytearray(8 * len(FIELDS))).cast("q")
    _warned, _where, _full = False, "", ""
    if page is not None:
        mm, views = page
        try:  # (a view still held somewhere keeps the mapping and its descriptor: never written again, and a
            # reader refuses it, the pid in it the parent's)
            for v in views:
                v.release()
            mm.close()
        except BufferError:
            pass
        publish()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -------------------------------------------------------------------------------------------------- reading
def _gauges(pid: int | str) -> dict[str, int]:
    """Segments ``pid`` maps (ours: memfd ones and named ones) and memfd segment descriptors it holds, from
    /proc (Note [stats])."""
    import shm_manager

    segments = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].rstrip("\n")
            if path.endswith(" (deleted)"):
                path = path[:-10]
            if path == _SEGMENT_LINK[:-10] or (path.startswith("/") and shm_manager.parse_name(os.path.basename(path))):
                segments.add((parts[3], parts[4]))  # device, inode: one segment however many mappings
    fds = 0
    for link in _fd_links(pid):
        fds += link[1] == _SEGMENT_LINK
    return {"segments_live": len(segments), "descriptors_held": fds}


def _fd_links(pid) -> list[tuple[str, str]]:
    fd_dir = f"/proc/{pid}/fd"
    links = []
    for n in os.listdir(fd_dir):
        try:
            links.append((n, os.readlink(f"{fd_dir}/{n}")))
        except OSError:  # closed meanwhile
            pass
    return links


def _values() -> list[int]:
    return counts.tolist()


def read(pid: int) -> Stats:
    """The counters of the running process ``pid`` (Note [stats]). Raises ProcessLookupError (no such process),
    PermissionError (another user's), LookupError (no arraymp counters published there)."""
    pid = int(pid)
    if pid == os.getpid():
        return stats()
    try:
        links = _fd_links(pid)
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid} is running") from None
    except PermissionError:
        if _zombie(pid):
            raise ProcessLookupError(f"process {pid} has exited (its parent has not waited for it yet)") from None
        raise PermissionError(f"process {pid} is another user's: only its owner (or root) can read its "
                              "arraymp counters") from None
    seen = 0
    for n, link in links:
        if link != _LINK:
            continue
        seen += 1
        got = _read_page(pid, n)
        if got is not None:
            gauges = _gauges(pid)
            return Stats(got[0], gauges, pid=pid, where=got[1])
    if _zombie(pid):
        raise ProcessLookupError(f"process {pid} has exited (its parent has not waited for it yet)")
    why = "its page is not valid (another arraymp version, or not written by it)" if seen else \
        "it has not imported arraymp (counters are published from `import arraymp` on)"
    raise LookupError(f"process {pid} publishes no arraymp counters: {why}")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[:1] == [b"Z"]
    except OSError:
        return True


def _read_page(pid: int, n: str) -> tuple[dict[str, int], str] | None:
    """The counters and ``where`` of the page behind /proc/PID/fd/N, or None when it is not one (untrusted)."""
    try:
        fd = os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != _PAGE:
            return None
        with mmap.mmap(fd, _PAGE, prot=mmap.PROT_READ) as mm:
            magic, version, nfields, owner, names_at, names_len = _HEAD.unpack_from(mm)
            if magic != _MAGIC or version != _VERSION or owner != pid or not 0 < nfields <= 256 \
                    or names_at != _COUNTS_AT + 8 * nfields or not 0 < names_len <= _WHERE_AT - names_at:
                return None
            names = bytes(mm[names_at:names_at + names_len]).split(b",")
            if len(names) != nfields or not all(_NAME.fullmatch(name) for name in names):
                return None
            with memoryview(mm) as whole, whole[_COUNTS_AT:names_at] as view, view.cast("q") as words:
                values = dict(zip((name.decode() for name in names), words.tolist(), strict=True))
            where = bytes(mm[_WHERE_AT:]).split(b"\0", 1)[0].decode("utf-8", "replace")
        return values, where
    except (OSError, ValueError, struct.error):
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ the Stats object
def stats() -> Stats:
    """This process's counters since it started (a fork child: since the fork), and the segments and
    descriptors it holds now. ``with arraymp.stats() as s:`` counts the block only: inside it ``s`` reads the
    counts so far, after it the block's.
    """
    return Stats(dict(zip(FIELDS, _values(), strict=True)), _gauges("self"), pid=os.getpid(), where=_where)


class Stats:
    """What moved through a process's arraymp channels (``arraymp.stats()``): its fields are ``FIELDS`` (counts)
    and ``GAUGES`` (values now); ``as_dict()``; ``str()`` is a table. A context manager: ``with arraymp.stats()
    as s:`` makes ``s`` count from the block's start (live inside it, frozen at its end)."""

    __slots__ = ("_base", "_gauges", "_live", "_values", "_where", "pid")

    def __init__(self, values: dict[str, int], gauges: dict[str, int], *, pid: int, where: str = ""):
        self._values, self._gauges, self.pid, self._where = values, gauges, pid, where
        self._base: dict[str, int] | None = None
        self._live = False

    def __enter__(self) -> Stats:
        if self.pid != os.getpid():
            raise RuntimeError("only this process's stats() can count a block")
        self._base, self._live = dict(zip(FIELDS, _values(), strict=True)), True
        return self

    def __exit__(self, *exc) -> None:
        self._freeze()

    def _freeze(self) -> None:
        if self._live:
            now = dict(zip(FIELDS, _values(), strict=True))
            self._values = {k: now[k] - self._base[k] for k in FIELDS}
            self._gauges, self._where, self._live = _gauges("self"), _where, False

    @property
    def where(self) -> str:
        """Where sharing first stopped in the process (the file:line of the call that sent it), or ""."""
        return _where if self._live else self._where

    def _get(self, name: str) -> int:
        if name in self._gauges:
            return _gauges("self")[name] if self._live else self._gauges[name]
        if self._live:
            return counts[_INDEX[name]] - self._base[name]
        return self._values.get(name, 0)

    def as_dict(self) -> dict[str, int]:
        """Every field by name: the counts, then the gauges."""
        if self._live:
            now = dict(zip(FIELDS, _values(), strict=True))
            return {**{k: now[k] - self._base[k] for k in FIELDS}, **_gauges("self")}
        return {**{k: self._values.get(k, 0) for k in FIELDS}, **self._gauges,
                **{k: v for k, v in self._values.items() if k not in _INDEX}}

    def __eq__(self, other) -> bool:
        return self.as_dict() == other.as_dict() if isinstance(other, Stats) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"Stats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"

    def __str__(self) -> str:
        d = self.as_dict()
        since = "in the block" if self._base is not None else "since it started"
        rows = [
            ("messages sent", f"{d['messages_sent']:,}", ""),
            ("messages received", f"{d['messages_received']:,}", ""),
            ("arrays sent as handles", f"{d['handles_sent']:,}", "no copy: already in shared memory"),
            ("arrays copied into shared memory", f"{d['arrays_copied']:,}", _human(d["bytes_copied"])),
            ("  of which Arrow (pyarrow) buffers", f"{d['buffers_copied']:,}", _human(d["buffer_bytes_copied"])),
            ("arrays sent inline (pickled)", f"{d['arrays_inline']:,}", _human(d["bytes_inline"])),
            ("  of which sharing stopped", f"{d['fallbacks']:,}", _human(d["fallback_bytes"])),
            ("segments made", f"{d['segments_made']:,}", ""),
            ("segments reused (recycled)", f"{d['segments_reused']:,}", ""),
            ("segments live", f"{d['segments_live']:,}", "now"),
            ("descriptors held", f"{d['descriptors_held']:,}", "now"),
            ("worker deaths", f"{d['worker_deaths']:,}", ""),
            ("task timeouts", f"{d['task_timeouts']:,}", ""),
        ]
        width = max(len(r[0]) for r in rows)
        num = max(len(r[1]) for r in rows)
        lines = [f"arraymp stats of process {self.pid}, {since}:"]
        lines += [f"  {a:<{width}}  {b:>{num}}  {c}".rstrip() for a, b, c in rows]
        lines += [f"  {hint}" for hint in self.hints(d)]
        return "\n".join(lines)

    def hints(self, d: dict[str, int] | None = None) -> list[str]:
        """What the counts say about speed, in words (empty when nothing stands out)."""
        d = d or self.as_dict()
        out = []
        if d["fallbacks"]:
            where = f" (first at {self.where})" if self.where else ""
            out.append(f"! {d['fallbacks']:,} array(s), {_human(d['fallback_bytes'])}, went pickled through the "
                       f"socket instead of shared memory{where}: see the SharingStoppedWarning for the remedy")
        # (Note [copy hints])
        arrays = d["arrays_copied"] - d["buffers_copied"]
        array_bytes = d["bytes_copied"] - d["buffer_bytes_copied"]
        if arrays and array_bytes >= 64 << 20:
            out.append(f"~ your arrays are being copied, not shared: {_human(array_bytes)} of numpy arrays copied "
                       "into shared memory to be sent; arrays made by arraymp.empty_shared / zeros_shared / "
                       "share_memory, or inside arraymp.shared_allocation() (pandas frames built there too), "
                       "travel as handles with no copy")
        if d["buffers_copied"] and d["buffer_bytes_copied"] >= 64 << 20:
            out.append(f"~ {_human(d['buffer_bytes_copied'])} of Arrow buffers (pyarrow Tables, RecordBatches, "
                       "Arrow-backed pandas columns) copied once into shared memory to be sent, read in place by "
                       "the receiver: that copy is the least for Arrow data, which cannot be made in shared memory "
                       "beforehand. If it is more than the rows you sent, you sent slices: a Table.slice or "
                       "RecordBatch.slice carries its parent's whole buffers; "
                       "part.take(numpy.arange(part.num_rows)) sends its rows alone")
        return out


for _name in (*FIELDS, *GAUGES):
    setattr(Stats, _name, property(lambda self, _n=_name: self._get(_n), doc=f"``{_name}``"))
del _name


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


# ----------------------------------------------------------------------------------------- sharing stopped
def note_full(exc: BaseException) -> None:
    """A segment could not be made for a message (``exc``): said by the warning if its arrays go pickled."""
    global _full
    _full = getattr(exc, "strerror", None) or str(exc)


def commit(out) -> None:
    """A message went out: add its arrays' counts (an Outgoing, or a bare array's)."""
    c = counts
    c[HANDLES_SENT] += out.n_handles
    c[ARRAYS_COPIED] += out.arrays_copied
    c[BYTES_COPIED] += out.bytes_copied
    c[ARRAYS_INLINE] += out.arrays_inline
    c[BYTES_INLINE] += out.bytes_inline
    c[FALLBACKS] += out.fallbacks
    c[FALLBACK_BYTES] += out.fallback_bytes
    c[BUFFERS_COPIED] += out.buffers_copied
    c[BUFFER_BYTES_COPIED] += out.buffer_bytes_copied


def sharing_stopped(arrays: int, nbytes: int, reason: str) -> None:
    """``arrays`` arrays of ``nbytes`` in all, meant for shared memory, go pickled (Note [sharing stopped]):
    warn, once per process. ``reason``: "full" (no segment could be made: the last note_full says why) or
    "channel" (a channel we do not own, under file_descriptor)."""
    global _warned, _where
    if _warned:
        return
    _warned = True
    level, _where = _caller()
    _write_where()
    what = f"{arrays} array(s) of {_human(nbytes)} ({nbytes:,} bytes)" if arrays > 1 else \
        f"an array of {_human(nbytes)} ({nbytes:,} bytes)"
    if reason == "full":
        why = _full or "no shared-memory segment could be made"
        text = (f"arraymp: sharing stopped: {what} travelled inside the pickle, not by shared memory (copied "
                f"and pickled: many times slower). The cause: {why}")
        if not text.endswith("."):
            text += "."
    else:
        text = (f"arraymp: sharing stopped: {what} travelled pickled, not by shared memory, on a channel "
                "arraymp does not own (a stdlib or Manager queue or pipe) under the 'file_descriptor' strategy: "
                "such a channel cannot carry a segment's descriptor. Send it through arraymp's Queue, "
                "SimpleQueue, Pipe or Pool (import arraymp as mp; mp.Queue()), or use the 'file_system' "
                "strategy (mp.set_sharing_strategy('file_system')), whose segments travel by name on any channel.")
    warnings.warn(f"{text} Said once per process; arraymp.stats() counts every such array (fallbacks).",
                  SharingStoppedWarning, stacklevel=level)


threading_file = threading.__file__
_PACKAGES = ("arraymp", "mp_dask", "mp_reductions", "mp_spawn", "shm_core", "shm_manager", "multiprocessing")


def _caller() -> tuple[int, str]:
    """The warnings stacklevel of the first frame outside arraymp's packages and multiprocessing (the user's
    call that sent the array), and its file:line; (2, "") when there is none (a stdlib queue's feeder thread)."""
    internal = tuple(os.path.dirname(m.__file__) + os.sep for m in map(sys.modules.get, _PACKAGES)
                     if m is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(2), 2
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(internal) and frame.f_code.co_filename != threading_file:
            return level, f"{path}:{frame.f_lineno}"
        frame, level = frame.f_back, level + 1
    return 2, ""
