"""What moved (issue 34, item 4) and saying when sharing stops (item 7): ``stats()`` counts a known sequence of
sends exactly, in this process and in a child under each start method; another process reads a running one's
counters (_stats Note [stats]) and trusts nothing of what it finds; an array meant for shared memory that goes
pickled warns once per process (Note [sharing stopped]) and still arrives whole."""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import mp_reductions as mpr
import numpy as np
import pytest
from _stats_targets import BIG, SENT, SMALL, check_sequence, child_sends, counters, send_sequence
from mp_reductions import _recycle, _stats


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    """Each test may see the once-per-process warning again."""
    monkeypatch.setattr(_stats, "_warned", False)
    monkeypatch.setattr(_stats, "_where", "")


def test_stats_is_readable():
    s = mpr.stats()
    assert set(s.as_dict()) == {*_stats.FIELDS, *_stats.GAUGES}
    assert all(type(v) is int and v >= 0 for v in s.as_dict().values())
    assert s.messages_sent == s.as_dict()["messages_sent"] and s.pid == os.getpid()
    text = str(s)
    assert text.startswith(f"arraymp stats of process {os.getpid()}, since it started:")
    for row in ("messages sent", "arrays sent as handles", "arrays copied into shared memory",
                "arrays sent inline (pickled)", "of which sharing stopped", "segments reused (recycled)",
                "descriptors held", "worker deaths", "task timeouts"):
        assert row in text
    assert repr(s).startswith("Stats(messages_sent=")


@pytest.mark.parametrize("channel", ["Queue", "SimpleQueue", "Pipe"])
def test_a_known_sequence_is_counted_exactly(strategy, channel):
    if channel == "Pipe":
        r, w = mpr.Pipe(duplex=False)
        q = type("P", (), {"put": staticmethod(w.send), "get": staticmethod(r.recv)})()
    else:
        q = getattr(mpr, channel)()
    with mpr.stats() as s:
        shared = send_sequence(q)
        assert s.messages_sent == 6 and s.messages_received == 0  # live inside the block
        check_sequence(q)
    got = s.as_dict()
    assert counters(got) | {"segments_made": 0, "segments_reused": 0} == {
        **SENT, "messages_received": 6, "segments_made": 0, "segments_reused": 0}
    assert got["segments_made"] + got["segments_reused"] == 3  # the shared array's, the two copies'
    assert s.messages_sent == 6  # frozen after the block
    del shared
    if channel == "Pipe":
        r.close()
        w.close()
    else:
        q.close()


def test_a_message_of_several_arrays_counts_each(strategy):
    q = mpr.SimpleQueue()
    shared = mpr.empty_shared(100)  # small: an arena block, a handle all the same
    with mpr.stats() as s:
        q.put([np.ones(3), np.ones(BIG), shared, np.ones(BIG, np.float32), {"k": np.zeros(SMALL)}])
        got = q.get()
    assert (got[1] == 1).all() and got[2] is not shared and mpr.is_shared(got[2])
    assert (s.messages_sent, s.messages_received, s.handles_sent) == (1, 1, 1)
    assert (s.arrays_copied, s.bytes_copied) == (2, 8 * BIG + 4 * BIG)
    assert (s.arrays_inline, s.bytes_inline) == (2, 24 + 8 * SMALL)
    assert s.segments_made + s.segments_reused == 1  # all copies of one message go into one segment
    q.close()


def test_stats_block_counts_only_the_block():
    q = mpr.SimpleQueue()
    q.put(np.ones(SMALL))
    q.get()
    total = mpr.stats()
    with mpr.stats() as s:
        assert s.messages_sent == 0 and str(s).startswith(f"arraymp stats of process {os.getpid()}, in the block:")
        q.put(1)
        assert s.messages_sent == 1 and s.messages_received == 0
        q.get()
    q.put(2)
    q.get()
    assert (s.messages_sent, s.messages_received, s.arrays_inline) == (1, 1, 0)
    after = mpr.stats()
    assert after.messages_sent == total.messages_sent + 2 and after.arrays_inline == total.arrays_inline
    q.close()


