"""Run as the first process of a pid namespace of its own (test_sent_to_reader.py), where it can choose the next pid
(/proc/sys/kernel/ns_last_pid): a reader done with a dead sender's pid is not done with the next process that has it
(_books.py Note [Reused pids]). Argument: the shm directory. Exits 0, or fails with the reason."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shm_manager  # noqa: E402
from conftest import wait_until  # noqa: E402
from shm_manager import _paths  # noqa: E402
from test_given_at_fork import made  # noqa: E402
from test_sent_to_reader import killed, released_and_gone, told_by_a_child  # noqa: E402


def tell_then_mark(seg, d, pid: int) -> tuple[int, int, str]:
    """A fork child of pid ``pid`` that tells the daemon of one count of ``seg`` sent to this process, then makes a
    segment of its own and gives it back (on the same connection, so its unlink says the daemon read the tell), then
    waits to be killed. Returns (its pid, its pipe, the mark's path)."""
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            assert shm_manager.send_to(os.getppid(), seg.name, d, seg.incref)
            mark = made(d)
            assert shm_manager.release(mark.name, d)
            shm_manager.flush()
            os.write(w, os.fsencode(mark.path))
        finally:
            os.close(w)
            os.read(r, 1)  # (never: this end stays open until it is killed)
            os._exit(0)
    os.close(w)
    return child, r, os.fsdecode(os.read(r, 4096))


def main(d: str) -> None:
    os.environ["ARRAYMP_SHM_DIR"] = d
    seg = made(d)
    pid, r = told_by_a_child(seg, d)  # the first process of that pid: its count never taken, its reader done
    killed(pid, r)
    shm_manager.done_with([pid])
    wait_until(lambda: seg.refcount == 1, 5, "the daemon to give back the count the dead sender told")
    said = _paths.now_ticks()  # (the daemon read the reader's word by then)
    wait_until(lambda: _paths.now_ticks() > said, 5, "the next clock tick")  # the next process starts in a later one
    again, r, mark = tell_then_mark(seg, d, pid)  # the next process of that pid
    if again != pid:
        sys.exit(f"SKIP: pid {pid} was taken before the fork (got {again})")
    assert mark, "the second sender failed before it told (see its traceback)"
    wait_until(lambda: not os.path.exists(mark), 5, "the daemon to read the second sender's frames")
    assert seg.refcount == 2, "the count a new process of a reused pid sent was given back as it told it"
    killed(again, r)
    shm_manager.done_with([again])  # now the reader is done with it: its count goes back
    wait_until(lambda: seg.refcount == 1, 5, "the daemon to give back the count the second sender told")
    released_and_gone(seg, d)


if __name__ == "__main__":
    main(sys.argv[1])
