import os
import signal
import subprocess
import sys

import pytest
import shm_cuda
from _helpers import consumer, wait_for
from shm_cuda import ProducerGoneError, Registry, RegistryFullError, StaleHandleError


@pytest.fixture(params=["memfd", "named"])
def registry(request):
    freed = []
    reg = Registry(nslots=4, nrows=4, named=request.param == "named", on_free=freed.append)
    reg.freed = freed
    yield reg
    reg.close()


def run(reg, slot, gen, action):
    p = consumer(reg.ref, slot, gen, action)
    assert p.stdout.readline().strip() == "done"
    return p


def test_take_release_reuse(registry):
    s, gen = registry.take()
    assert registry.collect() == []  # one message in flight
    run(registry, s, gen, "hold_release").wait(10)
    assert registry.collect() == [s] and registry.freed == [s]
    s2, gen2 = registry.take()  # slots are reused with a new generation
    assert s2 == s and gen2 == gen + 1
    with pytest.raises(StaleHandleError, match="generation"):
        shm_cuda.consumer_for(registry.ref).receive(s, gen, hold=True)


def test_held_until_every_consumer_released(registry):
    s, gen = registry.take()
    registry.send(s)
    registry.send(s)  # three messages
    holders = [run(registry, s, gen, "hold") for _ in range(2)]
    assert registry.collect() == []
    mine = shm_cuda.consumer_for(registry.ref)
    mine.receive(s, gen, hold=True)
    mine.release(s)
    assert registry.collect() == []  # two holders live
    for p in holders:
        p.kill()
        p.wait()
    assert registry.collect() == [s]


def test_killed_holder_is_reaped_within_2s(registry):
    s, gen = registry.take()
    p = run(registry, s, gen, "hold")
    assert registry.collect() == []
    os.kill(p.pid, signal.SIGKILL)  # not reaped yet: a zombie also counts as gone
    assert wait_for(lambda: registry.collect() == [s], timeout=2.0)
    p.wait()
    # the row was given back: four new consumers fit in the four rows
    s2, gen2 = registry.take()
    for _ in range(3):
        registry.send(s2)
    procs = [run(registry, s2, gen2, "hold") for _ in range(4)]
    for q in procs:
        q.kill()
        q.wait()
    assert registry.collect() == [s2]


def test_forward_keeps_slot_until_received(registry):
    s, gen = registry.take()
    me = shm_cuda.consumer_for(registry.ref)
    me.receive(s, gen, hold=True)
    me.forward(s, gen)  # a message to a third process
    me.release(s)
    assert registry.collect() == []
    run(registry, s, gen, "hold_release").wait(10)
    assert registry.collect() == [s]


def test_full_registry(registry):
    slots = [registry.take()[0] for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    registry.full_timeout = 0.1
    with pytest.raises(RegistryFullError, match="ARRAYMP_CUDA_SLOTS"):
        registry.take()


PRODUCER = r"""
import pickle, sys, shm_cuda
reg = shm_cuda.Registry(nslots=2, nrows=2)
s, gen = reg.take()
sys.stdout.write(pickle.dumps((reg.ref, s, gen)).hex() + "\n")
sys.stdout.flush()
sys.stdin.readline()
"""


def test_producer_death_is_a_clear_error():
    import pickle

    prod = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ref, s, gen = pickle.loads(bytes.fromhex(prod.stdout.readline().strip()))
    c = shm_cuda.consumer_for(ref)
    c.receive(s, gen, hold=True)
    watcher = consumer(ref, s, gen, "check_producer")
    assert watcher.stdout.readline().strip() == "waiting"
    prod.kill()
    prod.wait()
    with pytest.raises(ProducerGoneError, match=f"pid {ref.pid}.*has exited"):
        c.receive(s, gen, hold=True)
    with pytest.raises(ProducerGoneError):
        c.forward(s, gen)
    c.release(s)  # never raises: releasing into a dead producer's registry is harmless
    watcher.stdin.write("\n")
    watcher.stdin.flush()
    assert watcher.stdout.readline().startswith("gone: the process that exported")
    watcher.wait(10)
    # a new process cannot even attach: the memfd went with the producer
    with pytest.raises(ProducerGoneError, match="exited"):
        shm_cuda.Consumer(ref)