def test_gauges_are_what_the_process_holds_now():
    _recycle.release_all()  # (else the recycler may drop earlier tests' segments meanwhile)
    gc.collect()
    before = mpr.stats()
    a = mpr.empty_shared(BIG)  # a memfd segment of its own, its descriptor kept
    now = mpr.stats()
    assert now.segments_live == before.segments_live + 1
    assert now.descriptors_held == before.descriptors_held + 1
    del a  # its segment goes back to the recycling pool (empty_shared's large arrays are recycled), which holds it
    assert mpr.stats().segments_live == before.segments_live + 1
    _recycle.release_all()
    after = mpr.stats()
    assert after.segments_live == before.segments_live and after.descriptors_held == before.descriptors_held


def test_count_is_the_api_for_events_that_are_not_messages():
    with mpr.stats() as s:
        _stats.count("worker_deaths")
        _stats.count("task_timeouts", 2)
    assert (s.worker_deaths, s.task_timeouts) == (1, 2)
    with pytest.raises(KeyError):
        _stats.count("no_such_counter")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_childs_counts_are_its_own_and_readable_by_pid(method, strategy):
    ctx = multiprocessing.get_context(method)
    q, out, cmd = mpr.Queue(), mpr.Queue(), mpr.Queue()
    q.put(np.ones(SMALL))  # this process counts before the fork: a fork child starts from zero all the same
    q.get(timeout=60)
    p = ctx.Process(target=child_sends, args=(q, out, cmd, strategy))
    with mpr.stats() as s:
        p.start()
        try:
            check_sequence(q)
            before, after = out.get(timeout=60)
            assert before == dict.fromkeys(_stats.FIELDS, 0)
            assert {k: after[k] for k in SENT} == SENT and after["messages_received"] == 0
            assert after["segments_made"] + after["segments_reused"] == 3
            # the child's page, read from here (Note [stats]); its last message (``out``'s) may be received here
            # before the child counted it
            deadline = time.monotonic() + 10
            while (seen := _stats.read(p.pid)).messages_sent != 7 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen.pid == p.pid and counters(seen.as_dict()) == counters(after | {"messages_sent": 7})
            assert seen.segments_live >= 1  # the shared array it keeps until told to go
        finally:
            cmd.put(None)
            p.join(60)
    assert p.exitcode == 0
    assert (s.messages_sent, s.messages_received) == (1, 7)  # the word to go; 6 arrays and the child's counts
    assert (s.arrays_copied, s.handles_sent, s.fallbacks) == (0, 0, 0)
    for chan in (q, out, cmd):
        chan.close()


