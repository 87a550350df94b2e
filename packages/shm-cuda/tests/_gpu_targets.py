"""Process targets for the GPU tests (spawn imports this module by name)."""

import os
import signal
import time
from multiprocessing.reduction import ForkingPickler

import shm_cuda

shm_cuda.init_reductions(ForkingPickler.register)


def echo_sum(q_in, q_out):
    import cupy
    arr = q_in.get()
    q_out.put(float(cupy.asnumpy(arr.sum())))


def chain_stage(q_in, q_out, n):
    for _ in range(n):
        q_out.put(q_in.get())  # forwarded without a clone


def chain_sink(q_in, q_out, n):
    total = 0
    for _ in range(n):
        total += int(q_in.get().sum())
    q_out.put(total)


def stream_reader(q_in, q_out, n):
    import cupy
    q_out.put("ready")
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(n):
            arr = q_in.get()  # waits on the producer's event on this stream
            q_out.put(cupy.asnumpy(arr).tolist())


def event_waiter(q_in, q_out):
    import cupy
    handle = q_in.get()
    ev = cupy.cuda.runtime.ipcOpenEventHandle(handle)
    cupy.cuda.runtime.eventSynchronize(ev)
    q_out.put("synced")


def bytes_back(q_in, q_out, n):
    import cupy
    for _ in range(n):
        arr = q_in.get()
        q_out.put(cupy.asnumpy(arr).tobytes())


def hold_and_wait(q_in, q_out):
    arr = q_in.get()
    q_out.put(os.getpid())
    time.sleep(600)
    del arr


def suicide(q_in, q_out):
    arr = q_in.get()
    q_out.put(int(arr.sum()))
    os.kill(os.getpid(), signal.SIGKILL)


def to_device(q_in, q_out, dev):
    arr = q_in.get()
    q_out.put((arr.device.id, float(arr.sum())))
