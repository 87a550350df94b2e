import gc

from shm_cuda import ImportCache


class FakeCuda:
    """Stands in for ipcOpenMemHandle / ipcCloseMemHandle: hands out addresses, records closes."""

    def __init__(self):
        self.open_now: dict[int, object] = {}
        self.next = 0x1000

    def opener(self, key):
        assert key not in self.open_now.values(), "a handle was opened twice in one process"
        self.next += 0x1000
        self.open_now[self.next] = key
        return self.next

    def closer(self, ptr):
        del self.open_now[ptr]


class FakeArray:
    def __init__(self, mapping):
        self.mapping = mapping


def test_one_open_per_key_and_close_with_last_array():
    cuda = FakeCuda()
    cache = ImportCache(cuda.opener, cuda.closer)
    m, opened = cache.get(("dev", b"h1"), 100)
    a = FakeArray(m)
    b = FakeArray(cache.get(("dev", b"h1"), 100)[0])
    assert opened and b.mapping is a.mapping and cache.opens == 1
    c = FakeArray(cache.get(("dev", b"h2"), 100)[0])
    assert cache.opens == 2 and len(cache) == 2
    del m
    del a
    gc.collect()
    assert cache.closes == 0 and len(cuda.open_now) == 2
    del b
    gc.collect()
    assert cache.closes == 1 and list(cuda.open_now.values()) == [("dev", b"h2")]
    # reopening after close opens again
    d = FakeArray(cache.get(("dev", b"h1"), 100)[0])
    assert cache.opens == 3 and d.mapping.ptr in cuda.open_now
    del c, d
    gc.collect()
    assert cuda.open_now == {} and cache.closes == 3 and len(cache) == 0


def test_close_callbacks_run_once():
    cuda = FakeCuda()
    cache = ImportCache(cuda.opener, cuda.closer)
    released = []
    m, _ = cache.get("k", 1)
    m.on_close.append(lambda: released.append("slot 3"))
    m.holds.add(3)
    again, opened = cache.get("k", 1)
    assert again is m and not opened
    del m, again
    gc.collect()
    assert released == ["slot 3"]


def test_opener_failure_leaves_nothing():
    def bad(key):
        raise OSError("cannot open")

    cache = ImportCache(bad, lambda p: None)
    try:
        cache.get("k", 1)
    except OSError:
        pass
    assert len(cache) == 0 and cache.opens == 0
