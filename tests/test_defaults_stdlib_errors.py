"""Issue 35, scenario 9: where the stdlib raises nothing, neither do we. Under a file-size limit (``ulimit -f``,
which memfds obey), a Queue put of a plain 8 MiB array travels (inline, its pickle spilled in pieces under the
limit: mp_reductions _pickling Note [spilled pickles]); making a shared array on purpose says which limit to raise."""

import resource
import subprocess
import sys

import pytest

METHODS = ["fork", "spawn", "forkserver"]
UNDER_FSIZE = """
import multiprocessing, resource, sys
import numpy as np
import arraymp as mp

def echo(q_in, q_out):
    q_out.put(q_in.get(timeout=60) * 2)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    a = np.arange(1 << 20, dtype=np.float64)  # 8 MiB, over the 1 MiB limit
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(q_in, q_out))
    p.start()
    q_in.put(a)
    q_in.put(b"x" * (3 << 20))
    assert (q_out.get(timeout=60) == a * 2).all()
    assert len(q_in.get(timeout=60)) == 3 << 20
    p.join(60)
    with ctx.Pool(2) as pool:
        assert all((r == 2 * a).all() for r in pool.starmap(np.multiply, [(a, 2)] * 4))
    try:
        mp.empty_shared(1 << 20)
    except OSError as e:
        print("refused:", e)
    print("ok", p.exitcode)
"""


@pytest.mark.parametrize("method", METHODS)
def test_a_queue_put_of_8_mib_under_a_1_mib_file_size_limit(method, tmp_path):
    script = tmp_path / "fsize.py"
    script.write_text(UNDER_FSIZE)
    r = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=180,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ok 0", r.stdout + r.stderr
    refused = r.stdout.splitlines()[0]
    assert "RLIMIT_FSIZE" in refused and "ulimit -f" in refused
