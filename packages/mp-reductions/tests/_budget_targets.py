"""Child side of the budget tests (importable under spawn): producers, and consumers under a descriptor limit.

Every array carries its sequence number (it is filled with it), so a block
handed out twice, or a copy where a view was due, shows as a wrong value.
"""

import os
import resource
import traceback

import mp_reductions as mpr
import numpy as np

SMALL = 16  # int64 elements: 128 bytes, carved out of an arena
OWN = 8200  # int64 elements: 65,600 bytes, over the arena's item limit: a segment of its own
OWN_EVERY = 10  # a mixed stream: every 10th array has a segment of its own


def start(strategy, nofile=None):
    mpr.init_reductions()
    mpr.set_sharing_strategy(strategy)
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def can_reopen_mappings() -> bool:
    """Whether this process may open /proc/self/map_files entries (CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN).

    Where it may not, a memfd segment whose descriptor was closed cannot be re-opened: sending it must raise
    (issue 12: never a silent copy); where it may, sending it must share."""
    with open("/proc/self/maps") as f:
        first = f.readline().split()[0]  # the executable's first mapping, as map_files names it
    try:
        os.close(os.open(f"/proc/self/map_files/{first}", os.O_RDONLY | os.O_CLOEXEC))
    except (PermissionError, FileNotFoundError):  # (a normal user's lookup finds no entry at all)
        return False
    return True


def make(i, mixed, elements=SMALL):
    a = mpr.empty_shared(OWN if mixed and i % OWN_EVERY == 0 else elements, np.int64)
    a.fill(i)
    return a


def wrong(arrays):
    """The sequence numbers of the arrays that do not read their own number."""
    return [i for i, a in enumerate(arrays) if not (a == i).all()]


def produce(ctl, q, strategy, n, mixed, keep):
    """Make n shared arrays and put each, keeping them or dropping each once sent, until told to stop;
    report, then exit when told."""
    start(strategy)
    kept = []
    for i in range(n):
        if ctl.poll():
            break  # the parent stops us: a budget failed
        a = make(i, mixed)
        q.put(a)
        if keep:
            kept.append(a)
        del a
    q.close()
    q.join_thread()
    ctl.send(("sent", wrong(kept)))
    ctl.recv()  # the parent measures this process's memory before it exits


def create_live(ctl, strategy, n, nofile, elements, mixed):
    """Under RLIMIT_NOFILE ``nofile``: n live shared arrays made here; report how many were made, or the error."""
    live = []
    try:
        start(strategy, nofile)
        for i in range(n):
            live.append(make(i, mixed, elements))
        ctl.send(("ok", len(live), wrong(live)))
    except Exception:
        ctl.send(("error", len(live), traceback.format_exc()))


def receive_live(ctl, q, strategy, n, nofile):
    """Under RLIMIT_NOFILE ``nofile``: keep n received arrays, then re-send the oldest to this process.

    Reports the wrong ones, whether the one that came back shares memory with
    the one kept, and whether a write through it is seen by the one kept; or
    that sending it again raised OSError, and whether this process could have
    re-opened its segment.
    """
    got = []
    try:
        start(strategy, nofile)
        for _ in range(n):
            got.append(q.get(timeout=60))
        bad = wrong(got)
        again = mpr.Queue()
        try:
            again.put(got[0])
            back = again.get(timeout=60)
        except OSError as exc:
            ctl.send(("raised", len(got), bad, str(exc), can_reopen_mappings()))
            return
        finally:
            again.close()
            again.join_thread()
        back.fill(-1)
        ctl.send(("ok", len(got), bad, bool(np.shares_memory(back, got[0])), bool((got[0] == -1).all())))
    except Exception:
        ctl.send(("error", len(got), traceback.format_exc()))
