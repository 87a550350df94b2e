"""The rest of the stdlib API surface of the Dask Pool and executor, on one cluster."""

from __future__ import annotations

import concurrent.futures
import gc
import tempfile
import time

import mp_dask
import numpy as np
import pytest
from _targets import boom, f, g, nap
from conftest import CLUSTER, segments


@pytest.fixture(scope="module")
def ctx():
    with tempfile.TemporaryDirectory() as scratch, mp_dask.get_context(**CLUSTER, local_directory=scratch) as c:
        yield c


def test_pool_api(ctx):
    arrays = [np.full(1 << 18, i, np.float32) for i in range(6)]
    with ctx.Pool(2) as p:
        assert sorted(float(r[0]) for r in p.imap_unordered(f, arrays)) == [2.0 * (i + 1) for i in range(6)]
        assert [float(r[0]) for r in p.imap(f, arrays, chunksize=4)] == [2.0 * (i + 1) for i in range(6)]
        got, errors = [], []
        r = p.starmap_async(g, [(a, a) for a in arrays], chunksize=2, callback=got.append)
        assert all(not x.any() for x in r.get(60)) and got == [r.get()]
        p.map_async(boom, arrays[:2], error_callback=errors.append).wait(60)
        assert isinstance(errors[0], ValueError)
        it = p.imap(boom, arrays[:1])
        with pytest.raises(ValueError, match="boom"):
            next(it)
        assert p.map(f, []) == [] and list(p.imap(f, [])) == []
        assert p.apply(nap, (3,)) == 3 and p.apply(g, (), {"a": 5, "b": 2}) == 3
        p.close()
        with pytest.raises(ValueError, match="Pool not running"):
            p.apply_async(nap, (1,))
        p.join()
    with pytest.raises(ValueError):
        ctx.Pool(0)


def test_progress_bars_count_every_item_of_each_map(ctx):
    # drawn into a file here (forced on): where a bar is drawn is mp_reductions' progress suite's concern; what
    # is counted, as results arrive from the cluster, is this pool's
    import io

    def bar(desc):
        return {"desc": desc, "file": io.StringIO(), "disable": False}

    def last(options) -> str:
        return options["file"].getvalue().replace("\r", "\n").strip().splitlines()[-1]

    items = list(range(10))
    with ctx.Pool(2) as p:
        runs = {"map": bar("map"), "chunks": bar("chunks"), "imap": bar("imap"), "unordered": bar("unordered"),
                "failed": bar("failed")}
        assert p.map(nap, items, progress=runs["map"]) == items
        assert p.starmap(g, [(i, 1) for i in items], chunksize=3, progress=runs["chunks"]) == [i - 1 for i in items]
        assert list(p.imap(nap, items, progress=runs["imap"])) == items
        assert sorted(p.imap_unordered(nap, items, chunksize=4, progress=runs["unordered"])) == items
        with pytest.raises(ValueError, match="boom"):
            p.map(boom, [np.ones(2)] * 4, chunksize=1, progress=runs["failed"])
    with ctx.ProcessPoolExecutor(2) as ex:
        runs["executor"] = bar("executor")
        assert list(ex.map(nap, items, progress=runs["executor"])) == items
    for desc, options in runs.items():
        want = "0/4" if desc == "failed" else "100%|"
        assert want in last(options) and f"{desc}:" in last(options), (desc, last(options))
    assert "failed=4" in last(runs["failed"])


def test_maxtasksperchild_warns_that_it_is_not_applied(ctx):
    with pytest.warns(RuntimeWarning, match="maxtasksperchild is not applied on a Dask cluster") as record, \
            ctx.Pool(2, maxtasksperchild=1) as p:
        assert p.map(nap, [0, 1]) == [0, 1]
    assert record[0].filename == __file__  # the caller's line
    with pytest.warns(RuntimeWarning, match="max_tasks_per_child is not applied"), \
            ctx.ProcessPoolExecutor(2, max_tasks_per_child=1) as ex:
        assert list(ex.map(nap, [0])) == [0]


def test_executor_api(ctx):
    with ctx.ProcessPoolExecutor() as ex:
        fut = ex.submit(g, np.ones(3), b=np.ones(3))
        assert isinstance(fut, concurrent.futures.Future) and not fut.result(60).any()
        assert list(ex.map(g, range(5), range(5))) == [0] * 5
        assert list(ex.map(g, range(5), range(5), chunksize=2, buffersize=1)) == [0] * 5  # 3.14's, on every version
        done, _ = concurrent.futures.wait([ex.submit(nap, i) for i in range(3)], timeout=60)
        assert sorted(d.result() for d in done) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(nap, 0)


def test_segments_go_with_their_arrays_not_at_a_collection(ctx):
    """Arguments' and results' segments go once nothing uses them, with the cluster up and no garbage collection
    anywhere: none is kept by a reference cycle (the copies made for sending, the frames of a task that raised)."""
    arrays = [np.full(1 << 18, i, np.float32) for i in range(4)]
    gc.disable()
    ctx.client.run(gc.disable)
    try:
        with ctx.Pool(2) as p:
            out = p.map(f, arrays)
            p.map_async(boom, arrays, error_callback=lambda exc: None).wait(60)
        del out
        deadline = time.monotonic() + 10
        while segments() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not segments()
    finally:
        ctx.client.run(gc.enable)
        gc.enable()