def test_a_killed_process_leaves_nothing_to_read_or_clean():
    code = ("import sys, numpy as np, mp_reductions as m\n"
            "m.init_reductions(); q = m.SimpleQueue(); q.put(np.ones(1 << 17)); q.get()\n"
            "print('ready', flush=True); sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        s = _stats.read(p.pid)
        assert (s.messages_sent, s.arrays_copied, s.bytes_copied) == (1, 1, 8 << 17)
        p.kill()
        p.wait(30)
        with pytest.raises(ProcessLookupError, match=f"no process {p.pid} is running"):
            _stats.read(p.pid)
    finally:
        p.kill()
        p.wait()
    # the page was a memfd: gone with the process, and no file of it anywhere (the leak check counts /dev/shm)
    left = [os.path.join(d, n) for d, _, names in os.walk(os.environ.get("ARRAYMP_SHM_DIR", "/dev/shm"))
            for n in names if f"_{p.pid}_" in n]
    assert not left


def test_a_zombie_is_said_to_have_exited():
    p = subprocess.Popen([sys.executable, "-c", "import mp_reductions as m; m.init_reductions()"])
    try:
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        with pytest.raises(ProcessLookupError, match="has exited"):
            _stats.read(p.pid)
    finally:
        p.wait()


FORGED = """
import mmap, os, struct, sys
fd = os.memfd_create("arraymp-stats", os.MFD_CLOEXEC)
os.ftruncate(fd, {size})
m = mmap.mmap(fd, {size})
kind = sys.argv[1]
if kind != "garbage":
    names = b"messages_sent,rm -rf" if kind == "names" else b"messages_sent"
    pid = os.getpid() + 1 if kind == "pid" else os.getpid()
    struct.pack_into("<8sIIqII", m, 0, b"AMPSTATS", 1, 1, pid, 72, len(names))
    m[72:72 + len(names)] = names
else:
    m[:8] = b"garbage!"
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("kind", ["garbage", "pid", "names", "size"])
def test_a_forged_page_is_not_read(kind):
    code = FORGED.format(size=8192 if kind == "size" else 4096)
    p = subprocess.Popen([sys.executable, "-c", code, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        with pytest.raises(LookupError, match="not valid"):
            _stats.read(p.pid)
    finally:
        p.stdin.close()
        p.wait(30)


def test_a_process_without_arraymp_publishes_nothing():
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        with pytest.raises(LookupError, match="has not imported arraymp"):
            _stats.read(p.pid)
    finally:
        p.stdin.close()
        p.wait(30)


def test_a_stdlib_channel_under_file_descriptor_warns_once_and_delivers():
    q = multiprocessing.get_context("fork").SimpleQueue()  # the stdlib's: it cannot carry a descriptor
    a = np.arange(BIG, dtype=np.float64)
    got = []
    reader = threading.Thread(target=lambda: got.extend([q.get(), q.get()]))  # (a pipe holds 64 KiB)
    reader.start()
    with mpr.stats() as s, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q.put(a)
        q.put(a)
        reader.join(60)
    assert len(got) == 2 and (got[0] == a).all() and (got[1] == a).all()
    stopped = [w for w in caught if w.category is mpr.SharingStoppedWarning]
    assert len(stopped) == 1, [str(w.message) for w in caught]
    text = str(stopped[0].message)
    assert f"an array of 1.0 MiB ({8 * BIG:,} bytes)" in text and "does not own" in text
    assert "arraymp's Queue" in text and "'file_system'" in text
    assert stopped[0].filename == __file__  # the put that sent it
    assert (s.fallbacks, s.fallback_bytes, s.arrays_inline) == (2, 2 * 8 * BIG, 2)
    assert "! 2 array(s), 2.0 MiB, went pickled" in str(s) and f"{__file__}:" in str(s)
    q.close()


def test_a_filter_that_makes_it_an_error_fails_the_send():
    q = multiprocessing.get_context("fork").SimpleQueue()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpr.SharingStoppedWarning)
        with pytest.raises(mpr.SharingStoppedWarning):
            q.put(np.ones(BIG))
    assert q.empty()
    q.close()


FULL = """
import multiprocessing, os, warnings
import numpy as np
import mp_reductions as m
m.init_reductions()
m.set_sharing_strategy("file_system")
a = np.arange(2 << 20, dtype=np.float64)  # 16 MiB, on an 8 MiB tmpfs
q = m.Queue()
r, w = m.Pipe()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        q.put(a)
        assert (q.get(timeout=60) == a).all()
    w.send([a, np.ones(3)])
    got = r.recv()
    assert (got[0] == a).all() and (got[1] == 1).all()
stopped = [x for x in caught if x.category is m.SharingStoppedWarning]
print(len(stopped), len(caught))
print(stopped[0].message)
print(os.path.basename(stopped[0].filename), stopped[0].lineno)
s = m.stats()
print(s.fallbacks, s.fallback_bytes, s.arrays_copied, s.arrays_inline)

def child():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q.put(a)
        q.put(a)
    os._exit(10 + len([x for x in caught if x.category is m.SharingStoppedWarning]))

p = multiprocessing.get_context("fork").Process(target=child)
p.start()
assert (q.get(timeout=60) == a).all() and (q.get(timeout=60) == a).all()
p.join(60)
print("child", p.exitcode - 10)
with warnings.catch_warnings():
    warnings.simplefilter("error", m.SharingStoppedWarning)
    m._stats._warned = False
    try:
        q.put(a)
    except m.SharingStoppedWarning:
        print("raised", q.empty())
"""


def test_a_full_shm_dir_warns_once_per_process_and_the_array_arrives(mount_tmpfs):
    d = str(mount_tmpfs("8m"))
    r = subprocess.run([sys.executable, "-c", FULL], env={**os.environ, "ARRAYMP_SHM_DIR": d}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "1 1", r.stdout  # once, for three arrays
    text = lines[1]
    assert text.startswith("arraymp: sharing stopped: an array of 16.0 MiB (16,777,216 bytes) travelled inside "
                           "the pickle, not by shared memory"), text
    assert f"no space in {d}/arraymp_" in text and "free" in text  # what happened
    assert "ARRAYMP_SHM_DIR" in text and "'file_descriptor' sharing strategy" in text  # the remedy
    assert "once per process" in text and "arraymp.stats()" in text
    assert lines[2] == "<string> 13", lines[2]  # the user's put, not our code
    assert lines[3] == f"3 {3 * (16 << 20)} 0 4"  # fallbacks, their bytes, none copied, 3 big and 1 small inline
    assert lines[4] == "child 1"  # a fork child is a process of its own: it says so once too
    assert lines[5] == "raised True"  # an error filter fails the put, and nothing was sent
    assert not os.listdir(d) or os.listdir(d) == [f".arraymp-{os.getuid()}"]


def test_a_pool_counts_its_tasks_and_results():
    with mpr.Pool(2) as pool, mpr.stats() as s:
        out = pool.map(np.sum, [np.full(SMALL, i) for i in range(40)])
    assert out == [SMALL * i for i in range(40)]
    assert s.arrays_inline == 40 and s.bytes_inline == 40 * 8 * SMALL  # every task's array, once, in batches
    assert s.messages_sent >= 1 and s.messages_received >= 1


def test_a_fork_child_does_not_write_its_parents_page():
    ctx = multiprocessing.get_context("fork")
    before = counters(mpr.stats().as_dict())

    def sends():
        q = mpr.SimpleQueue()
        for _ in range(5):
            q.put(np.ones(SMALL))
            q.get()
        os._exit(0 if mpr.stats().messages_sent == 5 else 1)

    p = ctx.Process(target=sends)
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert counters(mpr.stats().as_dict()) == before


def test_reading_installs_no_signal_handler():
    # a reader never signals the process it reads: the page is there already (Note [stats])
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_worker_deaths_and_task_timeouts_are_counted(method):
    import _pool_targets as T

    with mpr.Pool(2, context=multiprocessing.get_context(method)) as pool, mpr.stats() as s:
        with pytest.raises(mpr.WorkerLostError):
            pool.apply(T.die)
        with pytest.raises(mpr.TaskTimeoutError):
            pool.apply(T.nap, (30,), timeout=0.3)
        assert pool.apply(T.square, (3,)) == 9
    pool.join()
    assert (s.worker_deaths, s.task_timeouts) == (1, 1)


def test_hints_fit_what_was_copied():
    """Copied numpy arrays are told to be made shared; copied Arrow buffers, which cannot be, are told the slice
    that carries its parent (Note [copy hints]; issue 44: Arrow users were told to use empty_shared)."""
    pa = pytest.importorskip("pyarrow")
    q = mpr.SimpleQueue()
    table = pa.table({"x": np.arange(2 << 20, dtype="f8")})  # 16 MiB
    with mpr.stats() as s:
        for i in range(5):
            q.put(table.slice(i, 10))  # 10 rows, each with the whole 16 MiB buffer
            assert q.get().num_rows == 10
    assert (s.buffers_copied, s.buffer_bytes_copied) == (5, 5 * table.nbytes)
    assert (s.arrays_copied, s.bytes_copied) == (5, 5 * table.nbytes)  # buffers are of arrays_copied
    (hint,) = s.hints()
    assert "Arrow buffers" in hint and "Table.slice" in hint and "empty_shared" not in hint, hint
    assert "of which Arrow (pyarrow) buffers" in str(s)
    with mpr.stats() as s:
        part = table.slice(0, 10)
        q.put(part.take(np.arange(part.num_rows)))  # the hint's remedy: its rows alone, inline
        assert q.get().num_rows == 10
    assert (s.buffers_copied, s.bytes_copied, s.hints()) == (0, 0, [])
    with mpr.stats() as s:
        for _ in range(5):
            q.put(np.ones(2 << 20))
            q.get()
    assert (s.arrays_copied, s.buffers_copied) == (5, 0)
    (hint,) = s.hints()
    assert "empty_shared" in hint and "Arrow" not in hint, hint
    q.close()
