"""What a normal user at default limits runs (issue 20, defect 3): a soft RLIMIT_NOFILE of 1024 under a hard one of
65,536 or more, no capability to re-open a mapping from /proc/self/map_files. As root these pass too; the nonroot
nox session runs them as an unprivileged user, where they failed (a consumer forwarded 256 of 1,000 arrays)."""

import os
import resource
import subprocess
import sys
import textwrap

import pytest

SOFT = 1024

SCRIPT = textwrap.dedent("""
    import multiprocessing, resource, sys
    import numpy as np
    import mp_reductions as mpr

    def produce(q, n, strategy):
        mpr.init_reductions()
        mpr.set_sharing_strategy(strategy)
        for i in range(n):
            q.put(np.full(1 << 14, i, np.float64))  # 128 KiB: a segment each
        q.close()
        q.join_thread()

    def check(q, n, out):
        mpr.init_reductions()
        got = [q.get(timeout=120) for _ in range(n)]
        out.put([i for i, a in enumerate(got) if not (a.shape == (1 << 14,) and (a == i).all())])

    def array(i):
        return np.full(1 << 14, i, np.float64)

    def first(a):
        return float(a[0])

    if __name__ == "__main__":
        strategy, n = sys.argv[1], int(sys.argv[2])
        mpr.init_reductions()
        mpr.set_sharing_strategy(strategy)
        ctx = multiprocessing.get_context("spawn")
        inbox, outbox, out = mpr.Queue(), mpr.Queue(), mpr.Queue()
        producer = ctx.Process(target=produce, args=(inbox, n, strategy))
        sink = ctx.Process(target=check, args=(outbox, n, out))
        producer.start()
        sink.start()
        held = [inbox.get(timeout=120) for _ in range(n)]  # every one alive here at once
        for a in held:
            outbox.put(a)  # forwarded as a handle: its descriptor, or its name
        assert out.get(timeout=300) == [], "wrong arrays forwarded"
        producer.join(60)
        sink.join(60)
        del held
        with mpr.Pool(2, context=ctx) as pool:  # results of a chunksize=1 map fed into a second map
            results = pool.map(array, range(300), chunksize=1)
            assert pool.map(first, results, chunksize=1) == [float(i) for i in range(300)]
        print("ok", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
""")


@pytest.mark.parametrize("n", [1000, 10_000])
def test_forwarding_live_received_arrays_at_the_default_soft_limit(strategy, tmp_path, n):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if os.geteuid() != 0 and hard != resource.RLIM_INFINITY and max(hard // 4, hard - 4096) < n + 600:
        pytest.skip(f"the hard RLIMIT_NOFILE here is {hard}: {n} live arrays need a budget of {n} descriptors "
                    "(_shared.fd_budget) where /proc/self/map_files cannot re-open them")
    script = tmp_path / "forward.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), strategy, str(n)], capture_output=True, text=True, timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard)))
    assert r.returncode == 0, r.stderr[-3000:]
    ok, raised = r.stdout.split()
    assert ok == "ok" and int(raised) > SOFT  # raised toward the hard limit at first use
