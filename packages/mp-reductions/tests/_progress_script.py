"""Run by _progress_suite.py in a child whose stderr is a pseudo-terminal or a pipe: every map of the Pool (and
executor_map) with progress=True, each bar named by its desc, every result checked; prints "results ok"."""

import concurrent.futures
import multiprocessing
import sys
import time

import mp_reductions as mpr

N = 60
EXPECTED = [2 * x for x in range(N)]


def twice(x):
    time.sleep(0.002)
    return 2 * x


def product(x, y):
    time.sleep(0.002)
    return x * y


def main(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    with mpr.Pool(2, context=ctx) as pool:
        assert pool.map(twice, range(N), progress=True) == EXPECTED
        assert pool.map(twice, range(N), 7, progress={"desc": "map-chunks"}) == EXPECTED
        assert pool.map_async(twice, range(N), progress={"desc": "map-async"}).get(60) == EXPECTED
        pairs = [(2, x) for x in range(N)]
        assert pool.starmap(product, pairs, progress={"desc": "starmap"}) == EXPECTED
        assert pool.starmap_async(product, pairs, 5, progress={"desc": "starmap-async"}).get(60) == EXPECTED
        assert list(pool.imap(twice, iter(range(N)), progress={"desc": "imap-gen"})) == EXPECTED
        assert list(pool.imap(twice, iter(range(N)), 7, progress={"desc": "imap-chunks"})) == EXPECTED
        assert sorted(pool.imap_unordered(twice, range(N), progress={"desc": "unordered"})) == EXPECTED
        assert sorted(pool.imap_unordered(twice, iter(range(N)), 4, progress={"desc": "unordered-chunks"})) \
            == EXPECTED
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        assert list(mpr.executor_map(ex, twice, range(N), chunksize=7, progress={"desc": "executor"})) == EXPECTED
        assert list(mpr.executor_map(ex, twice, iter(range(N)), buffersize=3,
                                     progress={"desc": "executor-buffered"})) == EXPECTED
    print("results ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
