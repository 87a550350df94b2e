"""Functions run in child processes by _values_suite (importable under spawn and forkserver)."""

import numpy as np

N = 1 << 18  # float64 items: 2 MiB, past the inline threshold and the shared allocator's


def fresh(value):
    """A result the worker keeps no reference to: it moves to the caller with no copy."""
    return np.full(N, float(value))


def fresh_fortran(value):
    return np.asfortranarray(np.full((512, 512), float(value)))


KEPT = {}


def kept_fortran(value):
    """A result the worker keeps (in a global): it goes as a copy."""
    KEPT[value] = np.asfortranarray(np.arange(600 * 500, dtype=np.float64).reshape(600, 500) + value)
    return KEPT[value]


def add_in_place(a, n=100.0):
    a += n
    return float(a[0])


def layout(a):
    """What the receiver sees of ``a``'s memory order, and its bytes in that order."""
    return bool(a.flags.c_contiguous), bool(a.flags.f_contiguous), a.tobytes("A")[:64], a.ravel("K")[:8].tolist()


def identity(a):
    return a


def get_write_report(q, out):
    """Take an array, write into it, say what it holds now."""
    a = q.get(timeout=60)
    a += 100.0
    out.put(float(a[0]))


def forward(inq, outq, written, rewritten, out):
    """B of A -> B -> C: take an array, send it on, and once C wrote into its own, say what B's holds; then write
    into it, and let C say what C's holds."""
    a = inq.get(timeout=60)
    outq.put(a)
    assert written.wait(60)
    out.put(("B", float(a[0])))
    a += 1000.0
    rewritten.set()


def receive_and_write(inq, written, rewritten, out):
    """C of A -> B -> C."""
    c = inq.get(timeout=60)
    c += 100.0
    written.set()
    assert rewritten.wait(60)
    out.put(("C", float(c[0])))


def pipe_layout(conn):
    """Say what the arrays received alone and in a list look like."""
    conn.send(layout(conn.recv()))
    conn.send(layout(conn.recv()[0]))
    conn.close()


def fork_child_writes(a, out):
    """A fork child writes into what it inherited, and says what it sees."""
    a += 100.0
    out.put(float(a[0]))
