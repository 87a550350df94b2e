"""A scripted arraymp process for the crash-matrix tests.

Reads one JSON command per line on stdin, answers one JSON line on stdout. It
simulates a process using the file_system strategy: group(), create segments
named by new_name(), incref + register them; "drop" decrefs and, at zero,
unlinks + unregisters. Children (multiprocessing, any start method) do the same
and can be made to die with their parent (PR_SET_PDEATHSIG, as mp-spawn does).
"""

import ctypes
import json
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import traceback

import shm_core
import shm_manager

HELD: dict = {}


def _die_with(main: int) -> None:
    """Die with the actor, as mp-spawn children do: PR_SET_PDEATHSIG, and a watchdog on the actor's
    pidfd for forkserver children (their parent is the fork server, which the children keep alive)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    pidfd = os.pidfd_open(main)

    def watch():
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def create(n: int, size: int, fill: int = 7) -> list:
    names = []
    for _ in range(n):
        name = shm_manager.new_name()
        seg = shm_core.create(size, name=name)
        seg.incref()
        memoryview(seg)[:size] = bytes([fill]) * size
        shm_manager.register(name)
        HELD[name] = seg
        names.append(name)
    return names


def drop(names) -> list:
    unlinked = []
    for name in names:
        seg = HELD.pop(name)
        if seg.decref() == 0:
            seg.unlink()
            shm_manager.unregister(name)
            unlinked.append(name)
        seg.close()
    return unlinked


def child_main(conn, main, n, size, pdeathsig):
    if pdeathsig:
        _die_with(main)
    names = create(n, size, fill=9)
    conn.send({"pid": os.getpid(), "group": shm_manager.group(), "names": names})
    conn.close()
    while True:
        time.sleep(3600)


CHILDREN = []


def handle(cmd: dict) -> dict:
    op = cmd["op"]
    if op == "ping":
        return {"pid": os.getpid()}
    if op == "group":
        return {"group": shm_manager.group(), "pid": os.getpid()}
    if op == "create":
        return {"names": create(cmd.get("n", 1), cmd.get("size", 4096))}
    if op == "attach":
        for name in cmd["names"]:
            seg = shm_core.attach(name)
            seg.incref()
            HELD[name] = seg
        return {"ok": True}
    if op == "work":  # read every held segment, write a new value, read it back
        for name, seg in HELD.items():
            mv = memoryview(seg)
            if mv[0] not in (7, 9, 11):
                raise AssertionError(f"{name}: unexpected data {mv[0]}")
            mv[0] = 11
            assert mv[0] == 11
            mv.release()
        return {"ok": True, "held": sorted(HELD)}
    if op == "drop":
        return {"unlinked": drop(cmd["names"])}
    if op == "spawn":
        ctx = multiprocessing.get_context(cmd["method"])
        out = []
        for _ in range(cmd.get("k", 1)):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=child_main, args=(w, os.getpid(), cmd.get("n", 1), cmd.get("size", 4096),
                                                     cmd.get("pdeathsig", True)), daemon=False)
            p.start()
            w.close()
            if not r.poll(60):
                raise TimeoutError("child did not report")
            out.append(r.recv())
            CHILDREN.append(p)
        return {"children": out}
    if op == "daemon_pid":
        return {"pid": shm_manager.daemon_pid()}
    if op == "exit":
        os._exit(0) if cmd.get("hard") else sys.exit(0)
    raise ValueError(f"unknown op {op}")


def main() -> None:
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except SystemExit:
            raise
        except BaseException:
            reply = {"error": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
