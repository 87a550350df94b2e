"""Child side of the recycling stress test."""

import random
import time

import mp_reductions as mpr


def hold_and_check(q, out, seed):
    """Receive arrays, keep some for a random while, check each is untouched until dropped."""
    mpr.init_reductions()
    rng = random.Random(seed)
    held, bad, count = [], 0, 0
    while True:
        a = q.get(timeout=60)
        if a is None:
            break
        count += 1
        held.append((a, int(a[0]), time.monotonic() + rng.uniform(0, 0.05)))
        now = time.monotonic()
        keep = []
        for arr, tag, until in held:
            if not (arr == tag).all():
                bad += 1
            if until > now and rng.random() < 0.9:
                keep.append((arr, tag, until))
        held = keep
    for arr, tag, _ in held:
        bad += int(not (arr == tag).all())
    out.put((count, bad))


def relay(q_in, q_out):
    """Forward every received array, dropping it at once (a pipeline stage)."""
    while True:
        a = q_in.get(timeout=60)
        q_out.put(a)
        if a is None:
            return
        del a


def check_sequence(q, out):
    """Slowly receive arrays tagged 0, 1, 2, ...: count those whose contents are not their tag."""
    bad = n = 0
    while (a := q.get(timeout=60)) is not None:
        time.sleep(0.0005)
        bad += int(not (a == n).all())
        n += 1
    out.put((n, bad))


def hold_messages(conn):
    """Unpickle the messages the parent sends, keep each array until told to drop it, report their sums."""
    import pickle

    mpr.init_reductions()
    held = {}
    while (cmd := conn.recv()) is not None:
        op, key, payload = cmd
        if op == "load":
            held[key] = pickle.loads(payload)
            conn.send(float(held[key].sum()))
        elif op == "drop":
            del held[key]
            conn.send(None)
        else:  # "sums": what every kept array reads now
            conn.send({k: float(a.sum()) for k, a in held.items()})
