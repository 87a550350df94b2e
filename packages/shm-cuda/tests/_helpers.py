import os
import pickle
import subprocess
import sys
import time

CHILD = r"""
import pickle, sys, time
import shm_cuda
ref, slot, gen, action = pickle.loads(bytes.fromhex(sys.argv[1]))
c = shm_cuda.consumer_for(ref)
if action == "hold":
    c.receive(slot, gen, hold=True)
elif action == "hold_release":
    c.receive(slot, gen, hold=True)
    c.release(slot)
elif action == "check_producer":
    print("waiting", flush=True)
    sys.stdin.readline()
    try:
        c.check_producer()
    except shm_cuda.ProducerGoneError as exc:
        print("gone:", exc, flush=True)
        sys.exit(0)
    print("alive", flush=True)
    sys.exit(0)
print("done", flush=True)
if action == "hold":
    time.sleep(60)
"""


def consumer(ref, slot, gen, action):
    arg = pickle.dumps((ref, slot, gen, action)).hex()
    return subprocess.Popen([sys.executable, "-c", CHILD, arg], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ""})


def wait_for(pred, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()
