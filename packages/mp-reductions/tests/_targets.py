"""Functions run in child processes (importable under spawn and forkserver)."""

import os
import pickle
import time

import mp_reductions as mpr
import numpy as np
import shm_core
import shm_manager
from _views import segment_under, via_shared_memory


def fill_from_queue(q, done, value):
    mpr.init_reductions()
    a, b = q.get(timeout=30), q.get(timeout=30)
    a.fill(value)
    b.fill(value)
    del a, b
    done.put("ok")


def send_twice(q, strategy):
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    x = mpr.empty_shared((100,), np.int32)
    x[:] = np.arange(100)
    q.put(x)
    q.put(x)
    q.close()
    q.join_thread()


def put_many_and_exit(q, n, strategy, size):
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    for i in range(n):
        a = np.full(size, i, np.int64)
        q.put(a)
    # returns at once: the messages are in the socket with their descriptors


def hogwild(params, index, steps, lock):
    for _ in range(steps):
        with lock:
            params["w"] += 1
            params["b"][index] += 1


def write_inherited(x):
    x[:] = 42


def report_and_write(a, view, d, out):
    """Process arguments: the sums past a[0] of an array, a view of it (a[1:]) and the array in a dict; then write
    a[0] (seen by the parent when ``a`` is shared)."""
    out.put((float(a[1:].sum()), float(view.sum()), float(d["a"][1:].sum())))
    a[0] = -1


def send_on_stdlib_channel(chan, kind, strategy, shared, n):
    """Send one array on a stdlib Pipe or Queue and return (the Queue's feeder flushes first)."""
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    a = mpr.empty_shared(n) if shared else np.empty(n)
    a[:] = np.arange(n)
    if kind == "Pipe":
        chan.send(a)
    else:
        chan.put(a)


def roundtrip_pipe(conn):
    mpr.init_reductions()
    while True:
        obj = conn.recv()
        if obj is None:
            break
        conn.send(obj)
    conn.close()


def send_shared_many(q, n, strategy):
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    for i in range(n):
        a = mpr.empty_shared((16,), np.float64)
        a[:] = i
        q.put(a)
    q.put(None)
    q.close()
    q.join_thread()


def get_and_report(q, out, hold=0.0):
    mpr.init_reductions()
    x = q.get(timeout=30)
    out.put((os.getpid(), float(x.sum()), via_shared_memory(x)))  # (a copy is the receiver's own: not is_shared)
    time.sleep(hold)  # still holding x


def signal_and_sleep(ready):
    ready.set()
    time.sleep(60)


def _limit_free_descriptors(free):
    """Lower this process's soft RLIMIT_NOFILE so that ``free`` descriptor numbers below it are unused (one more:
    the one listing /proc/self/fd took)."""
    import resource

    used = {int(n) for n in os.listdir("/proc/self/fd")}
    limit = 0
    while free or limit in used:
        free -= limit not in used
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return limit


def _receive(kind, chan):
    if kind == "Queue":
        return chan.get(timeout=30)
    conn = chan if kind == "Pipe" else chan._reader
    if not conn.poll(30):
        raise TimeoutError("nothing to receive within 30 s")
    return conn.recv()


def receive_short_of_descriptors(kind, chan, out, again=True):
    """Receive a message of several segments with 2 descriptors free, then (``again``) with the limit restored."""
    import resource

    mpr.init_reductions()
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = _limit_free_descriptors(1)
    try:
        _receive(kind, chan)
    except OSError as e:
        error = (e.errno, str(e), low)
    except Exception as e:  # the truncation went unnoticed
        error = (None, repr(e), low)
    else:
        error = (None, "no error", low)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)
    try:
        arrays = _receive(kind, chan) if again else []
    except Exception as e:
        out.put((error, repr(e)))
    else:
        out.put((error, [(float(a.min()), float(a.max()), bool(mpr.is_shared(a))) for a in arrays]))


def wait_under_default_timeout(q, sq, inbox, out):
    """With socket.setdefaulttimeout(0.5): receive a Pipe end, then wait on it and on the inherited queues."""
    import socket

    socket.setdefaulttimeout(0.5)
    mpr.init_reductions()
    try:
        conn = inbox.get(timeout=60)  # rebuilt here, under the default timeout
        out.put("waiting")
        got = [conn.recv(), q.get(), sq.get()]  # each arrives 1 s after the one before
        out.put([float(a.sum()) for a in got])
        conn.close()
    except Exception as e:
        out.put(repr(e))


def load_twice(data):
    """Unpickle the same message twice: a replay (or a forged copy) of a named handle. Between the two, wait until
    the daemon has applied this process's hold of the first, so that it books the hold before the replay takes the
    in-flight count off the header: the order in which a replay unlinks the segment under its sender (shm_manager
    Note [Booked counts]; in the other order the daemon books nothing, and the count stays right)."""
    mpr.init_reductions()
    first = pickle.loads(data)
    _daemon_got_here(segment_under(first).dir)
    second = pickle.loads(data)
    assert first[0] == second[0]


def _daemon_got_here(dir: str) -> None:
    """Wait until the daemon has applied every frame this process sent it for ``dir``: it applies a connection's
    frames in order, and unlinks a marker segment of ours, held and then released on that connection, only when it
    gets to the release."""
    mark = shm_core.create(4096, name=shm_manager.new_name(), dir=dir)
    shm_manager.register(mark.name, dir)
    shm_manager.hold(mark.name, dir)
    mark.incref()
    assert shm_manager.release(mark.name, dir)
    deadline = time.monotonic() + 30
    while os.path.exists(mark.path):
        assert time.monotonic() < deadline, "the daemon never got to this process's frames"
        time.sleep(0.001)
    mark.close()


def load_and_report(data, out):
    mpr.init_reductions()
    try:
        pickle.loads(data)
        out.put("loaded")
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def load_counts_kept(data, q):
    """Unpickle ``data`` (made under keep_counts) as mp-dask's workers do, report its sum, exit holding it."""
    with mpr.counts_kept():
        a = pickle.loads(data)
    q.put(float(a.sum()))
