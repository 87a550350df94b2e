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
