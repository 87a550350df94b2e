"""Per-task and per-message cost: arraymp against the stdlib, in one run, under each start method.

Tasks that do nothing (``abs(i)``, ``pow(i, 2)``) on 2 workers, so what is timed is the pool's own work:

  imap, imap_unordered   list(pool.imap(abs, range(N)))             one task per item
  apply_async            N x apply_async(abs, (i,)), then every get()
  map, starmap           pool.map(abs, range(N)), pool.starmap(pow, ...)   default chunks
  map x20                pool.map(abs, range(20 N))
  submit                 N x ProcessPoolExecutor.submit(abs, i), then every result()

and messages between two processes:

  ping-pong Queue        a 16-element array there and back over two Queues, against a raw
                         Connection.send_bytes ping-pong of the same bytes (the floor)
  handles / 4 KiB        a stream of shared arrays' handles through a Queue, against the stdlib's
                         Queue pickling a 4 KiB array (messages per second)

Both pools live side by side and take turns of 50 ms within each repeat (both see the same load of the
machine, and each pool's runs follow its own); medians of the repeats are printed with their ratio (< 1:
arraymp takes less time).
"""

from __future__ import annotations

import functools
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor as StdlibExecutor

import numpy as np

METHODS = ("fork", "spawn", "forkserver")
BLOCK = 0.25  # seconds each pool runs a workload in one repeat at least (_timed)
TURN = 0.05  # seconds a pool runs a workload back to back before the other's turn (_timed)

POOL = {
    "imap": lambda pool, n: list(pool.imap(abs, range(n))),
    "imap_unordered": lambda pool, n: list(pool.imap_unordered(abs, range(n))),
    "apply_async": lambda pool, n: [r.get() for r in [pool.apply_async(abs, (i,)) for i in range(n)]],
    "map": lambda pool, n: pool.map(abs, range(n)),
    "starmap": lambda pool, n: pool.starmap(pow, [(i, 2) for i in range(n)]),
    "map x20": lambda pool, n: pool.map(abs, range(20 * n)),
}


def _submit(executor, n: int):
    return [f.result() for f in [executor.submit(abs, i) for i in range(n)]]


def _timed(run, a, b, n: int) -> tuple[float, float]:
    """Seconds one ``run(x, n)`` takes with ``a`` and with ``b``: the means of runs in turns of ``TURN`` seconds (at
    least one run) alternating between the two until each has run ``BLOCK`` seconds (a map of 5,000 takes ~3 ms: ~80
    runs, so that a burst of load on a 2-core machine moves the mean of a cell less). Both see the same load of the
    machine, and a pool's runs follow its own, as in a program that calls one pool again and again: what a pool still
    does after a call returns (the stdlib's worker handler wakes when its cache empties) delays its own next call, not
    the other pool's (run by run, the pool that ran second paid for the first one's wake)."""
    total, runs = [0.0, 0.0], [0, 0]
    while min(total) < BLOCK:
        for k, x in enumerate((a, b)):
            t0 = now = time.perf_counter()
            while now - t0 < TURN:  # (at least one run: now is t0 at first)
                run(x, n)
                runs[k] += 1
                now = time.perf_counter()
            total[k] += now - t0
    return total[0] / runs[0], total[1] / runs[1]


def tasks(method: str, n: int, repeat: int, workers: int) -> dict[str, tuple[float, float]]:
    """{workload: (stdlib seconds, arraymp seconds)}, medians of ``repeat`` alternating runs."""
    import arraymp

    std, ours = multiprocessing.get_context(method), arraymp.get_context(method)
    times: dict[str, tuple[list, list]] = {}
    with std.Pool(workers) as a, ours.Pool(workers) as b:
        for name, run in POOL.items():
            run(a, n), run(b, n)  # warm-up: workers started, imports done
            for _ in range(repeat):
                pair = times.setdefault(name, ([], []))
                for side, seconds in zip(pair, _timed(run, a, b, n), strict=True):
                    side.append(seconds)
    with StdlibExecutor(workers, mp_context=std) as a, arraymp.ProcessPoolExecutor(workers, mp_context=ours) as b:
        _submit(a, n), _submit(b, n)
        for _ in range(repeat):
            pair = times.setdefault("submit", ([], []))
            for side, seconds in zip(pair, _timed(_submit, a, b, n), strict=True):
                side.append(seconds)
    return {k: (statistics.median(s), statistics.median(o)) for k, (s, o) in times.items()}


