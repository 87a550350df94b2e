"""Functions run in child processes (importable under spawn and forkserver)."""

import os
import time

import mp_reductions as mpr
import numpy as np


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
    out.put((os.getpid(), float(x.sum()), bool(mpr.is_shared(x))))
    time.sleep(hold)  # still holding x


def signal_and_sleep(ready):
    ready.set()
    time.sleep(60)
