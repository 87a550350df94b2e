"""Targets of test_payloads.py (importable by spawn and forkserver children)."""

import gc
import pickle

import mp_reductions as mpr
import numpy as np


class ZeroCopy(bytearray):
    """A user type that hands its bytes out of band (the pickle documentation's ZeroCopyByteArray)."""

    def __reduce_ex__(self, protocol):
        if protocol >= 5:
            return type(self)._rebuild, (pickle.PickleBuffer(self),), None
        return type(self)._rebuild, (bytearray(self),)

    @classmethod
    def _rebuild(cls, obj):
        with memoryview(obj) as m:
            return cls(m)


class Seen:
    """A user type that hands its bytes out of band (read-only or not), and says what its rebuild was given."""

    def __init__(self, data, readonly: bool, kind: str | None = None):
        self.data, self.readonly, self.kind = data, readonly, kind

    def __reduce_ex__(self, protocol):
        buf = bytes(self.data) if self.readonly else bytearray(self.data)
        return type(self)._rebuild, (pickle.PickleBuffer(buf), self.readonly)

    @classmethod
    def _rebuild(cls, buf, readonly):
        kind = type(buf).__name__
        if kind == "bytearray":
            buf.extend(b"")  # what code tested on small data calls
        elif kind == "bytes":
            hash(buf)
        return cls(bytes(buf), readonly, kind)


def echo(conn_in, conn_out) -> None:
    """Send back every object received until None."""
    mpr.init_reductions()
    while True:
        obj = conn_in.get() if hasattr(conn_in, "get") else conn_in.recv()
        if obj is None:
            return
        (conn_out.put if hasattr(conn_out, "put") else conn_out.send)(obj)
        del obj


def identity(obj):
    return obj


def send_tables(q, n: int, rows: int) -> None:
    """Send ``n`` Arrow tables of ``rows`` rows, table k holding k, k + 1, ...; then wait for None."""
    import pyarrow as pa

    mpr.init_reductions()
    for k in range(n):
        q.put(pa.table({"a": np.arange(k, k + rows, dtype=np.float64)}))
        gc.collect()