def _echo(kind: str, inbox, outbox, n: int) -> None:
    """The other end: once started, one message to say so; then ``n`` messages back (``pingpong``), or taken and
    counted (``stream``), then a time."""
    if kind == "bytes":
        outbox.send_bytes(b"")
        for _ in range(n):
            outbox.send_bytes(inbox.recv_bytes())
        return
    outbox.put(None)
    for _ in range(n):
        a = inbox.get()
        if kind == "pingpong":
            outbox.put(a)
    if kind == "stream":
        outbox.put(time.perf_counter())


def _partner(ctx, kind, inbox, outbox, n, mine=None):
    """The other end, started (its start-up is never timed); ``mine``: this end of a raw Connection."""
    p = ctx.Process(target=_echo, args=(kind, inbox, outbox, n))
    p.start()
    mine.recv_bytes() if kind == "bytes" else outbox.get()
    return p


def _round_trip(send, receive, n: int) -> float:
    """Seconds per round trip: ``n`` times ``send()`` then ``receive()`` (the partner echoes)."""
    t0 = time.perf_counter()
    for _ in range(n):
        send()
        receive()
    return (time.perf_counter() - t0) / n


def messages(method: str, n: int, repeat: int) -> dict[str, tuple[float, float]]:
    """{row: (floor, arraymp)}: ping-pong seconds per round trip, and stream messages per second."""
    import arraymp

    from ._benchkit import As

    std, ours = multiprocessing.get_context(method), arraymp.get_context(method)
    a16, a4k, shared = np.arange(16.0), np.ones(512), arraymp.share_memory(np.ones(512))
    out: dict[str, tuple[list, list]] = {}
    for _ in range(repeat):
        # the floor: the same 128 bytes over a raw Connection
        left, right = std.Pipe()
        p = _partner(std, "bytes", right, right, n, left)
        data = a16.tobytes()
        floor = _round_trip(functools.partial(left.send_bytes, data), left.recv_bytes, n)
        p.join()
        q1, q2 = ours.Queue(), ours.Queue()
        p = _partner(ours, "pingpong", q1, q2, n)
        trip = _round_trip(functools.partial(q1.put, a16), q2.get, n)
        p.join()
        pair = out.setdefault("ping-pong Queue (us)", ([], []))
        pair[0].append(floor * 1e6)
        pair[1].append(trip * 1e6)

        rates = []
        for ctx, payload in ((std, a4k), (ours, shared)):
            with As("stdlib" if ctx is std else "arraymp"):
                q, done = ctx.Queue(), ctx.Queue()
                p = _partner(ctx, "stream", q, done, n)
                t0 = time.perf_counter()
                for _ in range(n):
                    q.put(payload)
                rates.append(n / (done.get() - t0))
                p.join()
        pair = out.setdefault("handles/s vs 4 KiB pickled/s", ([], []))
        pair[0].append(rates[0])
        pair[1].append(rates[1])
    return {k: (statistics.median(s), statistics.median(o)) for k, (s, o) in out.items()}


def main(n: int = 5000, repeat: int = 5, workers: int = 2, methods=METHODS) -> int:
    print(f"per-task cost: {workers} workers, N = {n} tiny tasks, median of {max(repeat, 5)}; ratio = arraymp / stdlib "
          "(time: < 1 is faster)")
    default = multiprocessing.get_all_start_methods()[0]  # (the stdlib lists its default first)
    print(f"this Python's default start method: {default}")
    print("| workload | " + " | ".join(f"{m}: stdlib ms | arraymp ms | ratio" for m in methods) + " |")
    print("|---|" + "---|---|---|" * len(methods))
    rows: dict[str, list[str]] = {}
    msgs: dict[str, list[str]] = {}
    for method in methods:
        for name, (s, o) in tasks(method, n, max(repeat, 5), workers).items():
            rows.setdefault(name, []).append(f"{s * 1e3:.2f} | {o * 1e3:.2f} | {o / s:.2f}")
        for name, (s, o) in messages(method, 2000, max(repeat, 5)).items():
            msgs.setdefault(name, []).append(f"{s:.0f} | {o:.0f} | {o / s:.2f}")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nmessages: ping-pong of a 16-element array, arraymp Queue against a raw Connection (us per round trip: "
          "target ratio <= 2); a shared array's handle through arraymp's Queue against a 4 KiB array through the "
          "stdlib's (messages/s: target ratio >= 1)")
    print("| row | " + " | ".join(f"{m}: floor | arraymp | ratio" for m in methods) + " |")
    print("|---|" + "---|---|---|" * len(methods))
    for name, cells in msgs.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0
