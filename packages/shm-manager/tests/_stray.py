"""A stray client: a process of the same user that connects to a group's daemon and sends it raw frames it has no
business sending (tests/test_stray_frames.py), then exits.

``python _stray.py <shm dir> <group> <json>``: the json is a list of connections, each a list of ``[op, payload]``
frames sent on it, in order. In payloads, ``{me}`` is this process's pid, ``{start}`` its start time, ``{child}``
``<pid>:<start>`` of a fork child of this process that lives until it exits, ``{dead}`` that of one that has
exited and been reaped, ``{claim}`` a frame ``C <start>:<name>`` sent by that living child on its own connection
(the name follows it: ``{claim}<name>``). The op ``+`` sends nothing: this process attaches the segment named and adds
one count to its header (a count it really holds)."""

import json
import os
import struct
import sys
import time

import shm_core
import shm_manager
from shm_manager import _client, _paths


def frame(op: str, payload: str) -> bytes:
    data = op.encode() + payload.encode()
    return struct.pack("<I", len(data)) + data


def connect(d: str, group: str):
    rdir = shm_manager.member(d, group)[1]
    sock = _client._try_connect(rdir, group)
    assert sock is not None, "no daemon to reach"
    return sock


def main() -> None:
    d, group, conns = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    shm_manager.join_group(group)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # lives until this process exits, its connection open; sends a claim when asked
        os.close(w)
        sock = None
        while True:
            name = os.read(r, 4096).decode()
            if not name:
                os._exit(0)
            sock = sock or connect(d, group)
            sock.sendall(frame("C", f"{_paths.start_time(os.getpid())}:{name}"))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    dead_start = _paths.start_time(dead)
    os.waitpid(dead, 0)
    fill = {"{me}": str(os.getpid()), "{start}": str(_paths.start_time(os.getpid())),
            "{child}": f"{child}:{_paths.start_time(child)}", "{dead}": f"{dead}:{dead_start}"}
    socks = [connect(d, group) for _ in conns]
    held = []
    for sock, frames in zip(socks, conns, strict=True):
        for op, payload in frames:
            if op == "+":
                held.append(shm_core.attach(payload, d))
                held[-1].incref()
                continue
            if payload.startswith("{claim}"):
                os.write(w, payload[len("{claim}"):].encode())
                time.sleep(0.3)
                continue
            for key, value in fill.items():
                payload = payload.replace(key, value)
            sock.sendall(frame(op, payload))
    time.sleep(0.2)
    os.close(w)
    os.waitpid(child, 0)
    time.sleep(0.2)
    for sock in socks:
        sock.close()


if __name__ == "__main__":
    main()
