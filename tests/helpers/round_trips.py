"""Backups and prefetches of one store from a thread pool, each batch read back into a pool of
its own: what several ranks' worker threads do to one adapter at once."""
from concurrent.futures import ThreadPoolExecutor

import torch

from hicache_async.pools import HostPool


def assert_concurrent_round_trips(store, host: HostPool, batches: list[list[str]], workers: int) -> None:
    """Each batch of 4 page hashes backs up host pages 0-3 and reads them back, `workers` at a time."""
    with ThreadPoolExecutor(workers) as pool:
        assert all(r.ok == [True] * 4 for r in pool.map(lambda b: store.backup(b, host, [0, 1, 2, 3]), batches))
    readers = [HostPool(host.layout, 4) for _ in batches]
    with ThreadPoolExecutor(workers) as pool:
        pages = list(pool.map(lambda i: store.prefetch(batches[i], readers[i], [0, 1, 2, 3]).pages,
                              range(len(batches))))
    assert pages == [4] * len(batches)
    assert all(torch.equal(r.tensor, host.tensor[:4]) for r in readers)
